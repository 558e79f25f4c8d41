"""The step loop's cost through ``POST /generate``: ms per decode step by batch size.

    python -m radixrt.bench.step_time      # all three paths (scheduler, Engine, HTTP), in one run

The same workload and method as `radixrt.bench.engine_step` (``B`` greedy
requests with the same prompt ids and engine settings; a decode step's cost
is the difference of a call with ``n`` new tokens and one with ``n + steps``,
divided by ``steps``), sent to a real radixrt server on 127.0.0.1 (a
`LocalServer` subprocess, its torch threads as many as the bench's) with
httpx, two ways:

* ``http``: one non-streaming request holding the batch's ``B`` prompts (the
  same call as the ``Engine.generate`` figure's);
* ``http-stream``: the same request with ``"stream": true`` (one SSE event
  per step carrying every prompt's update, each with its ``index``);
* ``http-streams``: ``B`` streaming requests at once, one prompt each, as
  ``B`` chat users would send them: ``B`` connections, ``B`` events per step.

So the figure counts everything between the scheduler and the user: the
tokenizer manager's routing and accumulation, the detokenizer, the JSON and
SSE encoding, the sockets, and the client's parsing, all sharing the
machine's cores with the scheduler (``http-streams`` also counts ``B``
httpx clients' work, which on a small machine is most of it).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.bench.engine_step import WARM_STEPS, engine_kwargs, prompts

MODES = ("http", "http-stream", "http-streams")


@dataclass
class HttpStepTime:
    batch: int
    mode: str  # one of MODES
    ms_per_step: float


def server_flags(kwargs: dict[str, Any]) -> list[str]:
    """`engine_kwargs`' settings as `radixrt serve` flags."""
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


async def _stream(client: Any, ids: Any, sampling: dict) -> list[int]:
    """One streaming request (one prompt, or a batch whose events carry ``index``)
    read to its end; each prompt's completion tokens."""
    done: dict[int, int] = {}
    body = {"input_ids": ids, "sampling_params": sampling, "stream": True}
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                done[event.get("index", 0)] = event["meta_info"]["completion_tokens"]
    return [done.get(i, -1) for i in range(len(done))]


class HttpBench:
    """One server for the workload; `repeat` times one repeat of a batch size in
    each mode (the first call for a batch caches its prompts first)."""

    def __init__(
        self,
        model_path: str,
        batches: list[int],
        steps: int,
        repeats: int,
        device: str = "cpu",
        overlap: Optional[bool] = None,
        prompt_len: int = 32,
        threads: int = 1,
    ) -> None:
        import httpx

        from radixrt.server.local import LocalServer

        self.steps = steps
        self.prompt_len = prompt_len
        flags = server_flags(engine_kwargs(batches, steps, repeats, prompt_len, device, overlap))
        env = {"OMP_NUM_THREADS": str(threads)} if device == "cpu" else {}
        self.server = LocalServer(*flags, model=model_path, env=env)
        self.server.wait_ready()
        limits = httpx.Limits(max_connections=max(batches) + 8, max_keepalive_connections=max(batches) + 8)
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=600, limits=limits)
        self.times: dict[tuple[int, str], list[float]] = {}  # ms per step of each repeat, by (batch, mode)

    async def _plain(self, ids: list[list[int]], sampling: dict) -> list[int]:
        r = await self.client.post("/generate", json={"input_ids": ids, "sampling_params": sampling})
        r.raise_for_status()
        return [o["meta_info"]["completion_tokens"] for o in r.json()]

    async def _batch_stream(self, ids: list[list[int]], sampling: dict) -> list[int]:
        return await _stream(self.client, ids, sampling)

    async def _streams(self, ids: list[list[int]], sampling: dict) -> list[int]:
        counts = await asyncio.gather(*(_stream(self.client, p, sampling) for p in ids))
        return [c[0] for c in counts]

    def _timed(self, mode: str, ids: list[list[int]], new_tokens: int) -> float:
        sampling = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
        call = {"http": self._plain, "http-stream": self._batch_stream, "http-streams": self._streams}[mode]
        start = time.perf_counter()
        counts = self.loop.run_until_complete(call(ids, sampling))
        elapsed = time.perf_counter() - start
        assert counts == [new_tokens] * len(ids), f"every request must decode {new_tokens} tokens: {counts}"
        return elapsed

    def repeat(self, batch: int) -> None:
        """Repeat ``k`` of ``batch`` in each mode: output tokens ``WARM_STEPS + k * steps + 1``
        to ``WARM_STEPS + (k + 1) * steps``, as the scheduler-only repeat ``k``."""
        ids = prompts(batch, self.prompt_len)
        for mode in MODES:
            key = (batch, mode)
            if key not in self.times:
                self._timed(mode, ids, WARM_STEPS)  # caches the prompts, warms the paths
                self.times[key] = []
            before = WARM_STEPS + len(self.times[key]) * self.steps
            short = self._timed(mode, ids, before)
            long = self._timed(mode, ids, before + self.steps)
            self.times[key].append(max(long - short, 0.0) * 1000 / self.steps)

    def rows(self) -> list[HttpStepTime]:
        """The median of each (batch size, mode)'s repeats."""
        return [HttpStepTime(b, mode, statistics.median(ts)) for (b, mode), ts in self.times.items()]

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()
        self.server.cleanup()

    def __enter__(self) -> "HttpBench":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
