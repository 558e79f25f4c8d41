"""Pieces the radixrt benchmarks share (``radixrt bench`` and
``python -m radixrt.bench.serving``): one request's measurements, streaming clients for the
HTTP server and for the in-process Engine, Poisson arrivals, latency
percentiles, the batched transformers ``generate`` replay, and the ideal
number of prompt tokens a perfect prefix cache computes.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Sequence

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "river mountain window garden engine market signal rocket violet silver lantern meadow harbor compass"
).split()


@dataclass
class ReqResult:
    """One request as the client saw it (times in seconds)."""

    ok: bool = False
    error: str = ""
    ttft: Optional[float] = None
    itls: list = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    output_ids: list = field(default_factory=list)
    start: float = 0.0  # perf_counter at submission
    spec_verify_ct: int = 0  # speculative verification steps (meta_info; 0 with speculation off)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pct(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1]); NaN for no data."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Start offsets of n arrivals of a Poisson process at ``rate``/s (inf: all at 0)."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if rate != math.inf:
            t += rng.expovariate(rate)
    return out


def latency_stats(results: Iterable[ReqResult]) -> dict[str, float]:
    """TTFT / ITL / end-to-end percentiles in milliseconds over successful requests."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    lats = [r.latency for r in ok]
    ms = 1000.0
    return {
        "mean_ttft_ms": statistics.fmean(ttfts) * ms if ttfts else float("nan"),
        "p50_ttft_ms": pct(ttfts, 0.5) * ms,
        "p90_ttft_ms": pct(ttfts, 0.9) * ms,
        "p99_ttft_ms": pct(ttfts, 0.99) * ms,
        "mean_itl_ms": statistics.fmean(itls) * ms if itls else float("nan"),
        "p50_itl_ms": pct(itls, 0.5) * ms,
        "p90_itl_ms": pct(itls, 0.9) * ms,
        "p99_itl_ms": pct(itls, 0.99) * ms,
        "mean_e2e_ms": statistics.fmean(lats) * ms if lats else float("nan"),
        "p99_e2e_ms": pct(lats, 0.99) * ms,
    }


class _Timer:
    """Turns cumulative streamed outputs into TTFT and per-token ITL."""

    def __init__(self, res: ReqResult) -> None:
        self.res = res
        self.t0 = time.perf_counter()
        res.start = self.t0
        self.last: Optional[float] = None
        self.n_prev = 0

    def tokens(self, n: int) -> None:
        if n <= self.n_prev:
            return
        now = time.perf_counter()
        if self.res.ttft is None:
            self.res.ttft = now - self.t0
        else:  # several tokens in one chunk (jump-forward, batching): spread the gap
            self.res.itls.extend([(now - self.last) / (n - self.n_prev)] * (n - self.n_prev))
        self.last, self.n_prev = now, n

    def finish(self, meta: dict) -> None:
        res = self.res
        res.latency = time.perf_counter() - self.t0
        res.prompt_tokens = meta.get("prompt_tokens", 0)
        res.output_tokens = meta.get("completion_tokens", 0)
        res.cached_tokens = meta.get("cached_tokens", 0)
        res.spec_verify_ct = meta.get("spec_verify_ct", 0) or 0
        res.ok = (meta.get("finish_reason") or {}).get("type") in ("length", "stop")
        if not res.ok:
            res.error = f"finish_reason {meta.get('finish_reason')}"


# ---------------------------------------------------------------------- clients
async def _sse_events(response: Any) -> AsyncIterator[dict]:
    """The parsed ``data: {...}`` events of a streaming HTTP response, up to ``data: [DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return
        yield json.loads(data)


async def native_stream(client: Any, payload: dict) -> ReqResult:
    """POST a streaming SGLang-native ``/generate`` request with an httpx AsyncClient."""
    res = ReqResult()
    timer = _Timer(res)
    meta: dict = {}
    try:
        async with client.stream("POST", "/generate", json={**payload, "stream": True}) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for obj in _sse_events(r):
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                timer.tokens(len(obj["output_ids"]))
                meta = obj["meta_info"]
                res.text = obj["text"]
                res.output_ids = obj["output_ids"]
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(e).__name__}: {e}"
        return res
    timer.finish(meta)
    return res


async def engine_stream(engine: Any, payload: dict) -> ReqResult:
    """The same request on an in-process Engine (``async_generate(stream=True)``)."""
    res = ReqResult()
    timer = _Timer(res)
    meta: dict = {}
    try:
        stream = await engine.async_generate(
            prompt=payload.get("text"),
            input_ids=payload.get("input_ids"),
            sampling_params=payload.get("sampling_params"),
            stream=True,
        )
        async for obj in stream:
            timer.tokens(len(obj["output_ids"]))
            meta = obj["meta_info"]
            res.text = obj["text"]
            res.output_ids = obj["output_ids"]
    except Exception as e:  # noqa: BLE001
        res.error = f"{type(e).__name__}: {e}"
        return res
    timer.finish(meta)
    return res


async def chat_stream(client: Any, model: str, messages: list, max_tokens: int) -> ReqResult:
    """A streaming ``/v1/chat/completions`` request (greedy, ``ignore_eos``)."""
    res = ReqResult()
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    res.start = t0
    last = None
    parts = []
    usage = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for obj in _sse_events(r):
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                for c in obj.get("choices", []):
                    content = c.get("delta", {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itls.append(now - last)
                        last = now
                        parts.append(content)
    except Exception as e:  # noqa: BLE001
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    res.text = "".join(parts)
    if usage:
        res.prompt_tokens = usage["prompt_tokens"]
        res.output_tokens = usage["completion_tokens"]
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    res.ok = usage is not None
    if not res.ok:
        res.error = "no usage chunk"
    return res


async def server_counters(client: Any) -> dict:
    """The radix tree's token counters and prompt tokens computed, from ``/get_server_info``."""
    r = await client.get("/get_server_info")
    r.raise_for_status()
    st = r.json()["internal_states"][0]
    cache = st.get("cache", {})
    return {
        "hit_tokens": cache.get("hit_tokens", 0),
        "queried_tokens": cache.get("queried_tokens", 0),
        "prompt_tokens_computed": st.get("prompt_tokens_computed", 0),
        "retractions": st.get("retractions", 0),
    }


async def server_kv_peak(client: Any, stop: asyncio.Event, every: float = 0.25) -> int:
    """Poll ``/get_server_info`` until ``stop``; the largest KV slot use seen
    (tree + running; the server's own peak counter never resets)."""
    peak = 0
    while True:
        try:
            r = await client.get("/get_server_info")
            kv = r.json()["internal_states"][0]["kv"]
            peak = max(peak, kv["total_slots"] - kv["free_slots"])
        except Exception:  # noqa: BLE001 - a missed sample only lowers the estimate
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
            return peak
        except asyncio.TimeoutError:
            continue


# ---------------------------------------------------------------------- ideal prefix reuse
def ideal_prompt_tokens(requests: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
    """Prompt tokens a prefix cache with unlimited memory computes for these
    ``(input_ids, output_ids)`` requests, taken in submission order: each
    request computes the part of its prompt that no earlier prompt or earlier
    generation covered, and always at least one token (for the logits). An
    output's last token has no KV yet (it was sampled, never fed back)."""
    root: dict = {}
    total = 0
    for prompt, output in requests:
        node, new = root, 0
        for t in prompt:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                new += 1
            node = nxt
        total += max(1, new)
        for t in list(output)[:-1]:
            node = node.setdefault(t, {})
    return total


# ---------------------------------------------------------------------- transformers baseline
class HFGenerate:
    """The plain transformers loop as people run it: ``model.generate`` on
    batches of prompts (left-padded), greedy, forced to the lengths radixrt
    produced. Requests are replayed in waves (a wave's prompts depend on the
    previous wave's answers), each wave in order, ``batch_size`` at a time."""

    def __init__(self, model_path: str, batch_size: int = 8) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.batch_size = batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        cfg = self.model.config
        pad = getattr(cfg, "pad_token_id", None)
        eos = getattr(cfg, "eos_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else (eos[0] if isinstance(eos, list) else (eos or 0))

    def run(self, waves: Sequence[Sequence[tuple[list[int], int]]], progress: Any = None) -> float:
        """``waves``: lists of (input_ids, tokens to generate). Returns wall seconds."""
        torch = self.torch
        t0 = time.perf_counter()
        with torch.inference_mode():
            for wave in waves:
                for i in range(0, len(wave), self.batch_size):
                    chunk = wave[i : i + self.batch_size]
                    width = max(len(ids) for ids, _ in chunk)
                    ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                    mask = torch.zeros((len(chunk), width), dtype=torch.long)
                    for row, (p, _) in enumerate(chunk):
                        ids[row, width - len(p) :] = torch.tensor(p)
                        mask[row, width - len(p) :] = 1
                    k = max(n for _, n in chunk)
                    if k == 0:
                        self.model(input_ids=ids, attention_mask=mask)
                    else:
                        self.model.generate(
                            ids,
                            attention_mask=mask,
                            do_sample=False,
                            max_new_tokens=k,
                            min_new_tokens=k,
                            pad_token_id=self.pad_id,
                        )
                    if progress is not None:
                        progress.update(len(chunk))
        return time.perf_counter() - t0


def report_out(report: dict, text: str, json_path: Optional[str]) -> int:
    """Print a benchmark's rendered ``text`` and write its ``report`` to ``json_path`` (when given); exit status 0."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
