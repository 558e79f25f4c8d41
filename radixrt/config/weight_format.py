"""Weight-only quantization formats: their names, and the bytes each stores per weight.

``--quantization int8``: one int8 per weight and one scale per output channel
(symmetric: ``w = q * scale``). ``--quantization int4``: two weights per byte
and, per group of ``--quantization-group-size`` consecutive inputs of an output
channel, a scale and a minimum (``w = q * scale + min``, ``q`` in 0..15: the
layout of llama.cpp's Q4_1 at group size 32). Both act on the decoder's linear
layers; embeddings and norms stay in the model dtype, the LM head too unless
``--quantize-lm-head``. Activations stay in the model dtype (weight-only).

Accepted spellings (normalized by `normalize_method`): ``int8`` also as
``int8wo``, ``int8_weight_only`` and ``w8a16`` (torchao's and SGLang's
``--torchao-config`` names); ``int4`` also as ``int4wo``,
``int4_weight_only`` and ``w4a16``; ``int4wo-<G>`` (SGLang's torchao spelling)
is ``int4`` with group size ``G``. Stdlib only: `radixrt plan` reads it
without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

QUANTIZATION_METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 32
_ALIASES = {
    "int8": "int8",
    "int8wo": "int8",
    "int8_weight_only": "int8",
    "w8a16": "int8",
    "int4": "int4",
    "int4wo": "int4",
    "int4_weight_only": "int4",
    "w4a16": "int4",
}
INT8_SCALE_BYTES = 4  # int8: a float32 scale per output channel
INT4_SCALE_BYTES = 2  # int4: a float16 scale and minimum per group, as the CPU kernel reads them


def normalize_method(name: Optional[str]) -> tuple[Optional[str], Optional[int]]:
    """``(method, group size or None)`` for a spelling of the module docstring.

    Raises ValueError naming ``quantization`` for an unknown name."""
    if name is None or str(name).lower() in ("", "none"):
        return None, None
    key = str(name).strip().lower().replace("-", "_")
    m = re.fullmatch(r"int4wo_(\d+)", key)
    if m:
        return "int4", int(m.group(1))
    if key not in _ALIASES:
        raise ValueError(
            f"unknown quantization {name!r}; choose int8 or int4 (weight-only; also accepted: "
            f"{', '.join(sorted(set(_ALIASES) - set(QUANTIZATION_METHODS)))}, int4wo-<group size>)"
        )
    return _ALIASES[key], None


def check_group_size(group_size: int) -> None:
    """Raise ValueError naming ``quantization_group_size`` unless it is one the kernels take."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"quantization_group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size!r}"
        )


@dataclass(frozen=True)
class WeightQuantization:
    """One quantized format: ``method`` int8 or int4, ``group_size`` (int4's; ignored for int8).

    ``prefill_dtype``: the dtype of the matrix products from 256 rows on (prefill), where the
    dequantized weight meets the activations: float32, or bfloat16 where ``dtype`` auto picks
    it on a CPU with native bf16 (set by the model runner; decode rows always take the
    kernel's int8 path)."""

    method: str
    group_size: int = DEFAULT_GROUP_SIZE
    lm_head: bool = False
    prefill_dtype: str = "float32"

    def bytes_per_weight(self) -> float:
        """Stored bytes per weight, scales included (inputs a multiple of the group size)."""
        if self.method == "int8":
            return 1.0  # plus one scale per output channel: see `linear_bytes`
        return 0.5 + 2 * INT4_SCALE_BYTES / self.group_size

    def linear_bytes(self, out_features: int, in_features: int) -> float:
        """Bytes of one quantized ``[out_features, in_features]`` weight (bias not included)."""
        if self.method == "int8":
            return out_features * (in_features + INT8_SCALE_BYTES)
        return out_features * in_features * self.bytes_per_weight()
