"""What one token of KV costs, for every ``kv_cache_dtype``: the one place
that arithmetic lives.

`KVPool` sizes itself with it, the model runner turns a memory budget into
pages with it, ``radixrt plan`` prints it, and the server reports it at
``/get_server_info`` and ``/metrics``. Plain Python (no torch), so that the
planner stays torch-free.

Per token, across all layers, K and V:

    data  = 2 x layers x kv_heads x head_dim x element_bytes
    scale = 2 x layers x kv_heads x scale_bytes

``kv_cache_dtype``: ``auto`` stores the model dtype (float32 on CPU,
bfloat16 on CUDA, as before); ``int8`` stores one byte per value plus a
float16 scale per token and KV head (2 bytes per ``head_dim`` values: 3.1%
of the data at head_dim 64); ``fp8_e4m3`` / ``fp8_e5m2`` store one byte per
value and one scalar per layer (no per-token cost). The schemes themselves
are in ``kernels/kv_cache.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")

# plain (unquantized) storage dtypes: bytes per element
PLAIN_DTYPE_BYTES: dict[str, float] = {
    "float64": 8,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
}
_ALIASES = {"fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e4m3": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
INT8_SCALE_BYTES = 2  # float16, kernels/kv_cache.py INT8_SCALE_DTYPE
GIB = 1 << 30


@dataclass(frozen=True)
class KVCacheFormat:
    """How K/V values are stored: ``name`` is the kv_cache_dtype (``auto``
    resolved to the model dtype's name), ``element_bytes`` per value,
    ``scale_bytes`` per token, KV head and K-or-V."""

    name: str
    element_bytes: float
    scale_bytes: int
    scheme: str

    @property
    def quantized(self) -> bool:
        return self.name in ("int8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_format(kv_cache_dtype: str, model_dtype: str = "bfloat16") -> KVCacheFormat:
    """The format of ``kv_cache_dtype`` (one of `KV_CACHE_DTYPES`, or ``fp8`` /
    ``float8_e4m3fn`` / ``float8_e5m2`` aliases) for a model running in
    ``model_dtype`` (a name such as ``bfloat16``, ``bf16`` or ``torch.float32``).
    A plain dtype name (``float16``, ``fp32`` ...) is also accepted as the
    storage dtype itself."""
    name = kv_cache_dtype.lower().replace("torch.", "")
    name = _ALIASES.get(name, name)
    if name == "auto":
        name = model_dtype.lower().replace("torch.", "")
    if name == "int8":
        return KVCacheFormat("int8", 1, INT8_SCALE_BYTES, "int8, absmax scale per token and KV head (float16)")
    if name in ("fp8_e4m3", "fp8_e5m2"):
        return KVCacheFormat(name, 1, 0, f"{name}, one scale per layer for K and for V (1.0)")
    if name in PLAIN_DTYPE_BYTES:
        return KVCacheFormat(name, PLAIN_DTYPE_BYTES[name], 0, "unquantized")
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class KVFootprint:
    """Bytes per token and capacity of a KV cache of one model shape and format."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    format: KVCacheFormat

    @property
    def data_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.format.element_bytes

    @property
    def scale_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.format.scale_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.data_bytes_per_token + self.scale_bytes_per_token

    @property
    def scale_overhead(self) -> float:
        """Scale bytes as a share of the data bytes (int8 at head_dim 64: 2/64)."""
        return self.scale_bytes_per_token / self.data_bytes_per_token

    def tokens_in(self, budget_bytes: float) -> int:
        """Tokens whose KV fits in ``budget_bytes`` (0 for a negative budget)."""
        return max(0, int(budget_bytes // self.bytes_per_token))

    @property
    def tokens_per_gib(self) -> int:
        return self.tokens_in(GIB)

    def describe(self, total_tokens: Optional[int] = None) -> dict[str, Any]:
        """A JSON-ready summary (``/get_server_info``'s ``kv_cache``, ``/metrics``)."""
        out: dict[str, Any] = {
            "kv_cache_dtype": self.format.name,
            "scheme": self.format.scheme,
            "bytes_per_token": _num(self.bytes_per_token),
            "data_bytes_per_token": _num(self.data_bytes_per_token),
            "scale_bytes_per_token": self.scale_bytes_per_token,
            "scale_overhead": round(self.scale_overhead, 6),
            "tokens_per_gib": self.tokens_per_gib,
        }
        if total_tokens is not None:
            out["total_tokens"] = int(total_tokens)
            out["total_bytes"] = _num(self.bytes_per_token * int(total_tokens))
        return out


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def kv_footprint(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str = "auto", model_dtype: str = "bfloat16"
) -> KVFootprint:
    return KVFootprint(num_layers, num_kv_heads, head_dim, kv_cache_format(kv_cache_dtype, model_dtype))
