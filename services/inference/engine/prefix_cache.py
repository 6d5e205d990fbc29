"""The prefix cache's keys (what computed a KV block, and which tokens it holds) and its requests.

A block's key chains SHA-256 over its parent's key and its own token ids; the chain starts from
the *root* of the request, a hash of the content digest of what computes its KV (the adapter
version the request acquired, or the base model). So two blocks share a key only when the same
weights computed the same tokens after the same prefix: a reloaded adapter (new content, same
name) starts a new chain, two names with equal content share one. A request's `cache_salt`
is folded into its root, so only requests of the same salt share blocks. The hash is cryptographic so
keys cannot collide by accident or by a crafted prompt.
"""

from __future__ import annotations

import hashlib
import json
import struct
from array import array
from collections import defaultdict
from pathlib import Path

from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.lora.adapter_slots import AdapterSlots

ROOT_TAG = b"loraplex-kv-v1\0"


def root_key(content_digest: str) -> bytes:
    return hashlib.sha256(ROOT_TAG + content_digest.encode()).digest()


def salted(root: bytes, salt: str) -> bytes:
    """A request's root with its `cache_salt` folded in: requests of different salts (or one
    with a salt and one without) never share a key, so never each other's cached KV."""
    if not salt:
        return root
    return hashlib.sha256(root + b"\x00cache_salt\x00" + salt.encode()).digest()


def extend_block_keys(
    keys: list[bytes], root: bytes, token_ids: list[int], page_size: int, num_blocks: int
) -> None:
    """Grow `keys` (the chain of `token_ids`' full blocks under `root`) to `num_blocks` entries.

    Stops early at a block holding a placeholder (overlap scheduling's not-yet-known token). Each
    block is hashed once in a request's life (the chain is kept), and the tokens of all new blocks
    are packed to bytes in one go: this runs on the engine thread."""
    first = len(keys)
    num_blocks = min(num_blocks, len(token_ids) // page_size)
    if num_blocks <= first:
        return
    tokens = token_ids[first * page_size : num_blocks * page_size]
    if min(tokens) < 0:
        num_blocks = first + next(i for i, t in enumerate(tokens) if t < 0) // page_size
        tokens = tokens[: (num_blocks - first) * page_size]
    packed = array("q", tokens)
    step = page_size * packed.itemsize
    packed = memoryview(packed.tobytes())
    parent = keys[-1] if keys else root
    for offset in range(0, len(packed), step):
        parent = hashlib.sha256(parent + packed[offset : offset + step]).digest()
        keys.append(parent)


def base_model_digest(model_dir: Path, dtype_name: str) -> str:
    """The base model's identity for the cache: config.json, every safetensors file's header (tensor
    names, dtypes, shapes, offsets) and size, and the serving dtype. Tensor values are not read
    (hashing 16 GB would cost tens of seconds at start); the key only has to differ between
    what computes KV inside one process, where the base weights never change, and the `base:`
    namespace keeps it apart from every adapter's `sha256:` digest."""
    h = hashlib.sha256()
    h.update(dtype_name.encode() + b"\0")
    config = model_dir / "config.json"
    if config.is_file():
        h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            header = f.read(min(n, max(size - 8, 0)))
        h.update(path.name.encode() + b"\0" + str(size).encode() + b"\0" + header)
    return "base:" + h.hexdigest()


class PrefixCacheStats:
    """Per adapter ("" = base): prompt tokens of first admissions and how many came from the cache."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.hit_tokens: dict[str, int] = defaultdict(int)

    def record(self, adapter: str | None, prompt_tokens: int, hit_tokens: int) -> None:
        name = adapter or ""
        self.prompt_tokens[name] += prompt_tokens
        self.hit_tokens[name] += hit_tokens

    def forget(self, adapter: str) -> None:
        """Drop an unloaded adapter's counters: a server that lives on churn would otherwise keep one
        entry per adapter name ever served (a name served again starts from 0; the metrics follow)."""
        self.prompt_tokens.pop(adapter, None)
        self.hit_tokens.pop(adapter, None)


class PrefixCache:
    """The scheduler's side of the cache: finds a request's cached prefix at admission, registers
    the full blocks it computes. Blocks, refcounts and eviction live in the BlockManager."""

    def __init__(self, blocks: BlockManager, adapter_slots: AdapterSlots, base_digest: str):
        self.blocks = blocks
        self.adapter_slots = adapter_slots
        self.base_root = root_key(base_digest)
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.blocks.prefix_cache

    def lookup(self, req: Request) -> list[int]:
        """Cached blocks that can start `req`'s empty block table (nothing is taken yet). At least
        one token is left to compute, so there are logits to sample."""
        if not self.enabled or req.block_table:
            return []
        if req.adapter is None:
            root = salted(self.base_root, req.params.cache_salt)
        elif req.lora_slot >= 0 or req.lora_suspended:
            root = req.kv_root  # fixed (and salted) when its slot was acquired
        else:  # a hint until acquire: `confirm_root` checks it against the slot's version
            digest = self.adapter_slots.content_digest(req.adapter)
            root = salted(root_key(digest), req.params.cache_salt) if digest else None
        _set_root(req, root)
        if root is None:
            return []
        page = self.blocks.page_size
        n = (len(req.token_ids) - 1) // page
        if req.params.prompt_logprobs is not None:
            # A prompt token's log probability needs the last layer's output at the position before
            # it, which a KV block does not keep: reuse only blocks whose positions' log
            # probabilities this request already has (a readmission after preemption), compute the
            # rest. Its blocks are still registered for other requests.
            n = min(n, len(req.prompt_logprobs) // page)
        extend_block_keys(req.block_keys, root, req.token_ids, page, n)
        return self.blocks.match(req.block_keys[:n])

    def confirm_root(self, req: Request) -> bool:
        """Key `req` by the version its just-acquired slot holds; False when `lookup` used another
        (the adapter was reloaded in between): look up again."""
        if not self.enabled:
            return True
        digest = self.adapter_slots.slot_digest(req.lora_slot)
        root = salted(root_key(digest), req.params.cache_salt) if digest else None
        if root == req.kv_root:
            return True
        _set_root(req, root)
        return False

    def reuse(self, req: Request, hit: list[int]) -> None:
        """Start the admitted `req`'s table with the blocks `lookup` found this step."""
        if not self.enabled:
            return
        self.blocks.reuse(req.block_table, hit)
        hit_tokens = len(hit) * self.blocks.page_size
        req.num_computed_tokens += hit_tokens
        req.num_registered_blocks = len(hit)
        if req.num_preemptions == 0:
            self.stats.record(req.adapter, req.num_prompt_tokens, hit_tokens)
            req.num_cached_prompt_tokens = min(hit_tokens, req.num_prompt_tokens)

    def register(self, req: Request) -> None:
        """Offer `req`'s full blocks whose KV is computed to the cache. Their tokens are known: an
        overlap placeholder is only ever the last token, not yet computed."""
        if req.kv_root is None:
            return
        page = self.blocks.page_size
        n = min(req.num_computed_tokens // page, len(req.block_table))
        if n <= req.num_registered_blocks:
            return
        extend_block_keys(req.block_keys, req.kv_root, req.token_ids, page, n)
        n = min(n, len(req.block_keys))
        for i in range(req.num_registered_blocks, n):
            self.blocks.register(req.block_keys[i], req.block_table[i])
        req.num_registered_blocks = max(n, req.num_registered_blocks)


def _set_root(req: Request, root: bytes | None) -> None:
    if req.kv_root != root:
        req.kv_root = root
        req.block_keys = []
