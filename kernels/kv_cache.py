"""One layer's KV cache as the attention backends see it, and how it is quantized.

The pool hands every backend a `LayerKVCache`: flat ``[num_slots, Hkv, D]`` K and
V tensors (views of the pool's paged buffers) plus what it takes to read them
back. Writes go through `LayerKVCache.store` (called by
`AttentionBackend._store_new_kv`, the one write path of every backend); the
torch backend reads with `LayerKVCache.gather` / `LayerKVCache.slice`, which
dequantize to the compute dtype.

The storage dtype of ``k``/``v`` selects the scheme (``kv_cache_dtype``):

* **plain** (float32, bfloat16, float16; ``auto`` is the model dtype): stored
  as is.
* **int8**: symmetric absmax quantization per token and per KV head. For the
  ``D`` values ``x`` of one token's head, ``s = max|x| / 127`` is stored as
  float16 in ``k_scale``/``v_scale`` (``[num_slots, Hkv]``: the pool's
  ``[num_pages, page_size, Hkv]`` scale buffers, so one slot id indexes data
  and scale), ``q = round(x / s)`` clamped to ``[-127, 127]``, and
  ``x ~= q * s``. Each element is off by at most ``s / 2`` plus the float16
  rounding of ``s`` (relative ``2**-11``): about 0.4% of the head's largest
  value. ``s`` is kept within float16's normal range, so heads whose values
  are all below ``127 * 2**-14`` are rounded to steps of ``2**-14``.
* **fp8** (``float8_e4m3fn`` or ``float8_e5m2``): the value divided by one
  scale per layer for K and one for V (``k_scalar``/``v_scalar``, 1.0 by
  default: uncalibrated, as vLLM's default), saturated at the format's
  largest finite value (448 for e4m3, 57344 for e5m2). FlashInfer's paged
  kernels read such a cache directly and take exactly these two scalars
  (``run(..., k_scale=, v_scale=)``); they accept no per-token scales, which
  is why fp8 has none. Being floating point, fp8 keeps a relative error
  instead: at most ``2**-4`` (e4m3) or ``2**-3`` (e5m2) of the value for
  normal values (``|x| >= 2**-6`` for e4m3, ``2**-14`` for e5m2), at most
  half a subnormal step (``2**-10``, ``2**-17``) below.

Attention always reads what the cache holds, the tokens of this step
included: a prefix read from the radix cache and one computed in the same
step give the same numbers.

This module is part of the `kernels/` leaf: it imports nothing from radixrt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# kv_cache_dtype name -> storage dtype (``auto`` stores the model dtype)
KV_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_SCALE_DTYPE = torch.float16  # per token-head scales of the int8 scheme
INT8_QMAX = 127
_SCALE_MIN = torch.finfo(INT8_SCALE_DTYPE).tiny  # 2**-14: the smallest normal float16
_SCALE_MAX = torch.finfo(INT8_SCALE_DTYPE).max


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores K/V in: the model dtype for ``auto``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_STORAGE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose auto, " + ", ".join(KV_STORAGE_DTYPES))
    return KV_STORAGE_DTYPES[kv_cache_dtype]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` -> (int8 ``[..., D]``, float16 scales ``[...]``), absmax over the last dim."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_QMAX).clamp_(_SCALE_MIN, _SCALE_MAX).to(INT8_SCALE_DTYPE)
    q = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_int8` (computed in float32, returned as ``dtype``)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scalar: float = 1.0) -> torch.Tensor:
    """``x / scalar`` in fp8, saturated at the format's largest finite value (a plain
    cast of a larger value gives NaN or inf on CUDA)."""
    fmax = torch.finfo(dtype).max
    xf = x.float()
    if scalar != 1.0:
        xf = xf / scalar
    return xf.clamp(-fmax, fmax).to(dtype)


def dequantize_fp8(q: torch.Tensor, scalar: float, dtype: torch.dtype) -> torch.Tensor:
    if scalar == 1.0:
        return q.to(dtype)
    return (q.float() * scalar).to(dtype)


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` for a ``[num_slots, Hkv, D]`` cache, each slot's ``Hkv * D``
    values copied as one row: `index_select` over the 3-D tensor is several times
    slower on the CPU for slots in decode order (interleaved across requests;
    docs/benchmarks.md, "CPU decode attention")."""
    return cache.view(cache.shape[0], -1).index_select(0, slots).view(-1, *cache.shape[1:])


def _scheme(dtype: torch.dtype) -> str:
    if dtype == torch.int8:
        return "int8"
    if dtype in FP8_DTYPES:
        return "fp8"
    return "plain"


@dataclass(frozen=True)
class LayerKVCache:
    """One layer's cache: flat ``[num_slots, Hkv, D]`` views of the pool (no copies).

    ``k_scale``/``v_scale``: the int8 scheme's ``[num_slots, Hkv]`` float16
    scales (None otherwise). ``k_scalar``/``v_scalar``: the fp8 scheme's
    per-layer scales (stored = value / scalar). See the module docstring.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    k_scalar: float = 1.0
    v_scalar: float = 1.0

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dtype != self.v.dtype:
            raise ValueError(
                f"K {tuple(self.k.shape)} {self.k.dtype} and V {tuple(self.v.shape)} {self.v.dtype} caches differ"
            )
        scheme = _scheme(self.k.dtype)
        has_scales = self.k_scale is not None and self.v_scale is not None
        if scheme == "int8":
            if not has_scales:
                raise ValueError("an int8 KV cache needs its per-token k_scale and v_scale")
            assert self.k_scale is not None and self.v_scale is not None
            if self.k_scale.shape != self.k.shape[:2] or self.v_scale.shape != self.v.shape[:2]:
                raise ValueError(f"int8 scales must be [num_slots, Hkv] = {tuple(self.k.shape[:2])}")
        elif self.k_scale is not None or self.v_scale is not None:
            raise ValueError(f"per-token scales belong to int8 caches only, not {self.k.dtype}")

    @property
    def scheme(self) -> str:
        """``plain``, ``int8`` or ``fp8``."""
        return _scheme(self.k.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype."""
        return self.k.dtype

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[1])

    # ------------------------------------------------------------------ write
    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write (quantizing) ``k``/``v`` ``[n, Hkv, D]`` at the flat slot ids ``slots`` ``[n]``."""
        scheme = self.scheme
        if scheme == "int8":
            assert self.k_scale is not None and self.v_scale is not None
            for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                q, s = quantize_int8(x)
                cache.index_copy_(0, slots, q)
                scales.index_copy_(0, slots, s)
        elif scheme == "fp8":
            # index_copy_ has no float8 kernel on CPU: copy the bytes
            for cache, scalar, x in ((self.k, self.k_scalar, k), (self.v, self.v_scalar, v)):
                q = quantize_fp8(x, cache.dtype, scalar)
                cache.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
        else:
            self.k.index_copy_(0, slots, k.to(self.k.dtype))
            self.v.index_copy_(0, slots, v.to(self.v.dtype))

    # ------------------------------------------------------------------- read
    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, Hkv, D]`` of the flat slot ids ``slots`` ``[n]``, dequantized to ``dtype``."""
        k, v = _gather_rows(self.k, slots), _gather_rows(self.v, slots)
        ks = self.k_scale.index_select(0, slots) if self.k_scale is not None else None
        vs = self.v_scale.index_select(0, slots) if self.v_scale is not None else None
        return self._dequantize(k, v, ks, vs, dtype)

    def slice(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the consecutive slots ``start .. end - 1``, dequantized to ``dtype``
        (a view, no copy, when the cache is plain and already ``dtype``)."""
        ks = self.k_scale[start:end] if self.k_scale is not None else None
        vs = self.v_scale[start:end] if self.v_scale is not None else None
        return self._dequantize(self.k[start:end], self.v[start:end], ks, vs, dtype)

    def _dequantize(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        ks: Optional[torch.Tensor],
        vs: Optional[torch.Tensor],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scheme = self.scheme
        if scheme == "int8":
            assert ks is not None and vs is not None
            return dequantize_int8(k, ks, dtype), dequantize_int8(v, vs, dtype)
        if scheme == "fp8":
            return dequantize_fp8(k, self.k_scalar, dtype), dequantize_fp8(v, self.v_scalar, dtype)
        return k.to(dtype), v.to(dtype)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer, dequantized (tests and reference checks)."""
        return self.slice(0, int(self.k.shape[0]), dtype)
