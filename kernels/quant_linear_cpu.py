"""Weight-only quantized linear layers on the CPU: the weight layouts and a small C kernel.

`quantize_int8` / `quantize_int4` turn a float weight [N, K] into a
`PackedWeight` (layouts in ``csrc/quant_linear_cpu.c``), `dequantize` gives
back the float weight it stands for, and `NativeQuantLinear.linear` computes
``x @ dequantize(w).T + bias`` for float32 activations ``x``. Below
``DENSE_MIN_ROWS`` rows (decode steps, verification rows) it works as
llama.cpp's CPU kernels do: each activation row is quantized to int8 per run
of 32 (`quantize_activations`: a scale per run, error at most half a step of
that run's largest value / 127) and multiplied by the packed weight in
integers, reading the weight once per call whatever the number of rows; a
decode step is bound by the bytes of weight it reads (figures:
docs/benchmarks.md, "Quantized weights"). In the row layout (AVX2), from
``DENSE_MIN_ROWS`` rows on (a prefill) the arithmetic bounds the time: the
weight is dequantized whole (in C) and torch's float32 matrix product runs on
unquantized activations. The tiled layout (AVX-512 VNNI, `to_tiles`)
multiplies every row count in integers, as fast as that dense product at
prefill sizes, so a token's logits do not depend on how many rows its step
had (a verified draft, a cache hit's shorter prefill, a batch).

Threads: the C kernel splits the weight rows with OpenMP, linked against the
OpenMP runtime torch has already loaded (``libgomp.so.1`` of torch's wheel:
the dynamic loader reuses a loaded library of the same name), so the kernel
and torch's own ops share one pool of ``torch.get_num_threads()`` threads
instead of oversubscribing the cores; calls of fewer than
``PARALLEL_MIN_MACS`` multiply-adds stay on the calling thread.

Build and fallback as ``cpu_decode``: compiled on first use with the system C
compiler (``-O3 -march=native -fopenmp``) into ``$RADIXRT_HOME/kernels/``,
once per source, compiler and CPU, then checked against `quantize_activations`
and `dequantize` on a small case; where that fails `load` logs one warning and
returns None and the caller uses torch's kernels. ``RADIXRT_NATIVE_QLINEAR=0``
turns the kernel off.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .native_build import load_kernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_linear_cpu.c"
COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-std=c11", "-fopenmp"]
LINK_FLAGS = ["-shared", "-fopenmp"]
DISABLE_ENV = "RADIXRT_NATIVE_QLINEAR"
CHUNK = 32  # int4 weights are packed in runs of 32 (16 bytes)
TILE = 16  # weight rows per tile of the "tiles" layout
# multiply-adds of one call (rows x weights) below which it runs on the calling thread only
PARALLEL_MIN_MACS = 1 << 18
# rows from which `linear` dequantizes the whole weight and runs torch's float32 matrix product
DENSE_MIN_ROWS = 256


@dataclass
class PackedWeight:
    """A quantized weight [out_features, in_features] (layouts: ``csrc/quant_linear_cpu.c``).

    ``layout`` "rows" (`quantize_int8` / `quantize_int4` give it):
    ``bits`` 8: ``qweight`` int8 [N, K], ``scales`` float32 [N], ``mins`` None;
    ``bits`` 4: ``qweight`` uint8 [N, K / 2], ``scales`` and ``mins`` float16 [N, K / group]
    (llama.cpp's Q4_1 stores them so: 20 bytes per 32 weights where float32 takes 24).
    ``layout`` "tiles" (`to_tiles`; the kernel's AVX-512 VNNI layout): 16 weight rows per
    tile, N padded to whole tiles; ``qweight`` uint8 [tiles, K / 32, bytes per run],
    ``scales`` (and int4's ``mins``) float32 [tiles, K / group, 16] (int8: [tiles * 16]); int4's
    hold the float16 values widened."""

    bits: int
    group_size: int
    out_features: int
    in_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    layout: str = "rows"

    def nbytes(self) -> int:
        extra = self.mins.numel() * self.mins.element_size() if self.mins is not None else 0
        return (
            self.qweight.numel() * self.qweight.element_size()
            + self.scales.numel() * self.scales.element_size()
            + extra
        )


def quantize_int8(weight: torch.Tensor, row_absmax: Optional[torch.Tensor] = None) -> PackedWeight:
    """Symmetric int8 per output channel: ``w ~ q * scale``, ``q`` in [-127, 127]; the scale from
    ``row_absmax`` where given (a tensor-parallel shard of some input columns: the whole row's largest
    magnitude, so that the shards hold the integers the whole weight would)."""
    w = weight.detach().float()
    scale = ((w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return PackedWeight(8, 0, w.shape[0], w.shape[1], q.contiguous(), scale.contiguous(), None)


def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group: ``(q [N, K] int32 in 0..15, scale [N, K/G], min [N, K/G])``
    with ``w ~ q * scale + min``, scale and min float16 (as stored: the codes are rounded against
    the stored values); a group's minimum and maximum are represented to float16's precision."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size or group_size % CHUNK:
        raise ValueError(
            f"quantization int4: in_features {k} is not a multiple of quantization_group_size {group_size} "
            "(choose a group size dividing every linear layer's input size)"
        )
    g = w.view(n, k // group_size, group_size)
    lo = g.amin(dim=-1).half()
    # the smallest float16 step (2^-24) at least: a constant group's scale must not round to 0
    scale = ((g.amax(dim=-1) - lo.float()) / 15).clamp(min=2.0**-24).half()
    q = torch.round((g - lo.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(n, k), scale.contiguous(), lo.contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int) -> PackedWeight:
    """`int4_codes` packed two per byte in the kernel's layout."""
    q, scale, lo = int4_codes(weight, group_size)
    n, k = q.shape
    runs = q.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    packed = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)
    return PackedWeight(4, group_size, n, k, packed.contiguous(), scale, lo)


def int4_unpack(p: PackedWeight) -> torch.Tensor:
    """The int4 codes [N, K] (int32, 0..15) of a packed int4 weight."""
    p = from_tiles(p)
    n, k = p.out_features, p.in_features
    runs = p.qweight.view(n, k // CHUNK, 1, CHUNK // 2)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(n, k).to(torch.int32)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]) if rows > t.shape[0] else t


def to_tiles(p: PackedWeight) -> PackedWeight:
    """``p`` in the "tiles" layout (exact: the same codes, scales and minimums)."""
    if p.layout == "tiles":
        return p
    n, k = p.out_features, p.in_features
    tiles, runs = -(-n // TILE), k // CHUNK
    rows = tiles * TILE
    if p.bits == 8:
        u = _pad_rows((p.qweight.to(torch.int16) + 128).to(torch.uint8), rows)
        # [t, l, b, s, i] -> [t, b, s, l, i]
        q = u.view(tiles, TILE, runs, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, runs, 512)
        return PackedWeight(8, 0, n, k, q.contiguous(), _pad_rows(p.scales, rows).contiguous(), None, "tiles")
    assert p.mins is not None
    codes = _pad_rows(int4_unpack(p).to(torch.uint8), rows)
    # [t, l, b, j, half, i] -> [t, b, j, l, i, half]: low nibble k = 8j + i, high k = 8j + 4 + i
    c = codes.view(tiles, TILE, runs, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    q = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, runs, 256)
    groups = k // p.group_size

    def tile_groups(v: torch.Tensor) -> torch.Tensor:
        return _pad_rows(v, rows).view(tiles, TILE, groups).transpose(1, 2).contiguous()

    return PackedWeight(
        4, p.group_size, n, k, q.contiguous(), tile_groups(p.scales.float()), tile_groups(p.mins.float()), "tiles"
    )


def from_tiles(p: PackedWeight) -> PackedWeight:
    """``p`` in the "rows" layout (the inverse of `to_tiles`)."""
    if p.layout == "rows":
        return p
    n, k = p.out_features, p.in_features
    tiles, runs = p.qweight.shape[0], k // CHUNK
    if p.bits == 8:
        u = p.qweight.view(tiles, runs, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)[:n]
        return PackedWeight(8, 0, n, k, (u.to(torch.int16) - 128).to(torch.int8), p.scales[:n].clone(), None)
    assert p.mins is not None
    b = p.qweight.view(tiles, runs, 4, TILE, 4)
    c = torch.stack([b & 15, b >> 4], dim=-1)  # [t, b, j, l, i, half]
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE, k)[:n]
    half = codes.view(n, runs, 2, CHUNK // 2)
    packed = (half[:, :, 0] | (half[:, :, 1] << 4)).reshape(n, k // 2)

    def row_groups(v: torch.Tensor) -> torch.Tensor:
        return v.transpose(1, 2).reshape(tiles * TILE, -1)[:n].half().contiguous()

    return PackedWeight(4, p.group_size, n, k, packed.contiguous(), row_groups(p.scales), row_groups(p.mins))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The float32 activations [M, K] the kernel multiplies for ``x``: each run of 32 values
    rounded to a multiple of ``max(|run|) / 127`` (the kernel keeps them as int8 and a scale)."""
    runs = x.float().reshape(x.shape[0], -1, CHUNK)
    d = runs.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return ((runs * inv).round() * d).reshape(x.shape)


def dequantize(p: PackedWeight) -> torch.Tensor:
    """The float32 weight [N, K] a packed weight stands for."""
    p = from_tiles(p)
    if p.bits == 8:
        return p.qweight.float() * p.scales[:, None]
    assert p.mins is not None
    n, k, g = p.out_features, p.in_features, p.group_size
    q = int4_unpack(p).float().view(n, k // g, g)
    return (q * p.scales.float()[..., None] + p.mins.float()[..., None]).view(n, k)


class NativeQuantLinear:
    """The compiled kernel: `linear` computes one quantized linear layer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.radixrt_quant_linear  # ctypes releases the GIL for the call
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int, ptr, ptr, i64, i64, i64]
        self._dequant = lib.radixrt_quant_dequant_f32
        self._dequant.restype = None
        self._dequant.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int, ptr, i64, i64]
        self.tiles = bool(lib.radixrt_quant_tiles())  # built with AVX-512 VNNI: `prepare` tiles weights
        if self.tiles:
            self._tiles_fn = lib.radixrt_quant_linear_tiles
            self._tiles_fn.restype = ctypes.c_int
            self._tiles_fn.argtypes = self._fn.argtypes
            self._tiles_dequant = lib.radixrt_quant_tiles_dequant_f32
            self._tiles_dequant.restype = None
            self._tiles_dequant.argtypes = self._dequant.argtypes

    def prepare(self, w: PackedWeight) -> PackedWeight:
        """``w`` in the layout this build multiplies fastest ("tiles" on AVX-512 VNNI)."""
        return to_tiles(w) if self.tiles else from_tiles(w)

    def linear(
        self,
        x: torch.Tensor,
        w: PackedWeight,
        bias: Optional[torch.Tensor] = None,
        dense_dtype: torch.dtype = torch.float32,
        dense_min_rows: int = DENSE_MIN_ROWS,
    ) -> torch.Tensor:
        """``x`` float32 [M, K] (rows may be strided, elements contiguous) -> float32 [M, N].
        ``dense_dtype``: the dtype of the product from ``dense_min_rows`` rows on in the row layout
        (bfloat16 on a CPU with native bf16 products: about twice float32's speed there); a
        ``dense_min_rows`` above any row count keeps every product in integers (batch-invariant)."""
        m, k = x.shape
        assert k == w.in_features and x.dtype == torch.float32 and x.device.type == "cpu"
        # a prefill in the row layout: compute-bound, where torch's float matrix product is faster; the
        # tiled product is as fast there, and keeps every row count on the same arithmetic
        if m >= dense_min_rows and w.layout == "rows":
            weight = self.dequantize(w)
            if dense_dtype == torch.float32:
                return torch.nn.functional.linear(x, weight, bias)
            b = None if bias is None else bias.to(dense_dtype)
            return torch.nn.functional.linear(x.to(dense_dtype), weight.to(dense_dtype), b).float()
        if x.stride(1) != 1:
            x = x.contiguous()
        n = w.out_features
        out = x.new_empty((m, n))
        if w.layout == "tiles" and not self.tiles:
            w = from_tiles(w)
        fn = self._tiles_fn if w.layout == "tiles" else self._fn
        code = fn(
            x.data_ptr(),
            x.stride(0),
            m,
            k,
            w.qweight.data_ptr(),
            w.scales.data_ptr(),
            None if w.mins is None else w.mins.data_ptr(),
            w.group_size,
            w.bits,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            n,
            PARALLEL_MIN_MACS,
        )
        if code:
            raise RuntimeError("quantized linear kernel: no memory for the quantized activations")
        return out

    def bind(self, w: PackedWeight, bias: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """`linear` of ``w`` (in `prepare`'s layout) and ``bias`` for the integer product's row
        counts, with the weight's arguments converted once: the returned function takes float32
        ``x`` [M, K] with unit column stride and M where the integer product runs (below
        ``DENSE_MIN_ROWS``, or any M where every product is integer; the caller checks;
        a decode step's layer costs a few microseconds less per call). It holds ``w`` and
        ``bias``, whose storage must not be replaced while it is used."""
        assert w.layout == ("tiles" if self.tiles else "rows") and (bias is None or bias.dtype == torch.float32)
        fn = self._tiles_fn if w.layout == "tiles" else self._fn
        n, k = w.out_features, w.in_features
        mins = None if w.mins is None else w.mins.data_ptr()
        weight_args = (w.qweight.data_ptr(), w.scales.data_ptr(), mins, w.group_size, w.bits)
        bias_ptr = None if bias is None else bias.data_ptr()

        def rows_product(x: torch.Tensor) -> torch.Tensor:
            m = x.shape[0]
            out = torch.empty((m, n))
            if fn(x.data_ptr(), x.stride(0), m, k, *weight_args, bias_ptr, out.data_ptr(), n, n, PARALLEL_MIN_MACS):
                raise RuntimeError("quantized linear kernel: no memory for the quantized activations")
            return out

        rows_product.keep_alive = (w, bias)  # type: ignore[attr-defined]
        return rows_product

    def dequantize(self, w: PackedWeight) -> torch.Tensor:
        """The float32 weight [N, K] (as `dequantize`, in C)."""
        if w.layout == "tiles" and not self.tiles:
            w = from_tiles(w)
        out = torch.empty((w.out_features, w.in_features))
        fn = self._tiles_dequant if w.layout == "tiles" else self._dequant
        mins = w.mins.data_ptr() if w.mins is not None else None
        n, k = w.out_features, w.in_features
        fn(w.qweight.data_ptr(), w.scales.data_ptr(), mins, k, w.group_size, w.bits, out.data_ptr(), 0, n)
        return out


def load() -> Optional[NativeQuantLinear]:
    """The kernel for this machine, built on first call; None when it cannot be built or
    is turned off (module docstring). Safe to call from several threads and processes."""
    return load_kernel(
        "quant_linear_cpu",
        SOURCE,
        COMPILE_FLAGS,
        LINK_FLAGS,
        NativeQuantLinear,
        _self_check,
        DISABLE_ENV,
        "quantized layers use torch's kernels",
    )


def _self_check(kernel: NativeQuantLinear) -> None:
    """Both formats, odd row counts and a partial row block, against the dequantized weight
    times the quantized activations."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(30, 64, generator=gen), torch.randn(30, generator=gen)
    x = torch.randn(5, 64, generator=gen)  # a whole block of 4 rows and one more
    for rows in (quantize_int8(weight), quantize_int4(weight, 32)):
        packed = kernel.prepare(rows)
        expected = quantize_activations(x) @ dequantize(rows).T + bias
        if not torch.allclose(kernel.linear(x, packed, bias), expected, atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"self-check of int{packed.bits} against the dequantized weight failed")
        if not torch.allclose(kernel.dequantize(packed), dequantize(rows), atol=1e-6, rtol=1e-6):
            raise RuntimeError(f"self-check of int{packed.bits}'s dequantization failed")
