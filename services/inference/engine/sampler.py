"""One batched sampling call per step: penalties, temperature, top-k, top-p, min-p, seeded draws.

Each request draws its randomness from its own torch.Generator (seeded from the request's
`seed`), one vocabulary-sized draw per step, so a seeded request produces the same tokens
whatever else shares its batch. The draw is the exponential-race (Gumbel-max) form of
multinomial sampling: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Below this a temperature is greedy: logits / 1e-40 overflow float32 to inf (NaN after the
# softmax) and argmax then picks token 0, while any temperature this small already puts all
# the probability on the top token.
MIN_TEMPERATURE = 1e-5


class SamplingInputs(NamedTuple):
    """Per row of the logits, in the same order (plain data; built by the engine)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    repetition_penalty: list[float]
    frequency_penalty: list[float]
    presence_penalty: list[float]
    generators: list[torch.Generator | None]  # None only for greedy rows
    prompt_ids: list[list[int]]  # read only when a repetition penalty is set
    output_ids: list[list[int]]  # read only when any penalty is set
    # ids masked out of this row (min_tokens' stop tokens, bad words' next tokens)
    banned: list[tuple[int, ...]] | None = None
    bias: list[tuple[tuple[int, float], ...]] | None = None  # (id, bias) added to this row (logit_bias)
    allowed: list[tuple[int, ...]] | None = None  # non-empty: only these ids (allowed_token_ids)


def _pad(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        valid[i, : len(r)] = True
    return ids.to(device), valid.to(device)


def apply_penalties(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """Repetition (prompt + output, divides positive logits / multiplies negative ones, as in
    transformers), then frequency (per occurrence) and presence (once) over the output, as in OpenAI."""
    device = logits.device
    # Decide on the host lists: building device tensors and reading `.any()` back costs a
    # host-to-device copy and a sync each, every step, for batches that use no penalty.
    if (
        all(r == 1 for r in inp.repetition_penalty)
        and not any(inp.frequency_penalty)
        and not any(inp.presence_penalty)
    ):
        return logits
    rep = torch.tensor(inp.repetition_penalty, dtype=logits.dtype, device=device)
    if (rep != 1).any():
        ids, valid = _pad([p + o for p, o in zip(inp.prompt_ids, inp.output_ids, strict=True)], device)
        seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, valid)
        penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, penalised, logits)
    freq = torch.tensor(inp.frequency_penalty, dtype=logits.dtype, device=device)
    pres = torch.tensor(inp.presence_penalty, dtype=logits.dtype, device=device)
    if (freq != 0).any() or (pres != 0).any():
        ids, valid = _pad(inp.output_ids, device)
        counts = torch.zeros_like(logits).scatter_add_(1, ids, valid.to(logits.dtype))
        logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    # The on/off decisions read host copies: `.any()` on a device tensor would sync every step.
    device, vocab = logits.device, logits.shape[1]
    top_k_host = torch.tensor([k if 0 < k < vocab else vocab for k in inp.top_k])
    top_p_host = torch.tensor(inp.top_p, dtype=logits.dtype)
    min_p_host = torch.tensor(inp.min_p, dtype=logits.dtype)
    if (top_k_host < vocab).any() or (top_p_host < 1).any():
        top_k, top_p = top_k_host.to(device, non_blocking=True), top_p_host.to(device, non_blocking=True)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p (the first always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
    if (min_p_host > 0).any():
        min_p = min_p_host.to(device, non_blocking=True)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(
            probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf")
        )
    return logits


def _ban(logits: torch.Tensor, banned: list[tuple[int, ...]] | None) -> torch.Tensor:
    if not banned or not any(banned):
        return logits
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    cols = [t for ids in banned for t in ids]
    mask = torch.zeros(logits.shape, dtype=torch.bool)
    mask[rows, cols] = True
    return logits.masked_fill(mask.to(logits.device, non_blocking=True), float("-inf"))


def _add_bias(logits: torch.Tensor, bias: list[tuple[tuple[int, float], ...]] | None) -> torch.Tensor:
    """A sparse add: only the (row, id) pairs some request asked for; rows that ask nothing cost nothing."""
    if not bias or not any(bias):
        return logits
    rows = torch.tensor([i for i, pairs in enumerate(bias) for _ in pairs], dtype=torch.int64)
    cols = torch.tensor([t for pairs in bias for t, _ in pairs], dtype=torch.int64)
    vals = torch.tensor([b for pairs in bias for _, b in pairs], dtype=logits.dtype)
    device = logits.device
    return logits.index_put(
        (rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)),
        vals.to(device, non_blocking=True),
        accumulate=True,
    )


def _allow_only(logits: torch.Tensor, allowed: list[tuple[int, ...]] | None) -> torch.Tensor:
    """Rows with an allowed list keep only those ids; the other rows are left as they are."""
    if not allowed or not any(allowed):
        return logits
    blocked = torch.zeros(logits.shape, dtype=torch.bool)
    for i, ids in enumerate(allowed):
        if ids:
            blocked[i] = True
            blocked[i, list(ids)] = False
    return logits.masked_fill(blocked.to(logits.device, non_blocking=True), float("-inf"))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    # Same answer as argmax (first index of the maximum); about 2x faster on CPU.
    return x.max(dim=-1).indices


def filtered_probs(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """Each row's sampling distribution: temperature (greedy rows at 1), then top-k, top-p, min-p."""
    # Host tensors moved with non_blocking: a blocking copy (or torch.tensor(..., device=cuda)) waits
    # for the whole stream, i.e. for the step queued after this one under overlap scheduling.
    temps = torch.tensor(
        [t if t >= MIN_TEMPERATURE else 1.0 for t in inp.temperature], dtype=logits.dtype
    ).to(logits.device, non_blocking=True)
    return _filter(logits / temps[:, None], inp).softmax(dim=-1)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool `[B]` on the logits' device: the rows holding a NaN or Inf logit (one batched reduction,
    no host sync; the engine reads it with the sampled ids, `read_sampled`)."""
    return ~torch.isfinite(logits).all(dim=-1)


def read_sampled(tokens: torch.Tensor, nonfinite: torch.Tensor) -> tuple[list[int], list[bool]]:
    """The sampled ids and the rows' non-finite flags on the host, in one copy (one sync)."""
    both = torch.stack((tokens, nonfinite.to(tokens.dtype))).tolist()
    return both[0], [bool(b) for b in both[1]]


def sample(logits: torch.Tensor, inp: SamplingInputs) -> list[int]:
    """logits: [B, vocab] float32 -> one token id per row (waits for the device)."""
    return sample_on_device(logits, inp).tolist()


def sample_on_device(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """logits: [B, vocab] float32 -> int64 token ids `[B]` on the logits' device, without a host sync
    (penalty history is the one host input read here, and only when a penalty is set)."""
    logits = _add_bias(apply_penalties(logits, inp), inp.bias)
    logits = _ban(_allow_only(logits, inp.allowed), inp.banned)
    greedy_tokens = _argmax(logits)
    random_rows = [i for i, t in enumerate(inp.temperature) if t >= MIN_TEMPERATURE]
    if not random_rows:
        return greedy_tokens
    probs = filtered_probs(logits, inp)
    races = torch.ones_like(probs)
    for i in random_rows:
        races[i].exponential_(generator=inp.generators[i])
    sampled = _argmax(probs / races)
    is_random = torch.zeros(len(inp.temperature), dtype=torch.bool)
    is_random[random_rows] = True
    return torch.where(is_random.to(logits.device, non_blocking=True), sampled, greedy_tokens)
