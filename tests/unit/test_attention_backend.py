"""The torch reference backend against naive per-request dense attention."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from radixrt.kernels import AttentionMetadata, LayerKVCache
from radixrt.kernels.torch_ref import TorchReferenceBackend

HEAD_DIM = 16


def _alloc_slots(kv_lens: list[int], page_size: int, num_pages: int, rng: random.Random) -> list[list[int]]:
    """Each sequence gets whole pages drawn from a shuffled free list (non-contiguous)."""
    pages = list(range(num_pages))
    rng.shuffle(pages)
    out = []
    for n in kv_lens:
        need = -(-n // page_size)
        mine, pages = pages[:need], pages[need:]
        out.append([mine[i // page_size] * page_size + i % page_size for i in range(n)])
    return out


def _naive(q, k_cache, v_cache, seq_slots, q_lens, scale):
    """Dense float64 attention per request, query i at position kv_len - q_len + i."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    outs = []
    t = 0
    for slots, ql in zip(seq_slots, q_lens):
        kv_len = len(slots)
        idx = torch.tensor(slots)
        k = k_cache[idx].double().repeat_interleave(hq // hkv, dim=1)  # [kv, Hq, D]
        v = v_cache[idx].double().repeat_interleave(hq // hkv, dim=1)
        qi = q[t : t + ql].double()  # [ql, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        qpos = torch.arange(kv_len - ql, kv_len)[:, None]
        kpos = torch.arange(kv_len)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(ql, -1))
        t += ql
    return torch.cat(outs)


CASES = [
    # (name, kv_lens, q_lens)
    ("decode", [5, 17, 1, 33, 9], [1, 1, 1, 1, 1]),
    ("decode-equal-lengths", [12, 12, 12], [1, 1, 1]),
    ("prefill", [6, 19, 2], [6, 19, 2]),
    ("extend", [10, 25, 7], [4, 25, 3]),
    ("mixed", [14, 1, 30, 8, 21], [14, 1, 1, 3, 1]),
]


@pytest.mark.parametrize("native", [True, False], ids=["c-decode", "torch-decode"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("name,kv_lens,q_lens", CASES, ids=[c[0] for c in CASES])
def test_torch_backend_matches_naive(name, kv_lens, q_lens, gqa, page_size, native):
    rng = random.Random(zlib.crc32(f"{name}-{gqa}-{page_size}".encode()))
    torch.manual_seed(rng.randrange(1 << 30))
    hkv = 2
    hq = hkv * gqa
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3
    num_slots = num_pages * page_size
    seq_slots = _alloc_slots(kv_lens, page_size, num_pages, rng)
    meta = AttentionMetadata.build(seq_slots, q_lens, page_size=page_size)

    k_cache = torch.randn(num_slots, hkv, HEAD_DIM)  # prefix K/V already cached, the rest is junk
    v_cache = torch.randn(num_slots, hkv, HEAD_DIM)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    t = meta.num_tokens
    q = torch.randn(t, hq, HEAD_DIM)
    k = torch.randn(t, hkv, HEAD_DIM)
    v = torch.randn(t, hkv, HEAD_DIM)
    scale = HEAD_DIM**-0.5

    backend = TorchReferenceBackend(native_decode=native)
    backend.plan(meta)
    out = backend.forward(q, k, v, LayerKVCache(k_cache, v_cache), scale)

    assert out.shape == (t, hq * HEAD_DIM) and out.dtype == q.dtype
    # new K/V written at out_slots, nothing else touched
    assert torch.equal(k_cache[meta.out_slots], k) and torch.equal(v_cache[meta.out_slots], v)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[meta.out_slots] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])

    ref = _naive(q, k_cache, v_cache, seq_slots, q_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

    # plan once, run many layers: a second layer on other caches gives that layer's answer
    k2, v2 = torch.randn_like(k_cache), torch.randn_like(v_cache)
    out2 = backend.forward(q, k, v, LayerKVCache(k2, v2), scale)
    torch.testing.assert_close(out2.double(), _naive(q, k2, v2, seq_slots, q_lens, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["c-decode", "torch-decode"])
@pytest.mark.parametrize(
    "name,kv_lens,q_lens", [c for c in CASES if c[0] in ("decode", "mixed")], ids=["decode", "mixed"]
)
def test_decode_split_into_groups(name, kv_lens, q_lens, native):
    """A decode batch larger than the gather budget is split into several calls, same answer."""
    rng = random.Random(11)
    seq_slots = _alloc_slots(kv_lens, 1, sum(kv_lens) + 4, rng)
    meta = AttentionMetadata.build(seq_slots, q_lens)
    k_cache = torch.randn(sum(kv_lens) + 4, 1, HEAD_DIM)
    v_cache = torch.randn(sum(kv_lens) + 4, 1, HEAD_DIM)
    t = meta.num_tokens
    q, k, v = torch.randn(t, 3, HEAD_DIM), torch.randn(t, 1, HEAD_DIM), torch.randn(t, 1, HEAD_DIM)
    backend = TorchReferenceBackend(decode_budget=40, native_decode=native)
    backend.plan(meta)
    assert len(backend._decode) > 1
    out = backend.forward(q, k, v, LayerKVCache(k_cache, v_cache), 0.3)
    torch.testing.assert_close(out.double(), _naive(q, k_cache, v_cache, seq_slots, q_lens, 0.3), atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close():
    rng = random.Random(7)
    kv_lens, q_lens = [9, 20, 4], [9, 5, 1]
    seq_slots = _alloc_slots(kv_lens, 4, 16, rng)
    meta = AttentionMetadata.build(seq_slots, q_lens, page_size=4)
    k_cache = torch.randn(64, 2, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.randn(64, 2, HEAD_DIM, dtype=torch.bfloat16)
    t = meta.num_tokens
    q = torch.randn(t, 6, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.randn(t, 2, HEAD_DIM, dtype=torch.bfloat16)
    v = torch.randn(t, 2, HEAD_DIM, dtype=torch.bfloat16)
    backend = TorchReferenceBackend()
    backend.plan(meta)
    out = backend.forward(q, k, v, LayerKVCache(k_cache, v_cache), HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16
    ref = _naive(q, k_cache, v_cache, seq_slots, q_lens, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_forward_before_plan_raises():
    backend = TorchReferenceBackend()
    x = torch.zeros(1, 1, HEAD_DIM)
    with pytest.raises(RuntimeError, match="plan"):
        backend.forward(x, x, x, LayerKVCache(torch.zeros(4, 1, HEAD_DIM), torch.zeros(4, 1, HEAD_DIM)), 1.0)


CASCADE_CASES = [
    # (name, shared prefix length, rest kv lens, q_lens)
    ("decode", 40, [3, 9, 1, 20], [1, 1, 1, 1]),
    ("extend", 64, [8, 30, 5], [8, 12, 5]),
    ("mixed", 33, [1, 17, 6, 2], [1, 17, 3, 1]),
]


def test_cascade_declines_a_prefill_chunk_among_decodes():
    """Padding six one-token decodes to a 98-token chunk's queries would compute more than
    attending each request whole: no cascade. Even decodes over the same prefix take it."""
    from radixrt.kernels.cascade import plan_cascade

    prefix = list(range(1180))
    rest = [list(range(2000 + 500 * i, 2000 + 500 * i + 408)) for i in range(7)]
    seqs = [prefix + r for r in rest]
    assert plan_cascade(AttentionMetadata.build(seqs, [98] + [1] * 6)) is None
    assert plan_cascade(AttentionMetadata.build(seqs, [1] * 7)) is not None
    assert plan_cascade(AttentionMetadata.build(seqs, [4] * 7)) is not None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("name,shared,rest,q_lens", CASCADE_CASES, ids=[c[0] for c in CASCADE_CASES])
def test_shared_prefix_cascade_matches_naive(name, shared, rest, q_lens, gqa, consecutive, fused, monkeypatch):
    """Both ways of computing each part's output and log-sum-exp: the CPU's
    fused flash-attention op, and the matmul sequence used elsewhere."""
    from radixrt.kernels import cascade
    from radixrt.kernels.cascade import plan_cascade

    if fused:
        assert cascade._FUSED_CPU is not None, "this torch has no fused CPU flash-attention op"
    else:
        monkeypatch.setattr(cascade, "_FUSED_CPU", None)
    monkeypatch.setattr(cascade, "MAX_PADDED_WORK", float("inf"))  # the arithmetic, whatever it pads

    rng = random.Random(zlib.crc32(f"cascade-{name}-{gqa}-{consecutive}".encode()))
    torch.manual_seed(rng.randrange(1 << 30))
    hkv, hq = 2, 2 * gqa
    num_slots = shared + sum(rest) + 50
    free = list(range(num_slots))
    if not consecutive:
        rng.shuffle(free)
    prefix, free = free[:shared], free[shared:]
    seq_slots = []
    for n in rest:
        mine, free = free[:n], free[n:]
        seq_slots.append(prefix + mine)
    meta = AttentionMetadata.build(seq_slots, q_lens)
    plan = plan_cascade(meta)
    assert plan is not None and plan.prefix_slots.numel() == shared
    assert (plan.prefix_range is not None) == consecutive

    k_cache, v_cache = torch.randn(num_slots, hkv, HEAD_DIM), torch.randn(num_slots, hkv, HEAD_DIM)
    t = meta.num_tokens
    q, k, v = torch.randn(t, hq, HEAD_DIM), torch.randn(t, hkv, HEAD_DIM), torch.randn(t, hkv, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    backend = TorchReferenceBackend()
    backend.plan(meta)
    out = backend.forward(q, k, v, LayerKVCache(k_cache, v_cache), scale)
    ref = _naive(q, k_cache, v_cache, seq_slots, q_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_fused_cascade_op_is_refused_when_it_disagrees(monkeypatch, caplog):
    """The fused op is private to torch: where it stops matching the unfused
    computation, the check at load time keeps the unfused path."""
    from radixrt.kernels import cascade

    assert cascade._load_fused_cpu() is not None
    monkeypatch.setattr(
        cascade, "_attend_unfused", lambda q, k, v, bias, scale: (q.new_zeros(q.shape), q.new_zeros(q.shape[:-1]))
    )
    with caplog.at_level("WARNING", logger=cascade.__name__):
        assert cascade._load_fused_cpu() is None
    assert "unfused path" in caplog.text


def test_no_cascade_when_prefix_is_short_or_unshared():
    from radixrt.kernels.cascade import plan_cascade

    assert plan_cascade(AttentionMetadata.build([list(range(40)), list(range(100, 140))], [1, 1])) is None
    assert plan_cascade(AttentionMetadata.build([list(range(40))], [1])) is None
    shared = list(range(20))
    assert plan_cascade(AttentionMetadata.build([shared + [50], shared + [60]], [1, 1])) is None
