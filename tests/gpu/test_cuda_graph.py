"""Decode CUDA graphs: batch-size selection and padding (pure), the static-buffer
plumbing checked on CPU with an eager stand-in for the graph and the CPU
emulation of FlashInfer, the runtime choices a CUDA config resolves to, and
(CUDA only) real capture and replay against eager decoding."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.executor.cuda_graph import (
    DecodeCudaGraphRunner,
    EagerGraph,
    capture_sizes,
    pad_decode_batch,
    padded_batch_size,
)
from radixrt.executor.models import load_model
from radixrt.executor.runner_settings import RunnerSettings
from radixrt.executor.runtime_choice import resolve_runtime
from radixrt.kernels import AttentionMetadata
from radixrt.kernels.flashinfer_backend import FlashInferBackend
from radixrt.kernels.torch_ref import TorchReferenceBackend
from radixrt.memory.kv_pool import KVPool
from tests.support import fake_flashinfer


def test_capture_sizes():
    assert capture_sizes(0) == []
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    big = capture_sizes(160)
    assert big[-4:] == [112, 128, 144, 160] and big == sorted(set(big))
    assert capture_sizes(100)[-1] == 100


def test_padded_batch_size_and_padding():
    sizes = capture_sizes(16)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert padded_batch_size(17, sizes) is None
    ids, slots = pad_decode_batch([5, 6, 7], [[0, 1], [2], [3, 4, 9]], 4, scratch_slot=99)
    assert ids == [5, 6, 7, 0] and slots == [[0, 1], [2], [3, 4, 9], [99]]
    with pytest.raises(ValueError):
        pad_decode_batch([1, 2], [[0], [1]], 1, 99)


def _resolve(**flags):
    """What the runner resolves an ``EngineConfig(**flags)`` to on its device."""
    return resolve_runtime(RunnerSettings.of(EngineConfig(**flags)))


def test_cuda_config_resolves_to_flashinfer_bf16_graphs():
    c = _resolve(device="cuda")
    assert (c.attention_backend, c.dtype, c.cuda_graph) == ("flashinfer", torch.bfloat16, True)
    assert c.cuda_graph_max_bs == 128
    assert _resolve(device="cuda", max_running_requests=48).cuda_graph_max_bs == 48
    assert not _resolve(device="cuda", disable_cuda_graph=True).cuda_graph
    assert not _resolve(device="cuda", attention_backend="torch").cuda_graph
    fp32 = _resolve(device="cuda", dtype="float32")  # FlashInfer takes 16-bit only
    assert (fp32.attention_backend, fp32.cuda_graph) == ("torch", False)
    cpu = _resolve(device="cpu")
    assert (cpu.attention_backend, cpu.dtype, cpu.cuda_graph) == ("torch", torch.float32, False)


def test_sglang_s_cuda_graph_bs_and_padding_flags_choose_what_is_captured():
    """SGLang's --cuda-graph-bs (the sizes captured) and --disable-cuda-graph-padding (another size
    runs eagerly) were argparse errors; SGLang launch scripts pass them."""
    default = _resolve(device="cuda", max_running_requests=48)
    assert default.cuda_graph_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48) and default.cuda_graph_padding
    chosen = _resolve(device="cuda", cuda_graph_bs=[16, 1, 4, 4, 64], max_running_requests=48)
    assert (chosen.cuda_graph_sizes, chosen.cuda_graph_max_bs) == ((1, 4, 16), 16)  # 64: past the cap
    assert not _resolve(device="cuda", disable_cuda_graph_padding=True).cuda_graph_padding
    for bad in ([], [0, 2]):
        with pytest.raises(ValueError, match="cuda_graph_bs must hold batch sizes >= 1"):
            _resolve(device="cuda", cuda_graph_bs=bad)
    with pytest.raises(ValueError, match="device='cuda'"):  # as --cuda-graph-max-bs: graphs are CUDA's
        EngineConfig(cuda_graph_bs=[1, 2])


def _setup(make_tiny, arch, ps, backend_kind, device="cpu", dtype=torch.float32):
    # FlashInfer's kernels need a head dim it supports (the tiny models' default is 16)
    overrides = {"head_dim": 64} if backend_kind == "flashinfer" else {}
    path = make_tiny(arch, tokenizer=False, **overrides)
    model, mc = load_model(path, dtype, device)
    num_pages = 64 // ps + 4
    pool = KVPool(mc.num_layers, num_pages + 1, ps, mc.num_kv_heads, mc.head_dim, dtype, device)  # + scratch
    if backend_kind == "fake":
        backend = FlashInferBackend(device=device, workspace_bytes=1024, flashinfer_module=fake_flashinfer)
    elif backend_kind == "flashinfer":
        backend = FlashInferBackend(device=device)
    else:
        backend = TorchReferenceBackend()
    if hasattr(backend, "configure"):
        backend.configure(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype)
    return model, mc, pool, backend, num_pages


def _eager(model, pool, backend, ids, seq_slots, q_lens, ps, device):
    meta = AttentionMetadata.build(seq_slots, q_lens, ps, device)
    backend.plan(meta)
    return model(torch.tensor(ids, device=device), meta.positions, meta, pool, backend)


def _prefill_some(model, pool, backend, ps, n_req, rng, device):
    """Prefill n_req random prompts into whole pages; return (seq_slots, next ids)."""
    pages = list(range(1, 64 // ps + 4))  # the scratch page (the last one) is never handed out
    rng.shuffle(pages)
    seqs, nxt = [], []
    for _ in range(n_req):
        n = rng.randint(2, 20)
        mine = [pages.pop() for _ in range(-(-(n + 1) // ps))]  # room for the decoded token
        slots = [mine[j // ps] * ps + j % ps for j in range(n + 1)]
        ids = [rng.randrange(100, 1000) for _ in range(n)]
        _eager(model, pool, backend, ids, [slots[:n]], [n], ps, device)
        seqs.append(slots)
        nxt.append(rng.randrange(100, 1000))
    return seqs, nxt


def _snapshot(pool, scratch_page):
    keep = [i for i in range(pool.num_pages) if i != scratch_page]
    return [b[keep].clone() for b in pool.k_buffers + pool.v_buffers]


@pytest.mark.parametrize("backend_kind", ["fake", "torch"])
@pytest.mark.parametrize("arch,ps", [("llama", 1), ("qwen2", 4), ("mistral", 16)])
def test_graph_runner_matches_eager_decode_on_cpu(make_tiny, arch, ps, backend_kind):
    """Replays (eagerly, on CPU) through the static buffers and the padded batch,
    and must give what a plain eager decode step gives, KV writes included."""
    rng = random.Random(f"{arch}-{ps}")
    model, mc, pool, backend, num_pages = _setup(make_tiny, arch, ps, backend_kind)
    runner = DecodeCudaGraphRunner(
        model,
        pool,
        backend,
        max_bs=8,
        scratch_slot=num_pages * ps,
        page_size=ps,
        device="cpu",
        graph_factory=EagerGraph,
    )
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    seqs, nxt = _prefill_some(model, pool, backend, ps, 5, rng, "cpu")
    for n in (1, 3, 5):
        before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
        want = _eager(model, pool, backend, nxt[:n], seqs[:n], [1] * n, ps, "cpu")
        want_kv = _snapshot(pool, num_pages)
        for b, saved in zip(pool.k_buffers + pool.v_buffers, before):
            b.copy_(saved)
        assert runner.can_run([1] * n)
        got = runner.forward(nxt[:n], seqs[:n])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(_snapshot(pool, num_pages), want_kv):
            # padding rows wrote only the scratch page (a batch of 8 may round differently from n)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert runner.replays == 3
    assert not runner.can_run([1] * 9) and not runner.can_run([2, 1])
    exact = DecodeCudaGraphRunner(
        model, pool, backend, 8, num_pages * ps, ps, "cpu", graph_factory=EagerGraph, sizes=[2, 5], pad=False
    )
    exact.capture()
    assert sorted(exact.graphs) == [2, 5]  # --cuda-graph-bs 2 5 --disable-cuda-graph-padding
    assert [n for n in range(1, 9) if exact.can_run([1] * n)] == [2, 5]
    torch.testing.assert_close(
        exact.forward(nxt[:5], seqs[:5]), runner.forward(nxt[:5], seqs[:5]), rtol=1e-5, atol=1e-5
    )
    assert runner.can_run([1, 1], [5, 9])
    assert not runner.can_run([1, 1], [runner.max_kv_pages * ps, 1])  # page-id buffer too small: run eagerly


@pytest.mark.gpu  # FlashInfer kernels, CUDA graphs
@pytest.mark.parametrize("arch,ps", [("llama", 1), ("qwen2", 16)])
def test_cuda_graph_replay_matches_eager_on_gpu(make_tiny, arch, ps):
    pytest.importorskip("flashinfer")
    rng = random.Random(f"gpu-{arch}-{ps}")
    model, mc, pool, backend, num_pages = _setup(make_tiny, arch, ps, "flashinfer", "cuda", torch.bfloat16)
    runner = DecodeCudaGraphRunner(
        model, pool, backend, max_bs=8, scratch_slot=num_pages * ps, page_size=ps, device="cuda"
    )
    runner.capture()
    seqs, nxt = _prefill_some(model, pool, backend, ps, 5, rng, "cuda")
    before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    want = _eager(model, pool, backend, nxt, seqs, [1] * 5, ps, "cuda").float()
    for b, saved in zip(pool.k_buffers + pool.v_buffers, before):
        b.copy_(saved)
    got = runner.forward(nxt, seqs).float()
    assert (got - want).norm() / want.norm() < 1e-2


def _greedy_ids(path: str, prompts: list[list[int]], sp: dict, **kwargs) -> list[list[int]]:
    """Output ids of a fresh engine (built before any emulation is patched in)."""
    import radixrt

    engine = radixrt.Engine(path, **kwargs)
    try:
        return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        engine.shutdown()


def _emulate_graphs(monkeypatch, max_bs: int) -> None:
    """CPU engines built after this capture "CUDA graphs" (eager replays) of decode
    batches up to ``max_bs`` and attend through FlashInfer's CPU emulation."""
    import dataclasses
    import sys

    import radixrt.executor.cuda_graph as cuda_graph_mod
    import radixrt.executor.model_runner as model_runner

    real_resolve = model_runner.resolve_runtime
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(cuda_graph_mod, "_CudaGraph", EagerGraph)
    monkeypatch.setattr(
        model_runner,
        "resolve_runtime",
        lambda c: dataclasses.replace(
            real_resolve(c), attention_backend="flashinfer", cuda_graph=True, cuda_graph_max_bs=max_bs
        ),
    )


def test_model_runner_captures_and_replays_with_emulated_graphs(make_tiny, monkeypatch):
    """The runner's wiring (scratch page, capture at start-up, decode steps routed to
    the graphs) through the Engine on CPU: CUDA graphs replaced by eager replays and
    FlashInfer by its CPU emulation; greedy outputs must equal the torch backend's."""
    import radixrt

    path = make_tiny("llama", head_dim=64)  # a head dim FlashInfer has kernels for
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    kwargs = dict(device="cpu", max_total_tokens=1024, max_running_requests=8)

    want = _greedy_ids(path, prompts, sp, **kwargs)

    _emulate_graphs(monkeypatch, max_bs=8)
    eng = radixrt.Engine(path, **kwargs)
    try:
        runner = eng.scheduler.runner
        assert isinstance(runner.backend, FlashInferBackend)
        assert runner.cuda_graph is not None and runner.cuda_graph.sizes == [1, 2, 4, 8]
        assert runner.kv_pool.num_pages == runner.num_pages + 1  # the scratch page
        got = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=sp)]
        assert runner.cuda_graph.replays >= 5  # every decode step of the batch
    finally:
        eng.shutdown()
    assert got == want


def test_speculation_over_emulated_graphs_prices_leaving_them(make_tiny, monkeypatch):
    """Speculative decoding where decode steps replay graphs (emulated on CPU, as
    above): the cost model times the one-token probes both eagerly and through
    the graphs, the speculator knows which batches replay, and greedy outputs
    equal the engine's without speculation."""
    import radixrt

    path = make_tiny("llama", head_dim=64)
    prompts = [[100 + i, 200, 300, 400, 500, 600, 700] * 4 for i in range(3)]
    sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    kwargs = dict(device="cpu", max_total_tokens=2048, max_running_requests=8)
    want = _greedy_ids(path, prompts, sp, **kwargs)

    _emulate_graphs(monkeypatch, max_bs=8)
    monkeypatch.setenv("RADIXRT_NATIVE_DECODE_STACK", "0")  # the graphs alone are the fast path here
    eng = radixrt.Engine(path, speculative_algorithm="RADIX", **kwargs)
    try:
        spec = eng.scheduler.speculator
        assert spec is not None and spec.graph_max_bs == 8 and spec.cost.leave_fast >= 0.0
        assert spec.replays_graph([1] * 8) and not spec.replays_graph([1] * 9)
        got = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        eng.shutdown()
    assert got == want


def test_unsupported_head_dim_falls_back_to_torch(caplog):
    """A head dim FlashInfer has no kernels for runs the torch backend, with a warning."""
    import logging

    from radixrt.executor.runtime_choice import fit_to_model

    graphs = _resolve(device="cuda")
    assert (graphs.attention_backend, graphs.cuda_graph) == ("flashinfer", True)
    with caplog.at_level(logging.WARNING, logger="radixrt.executor.model_runner"):
        fallback = fit_to_model(graphs, 16)
    assert (fallback.attention_backend, fallback.cuda_graph, fallback.cuda_graph_max_bs) == ("torch", False, 0)
    assert "head_dim 16" in caplog.text
    assert fit_to_model(graphs, 64) is graphs and fit_to_model(graphs, 128) is graphs
