"""Request ids and request limits through the in-process Engine (tiny random
Llama): ``generate(..., rid=)`` labels a request, ``abort_request(rid)``
matches it exactly, a running rid is refused, and the limits on ``n``, top
logprobs and float32-breaking numbers are the server's."""

from __future__ import annotations

import asyncio
import re

import pytest

import radixrt
from radixrt.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    e = radixrt.Engine(tiny_llama, max_total_tokens=8192, max_n=4, max_top_logprobs_num=5)
    yield e
    e.shutdown()


def greedy(tokens: int, **extra) -> dict:
    return {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


async def _last(stream):
    """The last result of a stream."""
    items = [item async for item in stream]
    return items[-1]


def test_sample_ids_never_collide_with_a_running_rid(engine):
    """While B runs as "col2-0", a request "col2" with n=2 (its sample 0 would be "col2-0") is
    refused; B is served as if alone."""
    b_alone = engine.generate("B prompt", greedy(300), rid="col2-0")
    assert b_alone["meta_info"]["id"] == "col2-0"

    async def both():
        b_stream = await engine.async_generate("B prompt", greedy(300), rid="col2-0", stream=True)
        await b_stream.__anext__()  # B runs under rid "col2-0" ...
        with pytest.raises(ValueError, match="'col2-0' is already running"):
            await engine.async_generate("A prompt", greedy(10, n=2), rid="col2")  # ... as A's sample 0 would
        return await _last(b_stream)

    b = asyncio.run(both())
    assert b["output_ids"] == b_alone["output_ids"] and b["meta_info"]["id"] == "col2-0"


@pytest.mark.slow
def test_abort_matches_the_rid_exactly(engine):
    async def run():
        other = await engine.async_generate("other", greedy(1000), rid="job-7", stream=True)
        await other.__anext__()
        job = await engine.async_generate("target", greedy(8000), rid="job", stream=True)
        await job.__anext__()
        engine.abort_request("job")
        return await _last(job), await _last(other)

    job, other = asyncio.run(run())
    assert job["meta_info"]["finish_reason"]["type"] == "abort"
    assert other["meta_info"]["finish_reason"]["type"] == "length" and len(other["output_ids"]) == 1000


def test_running_rids_are_refused_and_automatic_ids_are_random(engine):
    async def run():
        grp = asyncio.ensure_future(engine.async_generate("n2", greedy(8000, n=2), rid="grp"))
        while not engine.scheduler.running:
            await asyncio.sleep(0.01)
        errors = []
        for rid in ("grp", "grp-1"):
            try:
                await engine.async_generate("dup", greedy(2), rid=rid)
            except ValueError as e:
                errors.append(str(e))
        ok = await engine.async_generate("fine", greedy(2), rid="grp-10")
        engine.abort_request("grp")
        return await grp, errors, ok

    grp, errors, ok = asyncio.run(run())
    assert len(errors) == 2 and all("already running" in e for e in errors)
    assert ok["meta_info"]["id"] == "grp-10"
    assert [s["meta_info"]["finish_reason"]["type"] for s in grp] == ["abort", "abort"]
    again = engine.generate("n2", greedy(2, n=2), rid="grp")  # free again once finished
    assert [len(s["output_ids"]) for s in again] == [2, 2]
    auto = engine.generate("hi", greedy(1))["meta_info"]["id"]
    assert re.fullmatch(r"[0-9a-f]{32}", auto)
    with pytest.raises(ValueError, match="rid"):
        engine.generate(["a", "b"], greedy(1), rid=["same", "same"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sampling_params": greedy(1, n=5)}, "'n'"),
        ({"sampling_params": greedy(1), "top_logprobs_num": 6}, "top_logprobs_num"),
        ({"sampling_params": {"max_new_tokens": 1, "logit_bias": {"5": 1e300}}}, "logit_bias"),
        ({"sampling_params": SamplingParams(max_new_tokens=1, logit_bias={"5": float("inf")})}, "logit_bias"),
        ({"sampling_params": SamplingParams(max_new_tokens=1, repetition_penalty=1e-300)}, "repetition_penalty"),
    ],
)
def test_limits(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate("Hi", **kwargs)
    out = engine.generate("Hi", greedy(1, n=4), top_logprobs_num=5)  # at the limits
    assert len(out) == 4 and len(out[0]["meta_info"]["output_top_logprobs"][0]) == 5
