"""FlashInfer backend: paged-layout metadata on CPU, the backend's logic through a
CPU emulation of the two wrappers, and (CUDA only) the real kernels against the
torch reference."""

from __future__ import annotations

import random
import subprocess
import sys
import zlib

import pytest
import torch

from radixrt.kernels import AttentionMetadata, LayerKVCache
from radixrt.kernels.flashinfer_backend import FlashInferBackend, PagedKVLayout, paged_kv_metadata
from radixrt.kernels.torch_ref import TorchReferenceBackend
from tests.support import fake_flashinfer

HEAD_DIM = 16


def _pages_to_slots(pages: list[int], n: int, ps: int) -> list[int]:
    return [pages[i // ps] * ps + i % ps for i in range(n)]


def _alloc(kv_lens: list[int], ps: int, rng: random.Random, shared_prefix: int = 0) -> list[list[int]]:
    """Whole pages from a shuffled free list; the first ``shared_prefix`` tokens
    (a multiple of ps) sit on the same pages for every request, as radix-cached
    prefixes do."""
    assert shared_prefix % ps == 0
    num_pages = sum(-(-n // ps) for n in kv_lens) + 4
    free = list(range(num_pages))
    rng.shuffle(free)
    shared, free = free[: shared_prefix // ps], free[shared_prefix // ps :]
    out = []
    for n in kv_lens:
        need = -(-n // ps) - len(shared)
        mine, free = free[:need], free[need:]
        out.append(_pages_to_slots(shared + mine, n, ps))
    return out


# ---------------------------------------------------------------- metadata (pure)
def test_paged_metadata_page_size_1_is_the_slot_list():
    seq = [[7, 3, 9], [4], [0, 1, 2, 5, 6]]
    meta = AttentionMetadata.build(seq, [1, 1, 2], page_size=1)
    layout = paged_kv_metadata(meta, validate=True)
    assert isinstance(layout, PagedKVLayout)
    indptr, indices, last = layout
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == [0, 3, 4, 9]
    assert indices.tolist() == [7, 3, 9, 4, 0, 1, 2, 5, 6]
    assert last.tolist() == [1, 1, 1]


def test_paged_metadata_page_size_16_ragged():
    ps = 16
    pages = [[5, 2, 9], [0], [7, 1]]
    lens = [40, 16, 17]  # 2.5 pages, exactly one page, one page + 1 token
    seq = [_pages_to_slots(p, n, ps) for p, n in zip(pages, lens)]
    meta = AttentionMetadata.build(seq, [3, 16, 1], page_size=ps)
    indptr, indices, last = paged_kv_metadata(meta, validate=True)
    assert indptr.tolist() == [0, 3, 4, 6]
    assert indices.tolist() == [5, 2, 9, 0, 7, 1]
    assert last.tolist() == [8, 16, 1]


def test_paged_metadata_shared_pages():
    ps = 16
    prefix = [3, 8]  # 32 cached tokens every request starts with
    seq = [
        _pages_to_slots(prefix + [1], 35, ps),
        _pages_to_slots(prefix + [6, 4], 60, ps),
        _pages_to_slots(prefix, 32, ps),  # exactly the prefix (last page full)
    ]
    meta = AttentionMetadata.build(seq, [3, 28, 1], page_size=ps)
    indptr, indices, last = paged_kv_metadata(meta, validate=True)
    assert indptr.tolist() == [0, 3, 7, 9]
    assert indices.tolist() == [3, 8, 1, 3, 8, 6, 4, 3, 8]
    assert last.tolist() == [3, 12, 16]


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_paged_metadata_random_roundtrip(ps):
    rng = random.Random(ps)
    for _ in range(20):
        b = rng.randint(1, 6)
        kv = [rng.randint(1, 70) for _ in range(b)]
        q = [rng.randint(1, k) for k in kv]
        shared = min(kv) // ps * ps if rng.random() < 0.5 else 0
        seq = _alloc(kv, ps, rng, shared)
        meta = AttentionMetadata.build(seq, q, page_size=ps)
        indptr, indices, last = paged_kv_metadata(meta, validate=True)
        # rebuild every slot list from the page form
        for i, slots in enumerate(seq):
            pages = indices[indptr[i] : indptr[i + 1]].tolist()
            n = (len(pages) - 1) * ps + int(last[i])
            assert _pages_to_slots(pages, n, ps) == slots


def test_paged_metadata_rejects_unaligned_slots():
    meta = AttentionMetadata.build([[16, 17, 3]], [1], page_size=16)  # token 2 is not on page 1
    with pytest.raises(ValueError, match="not page-aligned"):
        paged_kv_metadata(meta, validate=True)


# ----------------------------------------------- backend logic via the CPU emulation
CASES = [
    ("decode", [5, 17, 1, 33, 9], [1, 1, 1, 1, 1], 0),
    ("prefill", [6, 19, 2], [6, 19, 2], 0),
    ("extend", [40, 25, 37], [4, 25, 3], 0),
    ("mixed", [14, 1, 30, 8, 21], [14, 1, 1, 3, 1], 0),
    ("shared-decode", [50, 64, 33], [1, 1, 1], 32),
    ("shared-extend", [50, 64, 40], [5, 30, 8], 32),
]


def _run_case(backend, kv_lens, q_lens, gqa, ps, shared, seed, configure):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    hkv = 2
    hq = hkv * gqa
    seq = _alloc(kv_lens, ps, rng, shared)
    num_slots = (max(max(s) for s in seq) // ps + 2) * ps
    meta = AttentionMetadata.build(seq, q_lens, page_size=ps)
    kc = torch.randn(num_slots, hkv, HEAD_DIM)
    vc = torch.randn(num_slots, hkv, HEAD_DIM)
    t = meta.num_tokens
    qkv = torch.randn(t, hq + 2 * hkv, HEAD_DIM)  # q/k/v as views of a fused projection
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    scale = HEAD_DIM**-0.5
    ref = TorchReferenceBackend()
    ref.plan(meta)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = ref.forward(q, k, v, LayerKVCache(kc_ref, vc_ref), scale)
    if configure:
        backend.configure(hq, hkv, HEAD_DIM, torch.float32)
    backend.plan(meta)
    got = backend.forward(q, k, v, LayerKVCache(kc, vc), scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # same KV writes
    return meta


@pytest.mark.parametrize("configure", [True, False], ids=["configured", "lazy"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("name,kv_lens,q_lens,shared", CASES, ids=[c[0] for c in CASES])
def test_backend_matches_reference_through_emulation(name, kv_lens, q_lens, shared, gqa, ps, configure):
    if shared % ps:
        pytest.skip("shared prefix not page aligned")
    fake_flashinfer.calls.clear()
    backend = FlashInferBackend(
        device="cpu", workspace_bytes=1024, flashinfer_module=fake_flashinfer, validate_paging=True
    )
    seed = zlib.crc32(f"{name}-{gqa}-{ps}-{configure}".encode())
    meta = _run_case(backend, kv_lens, q_lens, gqa, ps, shared, seed, configure)
    plans = [c for c in fake_flashinfer.calls if c[0].endswith(".plan")]
    assert len(plans) == 1
    kind, info = plans[0]
    if meta.is_decode:
        assert kind == "decode.plan" and info["tensor_cores"] == (gqa >= 4)
    else:
        assert kind == "prefill.plan"
    assert info["backend"] == "fa2" and info["ps"] == ps and not info["graph"]


def test_backend_plans_once_per_batch_for_all_layers():
    fake_flashinfer.calls.clear()
    backend = FlashInferBackend(device="cpu", workspace_bytes=1024, flashinfer_module=fake_flashinfer)
    seq = [[0, 1, 2], [3, 4]]
    meta = AttentionMetadata.build(seq, [1, 1])
    kc = torch.randn(8, 1, HEAD_DIM)
    vc = torch.randn(8, 1, HEAD_DIM)
    backend.configure(4, 1, HEAD_DIM, torch.float32)
    backend.plan(meta)
    for _ in range(3):  # three "layers"
        backend.forward(
            torch.randn(2, 4, HEAD_DIM),
            torch.randn(2, 1, HEAD_DIM),
            torch.randn(2, 1, HEAD_DIM),
            LayerKVCache(kc, vc),
            HEAD_DIM**-0.5,
        )
    assert [c[0] for c in fake_flashinfer.calls] == ["decode.plan", "decode.run", "decode.run", "decode.run"]


def test_graph_mode_decode_wrapper_per_batch_size():
    fake_flashinfer.calls.clear()
    ps = 4
    backend = FlashInferBackend(device="cpu", workspace_bytes=1024, flashinfer_module=fake_flashinfer)
    backend.configure(6, 2, HEAD_DIM, torch.float32)
    backend.init_cuda_graph_state(max_bs=8, max_num_pages=32)
    rng = random.Random(0)
    seq = _alloc([9, 3, 14], ps, rng)
    scratch = [31 * ps]  # padding row: one token on a page nobody owns
    padded = seq + [scratch]
    meta = AttentionMetadata.build(padded, [1] * 4, page_size=ps)
    kc = torch.randn(32 * ps, 2, HEAD_DIM)
    vc = torch.randn(32 * ps, 2, HEAD_DIM)
    q, k, v = torch.randn(4, 6, HEAD_DIM), torch.randn(4, 2, HEAD_DIM), torch.randn(4, 2, HEAD_DIM)
    ref = TorchReferenceBackend()
    ref.plan(AttentionMetadata.build(seq, [1] * 3, page_size=ps))
    kc2, vc2 = kc.clone(), vc.clone()
    want = ref.forward(q[:3], k[:3], v[:3], LayerKVCache(kc2, vc2), HEAD_DIM**-0.5)
    backend.plan_cuda_graph(meta, 4)
    got = backend.forward(q, k, v, LayerKVCache(kc, vc), HEAD_DIM**-0.5)
    torch.testing.assert_close(got[:3], want, rtol=1e-4, atol=1e-4)
    w = backend._graph_decode[4]
    assert w.use_cuda_graph and w.plan_count == 1
    backend.plan_cuda_graph(meta, 4)  # replanned in place before the next replay
    assert w.plan_count == 2 and len(backend._graph_decode) == 1
    with pytest.raises(ValueError):
        backend.plan_cuda_graph(meta, 8)  # 4 requests are not a batch of 8


def test_missing_flashinfer_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(ImportError, match=r"radixrt\[cuda\]"):
        FlashInferBackend(device="cpu")


@pytest.mark.slow
def test_cpu_paths_never_import_flashinfer():
    code = (
        "import sys, torch\n"
        "import radixrt, radixrt.kernels, radixrt.executor.model_runner, radixrt.executor.cuda_graph\n"
        "from radixrt.kernels import create_backend\n"
        "create_backend('torch', 'cpu')\n"
        "from radixrt.executor.runtime_choice import resolve_runtime\n"
        "from radixrt.config import EngineConfig\n"
        "from radixrt.executor.runner_settings import RunnerSettings\n"
        "resolve_runtime(RunnerSettings.of(EngineConfig(device='cpu')))\n"
        "resolve_runtime(RunnerSettings.of(EngineConfig(device='cuda')))\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------ real kernels (CUDA)
@pytest.mark.gpu
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("name,kv_lens,q_lens,shared", CASES, ids=[c[0] for c in CASES])
def test_flashinfer_kernels_match_reference_bf16(name, kv_lens, q_lens, shared, gqa, ps):
    if shared % ps:
        pytest.skip("shared prefix not page aligned")
    pytest.importorskip("flashinfer")
    rng = random.Random(zlib.crc32(f"gpu-{name}-{gqa}-{ps}".encode()))
    torch.manual_seed(rng.randrange(1 << 30))
    d, hkv = 64, 2
    hq = hkv * gqa
    seq = _alloc(kv_lens, ps, rng, shared)
    num_slots = (max(max(s) for s in seq) // ps + 2) * ps
    meta = AttentionMetadata.build(seq, q_lens, page_size=ps, device="cuda")
    kc = torch.randn(num_slots, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    t = meta.num_tokens
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = TorchReferenceBackend()
    ref.plan(meta)
    kc2, vc2 = kc.clone(), vc.clone()
    want = ref.forward(q.float(), k.float(), v.float(), LayerKVCache(kc2.float(), vc2.float()), d**-0.5)
    backend = FlashInferBackend(device="cuda")
    backend.configure(hq, hkv, d, torch.bfloat16)
    backend.plan(meta)
    got = backend.forward(q, k, v, LayerKVCache(kc, vc), d**-0.5).float()
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, f"relative error {rel:.2e}"
