"""Turn a pickled `adapter_model.bin` into safetensors, loading it with weights_only=True.

Only reached when the store runs with --allow-pickle; the pickle is never kept.
"""

from __future__ import annotations

from pathlib import Path

from loraplex.adapter_store.errors import InvalidArgument

PICKLE_FILE = "adapter_model.bin"


def convert_pickle_to_safetensors(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import save_file

    try:
        state = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # the restricted unpickler raises many types; all mean "refused"
        raise InvalidArgument(
            f"{PICKLE_FILE}: could not be loaded with torch.load(weights_only=True): {e}", field=PICKLE_FILE
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise InvalidArgument(f"{PICKLE_FILE}: is not a flat dict of name -> tensor", field=PICKLE_FILE)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst), metadata={"format": "pt"})
