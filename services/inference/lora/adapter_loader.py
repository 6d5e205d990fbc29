"""Read a PEFT adapter's tensors into host memory (AdapterWeights), checked against the model's shapes.

`adapter_model.safetensors` keys look like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). The header is checked (keys, shapes) before any data is read. The directory's files,
their bounds and the content digest are adapter_files.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid
from loraplex.services.inference.lora.adapter_files import (
    PICKLE_FILES,
    WEIGHTS_FILE,
    check_header_size,
    content_digest,
    read_chat_template,
    read_config,
    read_side_file,
)
from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.config import (
    AdapterSpec,
    ModuleLoRA,
    resolve_embedding_targets,
    resolve_targets,
)
from loraplex.services.inference.lora.dora import MAGNITUDE_KEY, read_magnitudes
from loraplex.services.inference.lora.embedding_lora import (
    finish_embedding_lora,
    read_embedding_tensor,
)
from loraplex.services.inference.lora.expert_targets import (
    EXPERT_KEY,
    read_expert_tensor,
    resolve_expert_targets,
    tensor_keys,
)
from loraplex.services.inference.lora.packed_groups import pack_groups
from loraplex.services.inference.lora.shapes import FUSED_MODULES, FUSED_OF, ModelShapes, module_path
from loraplex.services.inference.lora.tensor_checks import read_checked
from loraplex.services.inference.lora.trainable_tokens import (
    TokenRows,
    check_added_tokens,
    check_token_layers,
    finish_token_rows,
    read_token_rows,
)

_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")


def load_adapter_weights(
    directory: str | Path,
    shapes: ModelShapes,
    *,
    dtype: torch.dtype = torch.float32,
    pin_memory: bool = False,
) -> AdapterWeights:
    """Validate config and weights against `shapes`; return host tensors in `dtype`.

    AdapterInvalid: malformed config, missing/unexpected tensors, rank disagreeing with the config.
    AdapterIncompatible: layer indices or widths of another base model.
    """
    spec, directory = read_config(directory)
    targets = resolve_targets(spec, shapes.num_layers, shapes.hf_modules)
    embedding_targets = check_embedding_targets(spec, shapes)
    embedding_read: dict[str, dict[str, torch.Tensor]] = {}
    token_layers = check_token_layers(spec.trainable_tokens, shapes.vocab_size, shapes.tie_word_embeddings)
    token_read: dict[str, TokenRows] = {}
    expert_targets = resolve_expert_targets(spec, shapes)
    expert_keys = tensor_keys(expert_targets)
    expert_a: dict[tuple[int, str], torch.Tensor] = {}
    expert_b: dict[tuple[int, str], torch.Tensor] = {}
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        if any((directory / n).exists() for n in PICKLE_FILES):
            raise AdapterInvalid(
                f"{directory} has only pickle weights ({', '.join(PICKLE_FILES)}), which are never "
                "loaded here (unpickling can run code); convert them to safetensors, or register "
                "the adapter with a store started with --allow-pickle",
                field=WEIGHTS_FILE,
            )
        raise AdapterInvalid(f"{directory} has no {WEIGHTS_FILE}", field=WEIGHTS_FILE)
    check_header_size(weights_path)

    def hf_module(module: str) -> str:  # the HF module a pool module's weights come from
        return FUSED_OF.get(module, module) if shapes.fused_checkpoint else module

    by_path = {module_path(n, hf_module(m)): (n, hf_module(m)) for (n, m) in targets}
    lora_a: dict[tuple[int, str], torch.Tensor] = {}
    lora_b: dict[tuple[int, str], torch.Tensor] = {}
    magnitude: dict[tuple[int, str], torch.Tensor] = {}
    try:
        f = safe_open(str(weights_path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise AdapterInvalid(
            f"{WEIGHTS_FILE} is not a readable safetensors file: {e}", field=WEIGHTS_FILE
        ) from None
    with f:
        keys = list(f.keys())
        for key in keys:
            if EXPERT_KEY.match(key):
                t = read_expert_tensor(f, key, expert_keys, expert_targets, shapes)
                layer, module, ab = expert_keys[key]
                t = t.to(dtype).contiguous()
                (expert_a if ab == "A" else expert_b)[(layer, module)] = t.pin_memory() if pin_memory else t
                continue
            if read_token_rows(f, key, token_layers, shapes.hidden_size, dtype, token_read):
                continue
            if read_embedding_tensor(
                f, key, embedding_targets, shapes.vocab_size, shapes.hidden_size, dtype, embedding_read
            ):
                continue
            mag = MAGNITUDE_KEY.match(key)
            if mag is not None and mag.group("path") in by_path:
                read_magnitudes(f, key, by_path[mag.group("path")], shapes, spec.use_dora, magnitude)
                continue
            m = _KEY.match(key)
            if m is None:
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: unexpected tensor {key!r} (only lora_A/lora_B weights "
                    "of the target modules are supported)",
                    field=WEIGHTS_FILE,
                )
            path = m.group("path")
            if path not in by_path:
                layer = re.match(r"model\.layers\.(\d+)\.", path)
                if layer and int(layer.group(1)) >= shapes.num_layers:
                    raise AdapterIncompatible(
                        f"{WEIGHTS_FILE}: {key!r} is for layer {layer.group(1)} but this "
                        f"base model has {shapes.num_layers} layers",
                        field=WEIGHTS_FILE,
                    )
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: tensor {key!r} is for a module that adapter_config.json "
                    "target_modules does not target",
                    field=WEIGHTS_FILE,
                )
            layer, module = by_path[path]
            rank = targets[(layer, FUSED_MODULES.get(module, (module,))[0])].rank
            d_in, d_out = shapes.module_dims(module)
            shape = tuple(f.get_slice(key).get_shape())
            expected = (rank, d_in) if m.group("ab") == "A" else (d_out, rank)
            if len(shape) != 2:
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: {key!r} has shape {shape}, expected 2-D", field=WEIGHTS_FILE
                )
            rank_axis = 0 if m.group("ab") == "A" else 1
            if shape[rank_axis] != rank:
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: {key!r} has rank {shape[rank_axis]} but adapter_config.json "
                    f"(r / rank_pattern) gives {rank}",
                    field="r",
                )
            if shape != expected:
                raise AdapterIncompatible(
                    f"{WEIGHTS_FILE}: {key!r} has shape {shape}, this base model needs "
                    f"{expected}: the adapter was trained for another base model",
                    field=WEIGHTS_FILE,
                )
            t = read_checked(f, key).to(dtype)  # dtype, finite, magnitude (lora/tensor_checks.py)
            parts = FUSED_MODULES.get(module, (module,))
            # A fused module's parts share its A; each takes its rows of B.
            pieces = (
                [t] * len(parts)
                if m.group("ab") == "A"
                else t.split([shapes.module_dims(p)[1] for p in parts], dim=0)
            )
            for part, piece in zip(parts, pieces, strict=True):  # packed (and pinned) below
                (lora_a if m.group("ab") == "A" else lora_b)[(layer, part)] = piece
    missing = (
        list(
            dict.fromkeys(
                module_path(n, hf_module(mod)) + ".lora_" + ab
                for (n, mod) in targets
                for ab, d in (("A", lora_a), ("B", lora_b))
                if (n, mod) not in d
            )
        )
        + [
            module_path(n, hf_module(mod)) + ".lora_magnitude_vector"
            for (n, mod) in (targets if spec.use_dora else ())
            if (n, mod) not in magnitude
        ]
        + [
            key
            for key, (n, mod, ab) in expert_keys.items()
            if (n, mod) not in (expert_a if ab == "A" else expert_b)
        ]
    )
    if missing:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: missing tensors for targeted modules: {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""),
            field=WEIGHTS_FILE,
        )
    embedding = finish_embedding_lora(embedding_targets, embedding_read)
    token_rows = finish_token_rows(token_layers, token_read, shapes.tie_word_embeddings)
    both = sorted(set(token_rows) & set(embedding))
    if both:
        raise AdapterInvalid(
            f"adapter_config.json: trainable_token_indices: {both[0]} has both trainable token rows and "
            "LoRA; serve one of them",
            field="trainable_token_indices",
        )
    if token_rows or embedding:  # its tokenizer must not need rows the base does not have
        check_added_tokens(directory, shapes.vocab_size, read_side_file)
    chat_template, side_files = read_chat_template(directory)
    weights = AdapterWeights(
        spec=spec,
        targets=targets,
        lora_a=lora_a,
        lora_b=lora_b,
        digest=content_digest(directory, side_files),
        chat_template=chat_template,
        expert_targets=expert_targets,
        expert_a=expert_a,
        expert_b=expert_b,
        dora_magnitude=magnitude,
        embedding=embedding,
        token_rows=token_rows,
    )
    return pack_groups(weights, shapes, pin_memory=pin_memory)


def check_embedding_targets(spec: AdapterSpec, shapes: ModelShapes) -> dict[str, ModuleLoRA]:
    """The embedding / lm_head targets, refused where this engine cannot serve them."""
    targets = resolve_embedding_targets(spec, shapes.num_layers)
    if targets and spec.use_dora:
        raise AdapterInvalid(
            "adapter_config.json: use_dora: DoRA on embed_tokens / lm_head is not supported "
            "(DoRA on the linear projections is)",
            field="use_dora",
        )
    if targets and not shapes.vocab_size:
        raise AdapterIncompatible(
            "adapter_config.json: target_modules: the base model's vocabulary size is unknown here, "
            "so LoRA on embed_tokens / lm_head cannot be checked",
            field="target_modules",
        )
    return targets
