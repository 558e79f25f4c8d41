"""Reading a tiny checkpoint's tensors back, to compare with what a server or Engine serves."""

from __future__ import annotations

from pathlib import Path


def checkpoint_rows(folder: str, name: str, rows: int) -> list:
    """The first ``rows`` rows of the tensor ``name`` of a one-file checkpoint, as float32 lists
    (``lm_head.weight`` where it is tied: the embedding)."""
    from safetensors import safe_open

    (file,) = Path(folder).glob("*.safetensors")
    with safe_open(str(file), framework="pt") as f:
        if name not in f.keys() and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        return f.get_tensor(name)[:rows].float().tolist()
