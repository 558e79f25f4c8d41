"""Beam search: memory and speed of the in-engine search against its alternatives.

    python -m radixrt.bench.beam                      # embedded model, W = 4, L = 128
    python -m radixrt.bench.beam --width 4 --tokens 32 --prompt-tokens 256 --repeats 1
    radixrt bench --beam

One server (``radixrt serve`` on 127.0.0.1) answers everything, so each
figure is what a client sees; each row is the median of ``--repeats`` runs,
the radix cache flushed before each. Every hypothesis runs ``--tokens``
tokens (``ignore_eos``: EOS is a token like any other, on all three sides),
so the three do the same number of decode steps and the two searches are the
same search (their best cumulative logprobs are printed side by side):

1. **beam (engine)**: one ``/generate`` with ``beam_width`` W. Its
   ``meta_info.beam`` gives the peak KV its live beams held (distinct slots),
   set against the issue's bound ``P + 1.5 W L`` and ``W (P + L)``, what the
   beams would hold without sharing.
2. **API loop**: the same search as a client-side loop of one-token requests
   (vLLM's beam search since it left the engine): every step sends each live
   beam's whole sequence with ``max_new_tokens`` 1 and its top 2W logprobs,
   concurrently, and keeps the best W continuations by cumulative logprob.
   The server's prefix cache serves the shared prefixes.
3. **n = W sampling** of the same length: the cost floor a search cannot beat.

Speed is hypothesis tokens per second (``W * L / wall``). With ``--page-size``
above 1, forks copy the partly filled page (``copied_slots``).
``--best-of`` adds the copy-on-write example: ``n`` = 8 samples of a
2,000-token prompt with 16-token pages, the peak KV the server held for it
against 8 copies.

Not a timed benchmark; on the 2-core CPU the default run takes a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import httpx

from radixrt.help_format import HelpFormatter


@dataclass
class BeamRow:
    mode: str
    width: int
    tokens: int
    wall_s: float  # median over the repeats
    tokens_per_s: float
    peak_kv_slots: Optional[int] = None  # distinct KV slots its hypotheses held at most (engine beam)
    bound_slots: Optional[int] = None  # P + 1.5 W L
    unshared_slots: Optional[int] = None  # W (P + L)
    forks: Optional[int] = None
    copied_slots: Optional[int] = None
    best_score: Optional[float] = None  # cumulative logprob / length ** length_penalty of the best hypothesis


def prompt_text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of plain English sentences."""
    words = ("river", "stone", "light", "garden", "music", "winter", "paper", "north", "engine", "quiet")
    return " ".join(rng.choice(words) + ("." if i % 9 == 8 else "") for i in range(int(tokens * 0.8)))


async def _generate(client: httpx.AsyncClient, body: dict) -> Any:
    r = await client.post("/generate", json=body)
    r.raise_for_status()
    return r.json()


async def api_loop(client: httpx.AsyncClient, prompt_ids: list[int], width: int, tokens: int) -> tuple[float, float]:
    """The search as a client-side loop of one-token requests; (wall seconds, best cumulative logprob)."""
    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    start = time.perf_counter()
    for _ in range(tokens):
        bodies = [
            {
                "input_ids": prompt_ids + out,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
                "return_logprob": True,
                "top_logprobs_num": 2 * width,
            }
            for _, out in beams
        ]
        replies = await asyncio.gather(*(_generate(client, b) for b in bodies))
        cands = []
        for (score, out), reply in zip(beams, replies):
            for lp, tok, *_ in reply["meta_info"]["output_top_logprobs"][0]:
                cands.append((score + lp, out + [tok]))
        cands.sort(key=lambda c: -c[0])
        beams = cands[:width]
    return time.perf_counter() - start, beams[0][0]


async def _run(url: str, args: argparse.Namespace) -> list[BeamRow]:
    rng = random.Random(0)
    W, L = args.width, args.tokens
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        text = prompt_text(rng, args.prompt_tokens)
        ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
        P = len(ids)
        fixed = {"max_new_tokens": L, "ignore_eos": True}
        engine_walls, loop_walls, sample_walls = [], [], []
        meta: dict = {}
        loop_best = 0.0
        for _ in range(args.repeats):
            await client.post("/flush_cache")
            t = time.perf_counter()
            out = await _generate(client, {"input_ids": ids, "sampling_params": {**fixed, "beam_width": W}})
            engine_walls.append(time.perf_counter() - t)
            meta = out["meta_info"]["beam"]
            await client.post("/flush_cache")
            wall, loop_best = await api_loop(client, ids, W, L)
            loop_walls.append(wall)
            await client.post("/flush_cache")
            t = time.perf_counter()
            await _generate(client, {"input_ids": ids, "sampling_params": {**fixed, "n": W, "temperature": 1.0}})
            sample_walls.append(time.perf_counter() - t)
    rows = []
    for mode, walls in (("beam (engine)", engine_walls), ("API loop", loop_walls), (f"n={W} sampling", sample_walls)):
        wall = statistics.median(walls)
        rows.append(BeamRow(mode, W, L, wall, W * L / wall))
    rows[0].peak_kv_slots = meta["peak_kv_slots"]
    rows[0].bound_slots = int(P + 1.5 * W * L)
    rows[0].unshared_slots = W * (P + L)
    rows[0].forks, rows[0].copied_slots = meta["forks"], meta["copied_slots"]
    rows[0].best_score = meta["cumulative_logprob"]
    rows[1].best_score = loop_best
    return rows


async def best_of(url: str, prompt_tokens: int, n: int, tokens: int) -> dict:
    """``n`` samples of one long prompt: the most KV the server held while they ran."""
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        text = prompt_text(random.Random(1), 2 * prompt_tokens)
        ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"][:prompt_tokens]
        await client.post("/flush_cache")
        before = (await client.get("/get_server_info")).json()["internal_states"][0]
        sp = {"max_new_tokens": tokens, "ignore_eos": True, "n": n, "temperature": 1.0}
        await _generate(client, {"input_ids": ids, "sampling_params": sp})
        after = (await client.get("/get_server_info")).json()["internal_states"][0]
    return {
        "prompt_tokens": len(ids),
        "samples": n,
        "tokens_each": tokens,
        "peak_kv_used_slots": after["peak_kv_used_slots"],
        "peak_before": before["peak_kv_used_slots"],
        "unshared_slots": n * (len(ids) + tokens),
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.beam",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="default")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128, help="tokens every hypothesis generates (L)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="the server's --dtype (float32: both searches agree)")
    p.add_argument("--quantization", help="the server's --quantization (int8, int4; both searches use it)")
    p.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: the head too")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--best-of", action="store_true", help="also the best-of-8 copy-on-write example")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    from radixrt.server.local import LocalServer

    flags = ["--max-total-tokens", "65536", "--page-size", str(args.page_size), "--dtype", args.dtype]
    if args.quantization:
        flags += ["--quantization", args.quantization] + (["--quantize-lm-head"] if args.quantize_lm_head else [])
    srv = LocalServer(*flags, model=args.model).wait_ready()
    try:
        rows = asyncio.run(_run(srv.url, args))
        extra = None
        if args.best_of:
            srv.stop()
            srv.cleanup()
            flags[flags.index("--page-size") + 1] = "16"
            srv = LocalServer(*flags, model=args.model).wait_ready()
            extra = asyncio.run(best_of(srv.url, 2000, 8, 100))
    finally:
        srv.stop()
        srv.cleanup()
    print(
        f"beam search, W={args.width}, L={args.tokens}, prompt {args.prompt_tokens} tokens, "
        f"page {args.page_size}, {args.dtype}"
        + (f", {args.quantization} weights" if args.quantization else "")
        + (" and head" if args.quantization and args.quantize_lm_head else "")
    )
    print(f"{'mode':<16} {'wall s':>8} {'tok/s':>8} {'peak KV':>8} {'bound':>8} {'unshared':>9} {'best lp':>9}")
    for r in rows:
        cells = [r.peak_kv_slots, r.bound_slots, r.unshared_slots]
        kv = " ".join(f"{c:>8}" if c is not None else f"{'':>8}" for c in cells)
        best = f"{r.best_score:9.3f}" if r.best_score is not None else ""
        print(f"{r.mode:<16} {r.wall_s:8.2f} {r.tokens_per_s:8.1f} {kv} {best}")
    beam, loop, sampling = rows
    print(f"engine beam vs API loop: {beam.tokens_per_s / loop.tokens_per_s:.2f}x the tokens/s")
    print(f"engine beam vs n={args.width} sampling: {beam.wall_s / sampling.wall_s:.2f}x the time")
    if extra:
        print(
            f"best-of-{extra['samples']}, {extra['prompt_tokens']}-token prompt, 16-token pages, "
            f"{extra['tokens_each']} tokens each: peak KV {extra['peak_kv_used_slots']} slots "
            f"(8 unshared copies: {extra['unshared_slots']})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "best_of": extra}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
