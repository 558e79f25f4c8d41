"""``--enable-torch-compile``: the compiled layer stack gives the eager model's answers (float
and quantized weights, one-token and many-token batches), the flags it cannot run with are
refused, and the compiled code is cached on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixrt.config import EngineConfig
from radixrt.engine import Engine
from radixrt.executor.models.compiled import cxx_compiler

pytestmark = pytest.mark.slow  # inductor compiles C++ on first use (tens of seconds, once per machine)
needs_cxx = pytest.mark.skipif(cxx_compiler() is None, reason="inductor needs a C++ compiler")

PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Once upon a time there was a"]


def _greedy(model: str, **flags) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, dtype="float32", **flags)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    one = engine.generate(PROMPTS[0], params)  # a batch of one: the one-token graph
    many = engine.generate(PROMPTS, params)  # decode batches of four: the dynamic graph
    return [one["output_ids"]] + [o["output_ids"] for o in many], engine


@pytest.fixture(scope="module")
def inductor_cache():
    """The cache a user's engines compile into (``$RADIXRT_HOME/inductor``): the first run on a machine
    compiles from nothing (tens of seconds), later runs reuse inductor's compiled graphs as a user's
    restarts do."""
    from radixrt.executor.models.compiled import inductor_cache_dir

    return Path(inductor_cache_dir())


@needs_cxx
@pytest.mark.parametrize(
    "flags",
    [{"speculative_algorithm": "RADIX"}, {"quantization": "int4"}],
    ids=["float-speculative", "int4"],
)
def test_compiled_layers_give_the_eager_answers(tiny_llama, inductor_cache, flags):
    """Greedy tokens equal the eager model's; both graphs were compiled when the engine started
    (before speculation's cost probes timed the forward); with speculation, drafts verify through
    the many-token graph (the repeated prompt drafts from its first answer in the tree) and
    undrafted steps decode through the one-token and dynamic graphs. Float weights run with
    speculation only: its steps take both graphs, so a float run without it adds no path."""
    eager, engine = _greedy(tiny_llama, **flags)
    engine.shutdown()
    compiled, engine = _greedy(tiny_llama, enable_torch_compile=True, **flags)
    try:
        model = engine.scheduler.runner.model
        assert model.compiled_layers is not None
        assert set(model.compiled_layers.compile_s) == {"one token", "many tokens"}
        assert compiled == eager
        if "speculative_algorithm" in flags:
            assert engine.get_stats()["spec_accepted_tokens"] > 0
        assert any(inductor_cache.iterdir()), "inductor keeps its code in the cache dir"
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"device": "cuda"}, "--device cpu"),
        ({"tp_size": 2}, "--tp-size 1"),
        ({"enable_deterministic_inference": True}, "no --enable-deterministic-inference"),
        ({"enable_lora": True}, "no --enable-lora"),
    ],
)
def test_what_compile_cannot_run_with_is_refused(flags, message):
    with pytest.raises(ValueError, match="enable_torch_compile") as err:
        EngineConfig(model_path="x", enable_torch_compile=True, **flags)
    assert message in str(err.value)


def test_a_dead_scheduler_fails_control_calls_instead_of_hanging(tiny_llama, monkeypatch):
    engine = Engine(tiny_llama, dtype="float32")
    try:

        def broken() -> None:
            raise RuntimeError("boom")

        monkeypatch.setattr(engine.scheduler, "step", broken)
        out = engine.generate("hello", {"max_new_tokens": 2})
        assert "boom" in out["meta_info"]["finish_reason"]["message"]
        with pytest.raises(RuntimeError, match="scheduler has stopped"):
            engine.flush_cache()
        with pytest.raises(RuntimeError, match="scheduler has stopped"):
            engine.generate("again", {"max_new_tokens": 2})
    finally:
        engine.shutdown()
