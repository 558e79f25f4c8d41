"""Quantized KV cache (kv_cache_dtype int8 / fp8_e4m3 / fp8_e5m2): the quantize and
dequantize steps' error bounds, the pool's layout and sizes, the backends reading a
quantized cache, and the runtime choice. Engine-level checks: tests/e2e/test_kv_cache_dtype.py."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.kernels import AttentionMetadata, LayerKVCache
from radixrt.kernels.kv_cache import (
    INT8_SCALE_DTYPE,
    dequantize_fp8,
    dequantize_int8,
    kv_storage_dtype,
    quantize_fp8,
    quantize_int8,
)
from radixrt.kernels.torch_ref import TorchReferenceBackend
from radixrt.memory.kv_format import KV_CACHE_DTYPES, kv_cache_format, kv_footprint
from radixrt.memory.kv_pool import KVPool
from tests.unit.test_attention_backend import CASES, _alloc_slots, _naive

HEAD_DIM = 16
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (relative error bound for normal values, absolute bound below the smallest normal)
FP8_BOUNDS = {torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17)}


def _values(seed: int, shape=(64, 3, 32)) -> torch.Tensor:
    """Random K/V-like values over many magnitudes, with zero, tiny and outlier heads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1], generator=g) * 2).unsqueeze(-1)
    x[0, 0] = 0.0
    x[1, 0] = 1e-9 * torch.randn(shape[-1], generator=g)
    x[2, 1, 5] = 300.0  # an outlier channel
    return x


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("seed", range(4))
def test_int8_round_trip_error_bound(seed):
    x = _values(seed)
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == INT8_SCALE_DTYPE and s.shape == x.shape[:-1]
    assert int(q.abs().max()) <= 127
    y = dequantize_int8(q, s, torch.float32)
    # |x - q*s| <= s/2: the float16 scale is never rounded down far enough to clip
    bound = s.float().unsqueeze(-1) * 0.5 * (1 + 1e-6) + 1e-12
    assert bool(((x - y).abs() <= bound).all())
    # against the head's own range: within 0.4% (+ float16 rounding of the scale) of max|x|
    amax = x.abs().amax(-1, keepdim=True)
    big = amax.squeeze(-1) > 1e-2
    assert bool(((x - y).abs() <= amax * (0.5 / 127 + 2**-11) + 1e-12)[big].all())
    # scales stay normal float16: tiny heads round to steps of 2**-14, never to a zero scale
    assert bool((s.float() >= torch.finfo(torch.float16).tiny).all())
    assert torch.equal(y[0, 0], torch.zeros(x.shape[-1]))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scalar", [1.0, 0.5, 4.0])
def test_fp8_round_trip_error_bound(name, scalar):
    dt = FP8[name]
    fmax = torch.finfo(dt).max
    x = _values(7)
    q = quantize_fp8(x, dt, scalar)
    assert q.dtype == dt and bool(torch.isfinite(q.float()).all())
    y = dequantize_fp8(q, scalar, torch.float32)
    rel, absolute = FP8_BOUNDS[dt]
    inside = (x / scalar).abs() <= fmax
    err = (x - y).abs()
    assert bool((err <= torch.maximum(rel * x.abs(), torch.full_like(x, absolute * scalar)) * (1 + 1e-6))[inside].all())
    # out of range saturates at the largest finite value instead of becoming inf/NaN
    big = quantize_fp8(torch.tensor([1e9, -1e9]), dt, scalar).float()
    assert big.tolist() == [fmax, -fmax]


def test_layer_cache_validates_scales():
    k = torch.zeros(8, 2, HEAD_DIM, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_scale"):
        LayerKVCache(k, k.clone())
    with pytest.raises(ValueError, match="int8"):
        LayerKVCache(torch.zeros(8, 2, HEAD_DIM), torch.zeros(8, 2, HEAD_DIM), torch.zeros(8, 2), torch.zeros(8, 2))
    with pytest.raises(ValueError, match=r"\[num_slots, Hkv\]"):
        LayerKVCache(k, k.clone(), torch.zeros(8, 3, dtype=INT8_SCALE_DTYPE), torch.zeros(8, 3, dtype=INT8_SCALE_DTYPE))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_storage_dtype("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")


# ------------------------------------------------------------------ the pool
@pytest.mark.parametrize("kv", KV_CACHE_DTYPES)
def test_pool_layout_and_bytes_match_footprint(kv):
    pool = KVPool(
        num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, kv_cache_dtype=kv
    )
    want = {"auto": torch.bfloat16, "int8": torch.int8, **FP8}[kv]
    assert pool.storage_dtype == want and pool.k_buffers[0].dtype == want
    nbytes = sum(t.numel() * t.element_size() for t in pool.k_buffers + pool.v_buffers)
    if kv == "int8":
        assert pool.k_scale_buffers is not None and pool.v_scale_buffers is not None
        assert pool.k_scale_buffers[0].shape == (5, 4, 2)  # [num_pages, page_size, Hkv]: slot ids index both
        nbytes += sum(t.numel() * t.element_size() for t in pool.k_scale_buffers + pool.v_scale_buffers)
    else:
        assert pool.k_scale_buffers is None
    assert nbytes == pool.total_bytes == pool.bytes_per_token * pool.total_slots
    cache = pool.layer_cache(1)
    assert cache.k.data_ptr() == pool.k_buffers[1].data_ptr() and cache.k.shape == (20, 2, 8)
    if kv == "int8":
        assert cache.k_scale is not None and cache.k_scale.data_ptr() == pool.k_scale_buffers[1].data_ptr()
    # a write through the layer cache lands at slot = page * P + offset, data and scales
    x = torch.full((1, 2, 8), 3.0)
    cache.store(torch.tensor([4 * 3 + 2]), x, -x)
    k, v = cache.dequantized(torch.float32)
    assert torch.allclose(k[14], x[0], rtol=2**-4) and torch.allclose(v[14], -x[0], rtol=2**-4)
    assert float(pool.k_buffers[1][3, 2].float().abs().sum()) > 0
    assert float(k.abs().sum()) == pytest.approx(float(k[14].abs().sum()))  # nothing else written


def test_capacity_doubles_against_bf16_and_quadruples_against_fp32():
    """The embedded model's shape (30 layers, 3 KV heads, head_dim 64), read from pools."""

    def tokens_per_gib(kv, dtype):
        return KVPool(30, 1, 1, 3, 64, dtype=dtype, kv_cache_dtype=kv).footprint.tokens_per_gib

    bf16, fp32 = tokens_per_gib("auto", torch.bfloat16), tokens_per_gib("auto", torch.float32)
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        assert tokens_per_gib(kv, torch.bfloat16) == pytest.approx(2 * bf16, abs=1)
        assert tokens_per_gib(kv, torch.float32) == pytest.approx(4 * fp32, abs=2)
    # int8 pays a float16 scale per token and head: 2 bytes per 64 values (3.1%)
    int8 = KVPool(30, 1, 1, 3, 64, dtype=torch.bfloat16, kv_cache_dtype="int8").footprint
    assert int8.bytes_per_token == 2 * 30 * 3 * 64 + 2 * 30 * 3 * 2 == 11_880
    assert int8.scale_overhead == pytest.approx(2 / 64)
    assert int8.tokens_per_gib / bf16 == pytest.approx(2 / (1 + 2 / 64), rel=1e-4)  # 1.94x
    assert int8.tokens_per_gib / fp32 == pytest.approx(4 / (1 + 2 / 64), rel=1e-4)  # 3.88x


def test_footprint_names_and_description():
    assert kv_cache_format("auto", "torch.bfloat16").name == "bfloat16"
    assert kv_cache_format("fp8").name == "fp8_e4m3" and kv_cache_format("float8_e5m2").name == "fp8_e5m2"
    with pytest.raises(ValueError):
        kv_cache_format("int3")
    d = kv_footprint(30, 3, 64, "int8").describe(total_tokens=1000)
    assert d["kv_cache_dtype"] == "int8" and d["bytes_per_token"] == 11_880 and d["scale_bytes_per_token"] == 360
    assert d["total_bytes"] == 11_880_000 and d["tokens_per_gib"] == (1 << 30) // 11_880


# ------------------------------------------------------------------ the torch backend
def _quantized_cache(kv: str, num_slots: int, hkv: int, seed: int) -> LayerKVCache:
    """A cache holding quantized junk, as a pool would after earlier steps."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(num_slots, hkv, HEAD_DIM, generator=g), torch.randn(num_slots, hkv, HEAD_DIM, generator=g)
    if kv == "int8":
        (qk, sk), (qv, sv) = quantize_int8(k), quantize_int8(v)
        return LayerKVCache(qk, qv, sk, sv)
    dt = FP8[kv]
    return LayerKVCache(quantize_fp8(k, dt, 0.5), quantize_fp8(v, dt, 2.0), k_scalar=0.5, v_scalar=2.0)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("name,kv_lens,q_lens", CASES, ids=[c[0] for c in CASES])
def test_torch_backend_reads_what_the_cache_holds(kv, name, kv_lens, q_lens):
    """Attention over a quantized cache equals exact attention over the dequantized cache,
    new tokens included; only the new tokens' slots (data and scales) change."""
    rng = random.Random(zlib.crc32(f"{kv}-{name}".encode()))
    ps, hkv, hq = 4, 2, 6
    num_pages = sum(-(-n // ps) for n in kv_lens) + 3
    seq_slots = _alloc_slots(kv_lens, ps, num_pages, rng)
    meta = AttentionMetadata.build(seq_slots, q_lens, page_size=ps)
    cache = _quantized_cache(kv, num_pages * ps, hkv, rng.randrange(1 << 20))
    before = [t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    t = meta.num_tokens
    q, k, v = torch.randn(t, hq, HEAD_DIM), torch.randn(t, hkv, HEAD_DIM), torch.randn(t, hkv, HEAD_DIM)
    backend = TorchReferenceBackend()
    backend.plan(meta)
    out = backend.forward(q, k, v, cache, HEAD_DIM**-0.5)
    kd, vd = cache.dequantized(torch.float32)
    torch.testing.assert_close(out.double(), _naive(q, kd, vd, seq_slots, q_lens, HEAD_DIM**-0.5), atol=1e-5, rtol=1e-5)
    # the new K/V were written quantized, within the round-trip bounds of k/v
    err = (kd[meta.out_slots] - k).abs()
    if kv == "int8":
        bound = k.abs().amax(-1, keepdim=True) * (0.5 / 127 + 2**-11)
    else:
        rel, absolute = FP8_BOUNDS[FP8[kv]]
        bound = torch.clamp(rel * k.abs(), min=absolute * cache.k_scalar)
    assert bool((err <= bound * (1 + 1e-6)).all())
    untouched = torch.ones(num_pages * ps, dtype=torch.bool)
    untouched[meta.out_slots] = False
    after = [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    for b, a in zip(before, after):
        assert torch.equal(
            a.view(torch.uint8)[untouched] if a.element_size() == 1 else a[untouched],
            b.view(torch.uint8)[untouched] if b.element_size() == 1 else b[untouched],
        )


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_cascade_reads_the_dequantized_cache(kv):
    from radixrt.kernels.cascade import plan_cascade

    prefix = list(range(40))
    seq_slots = [prefix + [50, 51, 52], prefix + [60], prefix + [70, 71]]
    q_lens = [2, 1, 2]
    meta = AttentionMetadata.build(seq_slots, q_lens)
    assert plan_cascade(meta) is not None
    cache = _quantized_cache(kv, 80, 1, 3)
    t = meta.num_tokens
    q, k, v = torch.randn(t, 3, HEAD_DIM), torch.randn(t, 1, HEAD_DIM), torch.randn(t, 1, HEAD_DIM)
    backend = TorchReferenceBackend()
    backend.plan(meta)
    out = backend.forward(q, k, v, cache, 0.25)
    kd, vd = cache.dequantized(torch.float32)
    torch.testing.assert_close(out.double(), _naive(q, kd, vd, seq_slots, q_lens, 0.25), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ FlashInfer (CPU emulation)
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 1, 5]], ids=["decode", "mixed"])
def test_flashinfer_backend_reads_fp8_with_layer_scales(kv, q_lens):
    from radixrt.kernels.flashinfer_backend import FlashInferBackend
    from tests.support import fake_flashinfer

    rng = random.Random(5)
    ps = 4
    kv_lens = [9, 14, 6]
    seq_slots = _alloc_slots(kv_lens, ps, 12, rng)
    meta = AttentionMetadata.build(seq_slots, q_lens, page_size=ps)
    cache = _quantized_cache(kv, 48, 2, 9)
    ref_cache = LayerKVCache(cache.k.clone(), cache.v.clone(), k_scalar=cache.k_scalar, v_scalar=cache.v_scalar)
    t = meta.num_tokens
    q, k, v = torch.randn(t, 6, HEAD_DIM), torch.randn(t, 2, HEAD_DIM), torch.randn(t, 2, HEAD_DIM)
    ref = TorchReferenceBackend()
    ref.plan(meta)
    want = ref.forward(q, k, v, ref_cache, HEAD_DIM**-0.5)
    fake_flashinfer.calls.clear()
    backend = FlashInferBackend(
        device="cpu", workspace_bytes=1024, flashinfer_module=fake_flashinfer, validate_paging=True
    )
    backend.configure(6, 2, HEAD_DIM, torch.float32, kv_dtype=FP8[kv])
    backend.plan(meta)
    got = backend.forward(q, k, v, cache, HEAD_DIM**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(cache.k.view(torch.uint8), ref_cache.k.view(torch.uint8))  # the same quantized writes
    runs = [c for c in fake_flashinfer.calls if c[0].endswith(".run")]
    assert runs and runs[0][1]["k_scale"] == 0.5 and runs[0][1]["v_scale"] == 2.0


def test_flashinfer_backend_refuses_int8():
    from radixrt.kernels.flashinfer_backend import FlashInferBackend
    from tests.support import fake_flashinfer

    backend = FlashInferBackend(device="cpu", workspace_bytes=1024, flashinfer_module=fake_flashinfer)
    backend.plan(AttentionMetadata.build([[0, 1]], [1]))
    cache = _quantized_cache("int8", 4, 1, 0)
    with pytest.raises(ValueError, match="int8"):
        backend.forward(
            torch.randn(1, 2, HEAD_DIM), torch.randn(1, 1, HEAD_DIM), torch.randn(1, 1, HEAD_DIM), cache, 1.0
        )


def _resolve(**flags):
    """What the runner resolves an ``EngineConfig(**flags)`` to on its device."""
    from radixrt.executor.runner_settings import RunnerSettings
    from radixrt.executor.runtime_choice import resolve_runtime

    return resolve_runtime(RunnerSettings.of(EngineConfig(**flags)))


def test_runtime_choice_by_kv_cache_dtype():
    cpu = _resolve(kv_cache_dtype="int8")
    assert cpu.attention_backend == "torch" and cpu.kv_dtype == torch.int8 and cpu.dtype == torch.float32
    fp8 = _resolve(device="cuda", kv_cache_dtype="fp8_e4m3")
    assert fp8.attention_backend == "flashinfer" and fp8.kv_dtype == torch.float8_e4m3fn and fp8.cuda_graph
    int8 = _resolve(device="cuda", kv_cache_dtype="int8")
    assert int8.attention_backend == "torch" and not int8.cuda_graph  # FlashInfer reads no int8 cache
    assert _resolve(device="cuda").kv_dtype == torch.bfloat16  # auto: the model dtype
    with pytest.raises(ValueError, match="int8"):
        _resolve(device="cuda", kv_cache_dtype="int8", attention_backend="flashinfer")
