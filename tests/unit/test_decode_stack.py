"""The native decode stack (`radixrt.executor.models.decode_stack`) gives the Python layer stack's
bits, takes exactly the batches it should, and never bypasses what it cannot run (LoRA layers,
quantized KV, per-head q/k norms)."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.executor.model_runner import ModelRunner
from radixrt.kernels import decode_stack_cpu
from radixrt.scheduler.scheduler import Scheduler
from tests.support.scheduling import greedy_together

pytestmark = pytest.mark.skipif(decode_stack_cpu.load() is None, reason="the native decode stack cannot be built here")


def _runner(model: str, **flags) -> ModelRunner:
    return ModelRunner.from_config(EngineConfig(model_path=model, max_total_tokens=1024, **flags))


def _decode_twice(runner: ModelRunner, shapes=((0, 37), (100, 5), (200, 70))) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Requests' prompts (``shapes``: first slot, length), then one decode step of them all
    computed by the native stack and (over the same slots) by the Python stack; and how many
    times the driver ran."""
    rng = random.Random(0)
    seqs = [list(range(s, s + n)) for s, n in shapes]
    for seq in seqs:
        runner.forward([rng.randrange(3, 900) for _ in seq], [seq], [len(seq)])
    nxt = [seq + [seq[-1] + 1] for seq in seqs]
    ids = [rng.randrange(3, 900) for _ in seqs]
    stack = runner.model.decode_stack
    assert stack is not None
    calls = []
    run = stack.kernel.run
    stack.kernel.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]
    try:
        native = runner.forward(ids, nxt, [1] * len(seqs)).clone()
    finally:
        stack.kernel.run = run  # type: ignore[method-assign]
    runner.model.decode_stack = None
    try:
        python = runner.forward(ids, nxt, [1] * len(seqs))
    finally:
        runner.model.decode_stack = stack
    return native, python, len(calls)


@pytest.mark.parametrize(
    "flags", [{}, {"quantization": "int8"}, {"quantization": "int4"}], ids=["float", "int8", "int4"]
)
def test_the_native_stack_gives_the_python_stacks_bits(tiny_llama, flags):
    native, python, calls = _decode_twice(_runner(tiny_llama, **flags))
    assert calls == 1
    assert torch.equal(native, python)


def test_a_decode_batch_of_a_hundred_requests_runs_on_the_stack_where_torch_has_avx2_only(tiny_llama):
    """The stack takes batches up to the linear kernel's rows (128 where torch's CPU kernels
    are AVX2: radixrt/kernels/dense_linear_cpu.py), with the Python stack's bits."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip("the stack's rows follow torch's CPU capability (64 with AVX-512)")
    native, python, calls = _decode_twice(_runner(tiny_llama), [(8 * i, 7) for i in range(100)])
    assert calls == 1
    assert torch.equal(native, python)


def test_batches_it_does_not_take_run_the_python_stack(tiny_llama):
    runner = _runner(tiny_llama)
    stack = runner.model.decode_stack
    assert stack is not None
    calls = []
    run = stack.kernel.run
    stack.kernel.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]
    runner.forward(list(range(3, 43)), [list(range(40))], [40])  # a prefill
    runner.forward(list(range(3, 43)), [list(range(80))], [40])  # an extend of 40 tokens
    runner.forward(list(range(3, 53)), [list(range(200, 210)), list(range(300, 340))], [10, 40])  # two prefills
    assert calls == []
    runner.forward([7], [list(range(81))], [1])  # a decode
    runner.forward([8, 9, 10], [list(range(84))], [3])  # a short extend (a draft's chain): decode rows
    assert calls == [1, 1]


def test_models_and_pools_it_cannot_drive_keep_the_python_stack(make_tiny, tiny_llama):
    assert _runner(make_tiny("qwen3")).model.decode_stack is None  # per-head q/k RMSNorm
    assert _runner(tiny_llama, enable_deterministic_inference=True).model.decode_stack is None
    runner = _runner(tiny_llama, kv_cache_dtype="int8")  # built, but the pool is not float32
    stack = runner.model.decode_stack
    assert stack is not None
    # so decode batches keep the cascade and speculation prices no stack
    assert runner.fast_path_tokens == 0 and runner.backend.native_stack_rows == 0
    runner.forward(list(range(3, 13)), [list(range(10))], [10])
    h = torch.zeros(1, runner.model_config.hidden_size)
    assert stack.run(h, h, h, runner.kv_pool, runner.backend) is None


def test_lora_turns_it_off(tiny_llama, tmp_path):
    from tests.support.lora import make_adapter

    adapter = make_adapter(tiny_llama, tmp_path / "a", rank=4, seed=1)
    sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, lora_paths=[f"a={adapter}"]))
    try:
        assert sched.runner.model.decode_stack is None
    finally:
        sched.close()


def test_engine_greedy_tokens_same_with_and_without_it(tiny_llama, monkeypatch):
    def greedy() -> list[list[int]]:
        sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=2048, quantization="int4"))
        try:
            prompts = [[(13 * i + j) % 500 + 3 for j in range(4 + 11 * i)] for i in range(5)]
            tokens = greedy_together(sched, prompts, 20)
            assert (sched.runner.model.decode_stack is None) == (decode_stack_cpu.DISABLE_ENV in used)
            return tokens
        finally:
            sched.close()

    used: set[str] = set()
    with_stack = greedy()
    monkeypatch.setenv(decode_stack_cpu.DISABLE_ENV, "0")
    used.add(decode_stack_cpu.DISABLE_ENV)
    assert greedy() == with_stack
    assert all(len(t) == 20 for t in with_stack)


def test_speculation_prices_leaving_the_stack(tiny_llama):
    """The speculative cost model is fitted to the Python layers' steps and knows what the stack
    saves: a step of fewer than its rows counts as a fast-path step, drafts or not."""
    from radixrt.executor.models.decode_stack import MAX_ROWS

    sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=2048, speculative_algorithm="RADIX"))
    try:
        spec = sched.speculator
        assert spec is not None and spec.fast_path_tokens == MAX_ROWS and spec.cost.leave_fast >= 0.0  # timed: noisy
        assert spec.replays_graph([1] * (MAX_ROWS - 1)) and spec.replays_graph([9] * 4)
        assert not spec.replays_graph([1] * MAX_ROWS) and not spec.replays_graph([9] * (MAX_ROWS // 9 + 1))
    finally:
        sched.close()


def test_a_shared_prefix_is_read_once_by_the_stack_not_a_cascade(tiny_llama):
    """Decode rows sharing a 48-token prefix: the stack runs them (no cascade plan), with the rows
    marked as sharing it, and gives the Python stack's cascade answer (to float rounding)."""
    runner = _runner(tiny_llama)
    prefix = list(range(48))
    seqs = [prefix + list(range(100 + 10 * i, 105 + 10 * i)) for i in range(4)]
    runner.forward(list(range(3, 51)), [prefix], [48])
    for seq in seqs:
        runner.forward(list(range(60, 65)), [seq], [5])
    nxt = [seq + [seq[-1] + 1] for seq in seqs]
    native = runner.forward([7, 8, 9, 10], nxt, [1, 1, 1, 1]).clone()
    plan = runner.backend.native_decode_plan()
    assert plan is not None and plan.shared is not None and plan.shared.tolist() == [0, 48, 48, 48]
    runner.disable_decode_stack()
    python = runner.forward([7, 8, 9, 10], nxt, [1, 1, 1, 1])
    assert runner.backend._cascade is not None  # the Python stack's plan: a cascade
    torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)


def test_drafts_over_a_shared_prefix_stay_on_the_stack(tiny_llama):
    """Draft chains and a draft tree of four requests sharing a 48-token prefix (a batch of agents
    being verified): the stack runs them, each request's first row marked as sharing the prefix
    with the request before, and gives the Python stack's answer (to float rounding)."""
    runner = _runner(tiny_llama)
    prefix = list(range(48))
    q_lens = [3, 1, 4, 2]
    tree = [None, None, [-1, 0, 0, 1], None]
    seqs = [prefix + list(range(100 + 20 * i, 105 + 20 * i + q)) for i, q in enumerate(q_lens)]
    runner.forward(list(range(3, 51)), [prefix], [48])
    for seq, q in zip(seqs, q_lens):
        runner.forward(list(range(60, 65)), [seq[: len(seq) - q]], [5])
    ids = list(range(7, 7 + sum(q_lens)))
    native = runner.forward(ids, seqs, q_lens, tree).clone()
    plan = runner.backend.native_decode_plan()
    assert plan is not None and plan.shared is not None
    firsts = [sum(q_lens[:i]) for i in range(1, len(q_lens))]
    assert [plan.shared.tolist()[i] for i in firsts] == [48, 48, 48]
    runner.disable_decode_stack()
    python = runner.forward(ids, seqs, q_lens, tree)
    torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
