"""Offline benchmark: radixrt against the transformers `generate` loop and
against itself with the radix cache off, in one process and one run.

    radixrt bench                      # both workloads, default sizes
    radixrt bench --workload shared-prefix --repeats 3

Workloads (token-id prompts from a seeded generator, fixed output lengths):
- shared-prefix: N requests sharing a P-token prefix plus U unique tokens each.
- no-sharing: N unrelated prompts.
Reported: wall time (median over repeats), generated tokens/s, ratios, and
the prompt tokens actually computed against the ideal.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    ideal_prompt_tokens: int


def make_workload(name: str, vocab: int, scale: float = 1.0, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    token = lambda: rng.randrange(100, min(vocab, 40000))
    if name == "shared-prefix":
        n, prefix, unique, out = int(32 * scale), 1024, 32, 32
        shared = [token() for _ in range(prefix)]
        prompts = [shared + [token() for _ in range(unique)] for _ in range(n)]
        return Workload(name, prompts, out, prefix + n * unique)
    if name == "no-sharing":
        n, length, out = int(32 * scale), 256, 64
        prompts = [[token() for _ in range(length)] for _ in range(n)]
        return Workload(name, prompts, out, n * length)
    raise ValueError(f"unknown workload {name!r}")


@dataclass
class RunResult:
    system: str
    seconds: float
    generated_tokens: int
    prompt_tokens_computed: int | None = None

    @property
    def tok_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def run_transformers(model_path: str, wl: Workload, batch_size: int) -> RunResult:
    """The plain transformers loop as users run it: batches of equal-length prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for i in range(0, len(wl.prompts), batch_size):
            chunk = wl.prompts[i:i + batch_size]
            ids = torch.tensor(chunk)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=wl.max_new_tokens, min_new_tokens=wl.max_new_tokens, pad_token_id=0,
            )
            generated += (out.shape[1] - ids.shape[1]) * len(chunk)
    seconds = time.perf_counter() - t0
    computed = sum(len(p) for p in wl.prompts)
    return RunResult(f"transformers generate (batch {batch_size})", seconds, generated, computed)


def run_radixrt(engine: Any, wl: Workload, label: str) -> RunResult:
    engine.flush_cache()
    before = engine.get_stats()["prompt_tokens_computed"]
    sp = {"max_new_tokens": wl.max_new_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    results = engine.generate(input_ids=wl.prompts, sampling_params=sp)
    seconds = time.perf_counter() - t0
    generated = sum(r["meta_info"]["completion_tokens"] for r in results)
    computed = engine.get_stats()["prompt_tokens_computed"] - before
    return RunResult(label, seconds, generated, computed)


def median_run(fn: Callable[[], RunResult], repeats: int) -> RunResult:
    runs = [fn() for _ in range(repeats)]
    mid = statistics.median(r.seconds for r in runs)
    best = min(runs, key=lambda r: abs(r.seconds - mid))
    return dataclasses.replace(best, seconds=mid)


def bench_workload(name: str, args: argparse.Namespace, engines: dict[str, Any], model_path: str, vocab: int) -> dict:
    wl = make_workload(name, vocab, args.scale, args.seed)
    print(f"\n== {name}: {len(wl.prompts)} requests, prompt {len(wl.prompts[0])} tokens, "
          f"{wl.max_new_tokens} output tokens", file=sys.stderr)
    rows = [median_run(lambda e=e, label=label: run_radixrt(e, wl, label), args.repeats)
            for label, e in engines.items()]
    if not args.skip_transformers:
        rows.append(median_run(lambda: run_transformers(model_path, wl, args.hf_batch_size), args.repeats))
    base = {r.system: r for r in rows}
    ours = rows[0]
    table = []
    for r in rows:
        table.append({
            "system": r.system, "seconds": round(r.seconds, 2), "gen_tok_per_s": round(r.tok_per_s, 1),
            "radixrt_speedup": round(r.seconds / ours.seconds, 2),
            "prompt_tokens_computed": r.prompt_tokens_computed,
        })
    print(f"{'system':38s} {'seconds':>8s} {'gen tok/s':>10s} {'radixrt x':>10s} {'prompt tok computed':>20s}")
    for row in table:
        print(f"{row['system']:38s} {row['seconds']:8.2f} {row['gen_tok_per_s']:10.1f} "
              f"{row['radixrt_speedup']:10.2f} {row['prompt_tokens_computed']!s:>20s}")
    print(f"ideal prompt tokens computed: {wl.ideal_prompt_tokens}")
    return {"workload": name, "ideal_prompt_tokens": wl.ideal_prompt_tokens, "rows": table, "systems": list(base)}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--workload", action="append", choices=["shared-prefix", "no-sharing"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the number of requests")
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the tables as JSON here")
    p.add_argument("--log-level", default="warning")


def bench_main(args: argparse.Namespace) -> int:
    from .engine import Engine

    workloads = args.workload or ["shared-prefix", "no-sharing"]
    common = dict(page_size=args.page_size, max_total_tokens=16384, chunked_prefill_size=2048)
    engines = {
        "radixrt": Engine(args.model, **common),
        "radixrt (radix cache off)": Engine(args.model, disable_radix_cache=True, **common),
    }
    first = next(iter(engines.values()))
    model_path, vocab = first.model_path, first.scheduler.vocab_size
    try:
        report = [bench_workload(w, args, engines, model_path, vocab) for w in workloads]
    finally:
        for e in engines.values():
            e.shutdown()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
