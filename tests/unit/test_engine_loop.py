"""The Engine's private event loop thread, which runs the async core for the
sync API: results, errors, many callers, and closing a stream early."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixrt.loop_thread import LoopThread


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def test_run_returns_results_and_raises_errors(loop_thread):
    async def double(x):
        await asyncio.sleep(0.001)
        return 2 * x, threading.current_thread() is loop_thread.thread

    assert loop_thread.run(double(3)) == (6, True)

    async def fail():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        loop_thread.run(fail())
    with ThreadPoolExecutor(8) as pool:
        assert [r[0] for r in pool.map(lambda i: loop_thread.run(double(i)), range(50))] == [2 * i for i in range(50)]


def test_iterate_closes_the_async_generator_early(loop_thread):
    closed = threading.Event()

    async def numbers():
        try:
            for i in range(100):
                await asyncio.sleep(0)
                yield i
        finally:
            closed.set()

    assert list(loop_thread.iterate(numbers())) == list(range(100))
    assert closed.is_set()
    closed.clear()
    it = loop_thread.iterate(numbers())
    assert [next(it), next(it)] == [0, 1]
    it.close()  # the caller leaves early: the generator's cleanup (an abort in the Engine) runs
    assert closed.is_set()
