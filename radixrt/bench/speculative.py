"""``radixrt bench --speculative``: speculative decoding drafted from the radix
tree, on against off, per workload and batch size, in one process.

    python -m radixrt.bench.speculative                       # 4 workloads x batch 1, 8, 32
    python -m radixrt.bench.speculative --workload code-edit --batches 1 --repeats 3
    python -m radixrt.bench.speculative --json-out r.json --markdown-out r.md

Two engines on the same model and settings, one with ``speculative_algorithm``
(``--algorithm``, default RADIX; ``none`` makes both engines plain, to see the
harness's noise), one without. For every workload, batch size and repeat the
two run the same workload one after the other (the order flips every repeat),
each from an empty cache (``flush_cache``: no draft may come from the other
run's or an earlier repeat's outputs). Workloads (``spec_workloads``):
agent-loop (tool calls echoing the conversation), code-edit (rewrite a
stdlib function with one change), dsl-few-shot (the frontend's 5-shot
``capital_qa`` through ``run_batch``) and no-repetition (open questions).
All greedy, so both engines must produce the same tokens: any difference is
reported as a MISMATCH and the exit status is 1.

Batch size ``b``: at most ``b`` programs in flight (one request each at a
time), ``max(b, 4 * --scale)`` programs in all.

Figures, per workload and batch size:

* ``tok/s`` is **decode** throughput for the token-level workloads: tokens
  after each request's first / the time during which at least one request
  was decoding (the union over requests of first token -> last token, from
  streaming). Single-turn prompts are prefilled before the timed run
  (untimed), so their prefill stays out of that window; agent-loop steps
  prefill their new turns inside it. For dsl-few-shot (answers of 1-3
  tokens) it is end-to-end: output tokens / wall time of ``run_batch``, with
  the shared few-shot preamble cached first.
* ``speedup``: the median over repeats of on / off;
* ``accept``: mean acceptance length, output tokens / verification steps
  (``meta_info.spec_verify_ct``) summed over the speculative runs;
* ``equal``: every output identical to speculation off.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from radixrt.bench.common import ReqResult, engine_stream
from radixrt.bench.driver import drive
from radixrt.bench.peers import parse_config
from radixrt.bench.spec_workloads import TOKEN_WORKLOADS, Sizes, build
from radixrt.bench.workload_base import Gen, Program, Tokens, Workload
from radixrt.help_format import HelpFormatter

WORKLOADS = ("agent-loop", "code-edit", "dsl-few-shot", "no-repetition")
SYSTEMS = ("off", "on")


@dataclass
class Run:
    """One timed run of one workload on one engine."""

    wall_s: float
    window_s: float  # the time the tok/s figure divides by (decode window, or wall for e2e)
    tokens: int  # the tokens that figure counts
    output_tokens: int
    verify_ct: int
    failed: int
    outputs: dict = field(default_factory=dict)  # (program, call) -> output ids or text

    @property
    def tok_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else 0.0


def decode_window(results: list[ReqResult]) -> float:
    """Seconds during which at least one request was between its first and last token."""
    spans = sorted((r.start + r.ttft, r.start + r.latency) for r in results if r.ok and r.ttft is not None)
    total, end = 0.0, -math.inf
    for s, e in spans:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _keyed(programs: list[Program], batch: int, out: dict) -> list[Program]:
    """The programs, at most ``batch`` in flight, each request's result stored under (program, call)."""
    sem = asyncio.Semaphore(batch)

    def wrap(i: int, program: Program) -> Program:
        async def run(gen: Gen) -> None:
            calls = itertools.count()

            async def mine(ids: list[int], sp: dict, stage: int) -> ReqResult:
                key = (i, next(calls))
                out[key] = res = await gen(ids, sp, stage)
                return res

            async with sem:
                await program(mine)

        return run

    return [wrap(i, p) for i, p in enumerate(programs)]


def _flush(engine: Any) -> None:
    engine.wait_idle()
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused: the engine is not idle")


def run_tokens(engine: Any, wl: Workload, batch: int) -> Run:
    """``wl`` from an empty cache; its ``params["warm"]`` prompts prefilled first (untimed)."""
    _flush(engine)
    if wl.params.get("warm"):
        engine.generate(input_ids=wl.params["warm"], sampling_params={"max_new_tokens": 1, "temperature": 0})
    results: dict = {}
    programs = _keyed(wl.programs, batch, results)
    t0 = time.perf_counter()
    asyncio.run(
        drive(Workload(wl.name, wl.shape, programs, wl.num_requests), lambda p: engine_stream(engine, p), math.inf, 0)
    )
    wall = time.perf_counter() - t0
    res = list(results.values())
    return Run(
        wall_s=wall,
        window_s=decode_window(res),
        tokens=sum(max(0, r.output_tokens - 1) for r in res if r.ok),
        output_tokens=sum(r.output_tokens for r in res),
        verify_ct=sum(r.spec_verify_ct for r in res),
        failed=sum(not r.ok for r in res),
        outputs={k: list(r.output_ids) if r.ok else r.error for k, r in sorted(results.items())},
    )


def run_dsl(engine: Any, n: int, batch: int) -> Run:
    """``n`` ``capital_qa`` programs through ``run_batch`` with ``batch`` threads, end to end."""
    from radixrt.bench.example_programs import CAPITAL_QUESTIONS, capital_qa
    from radixrt.frontend.engine_backend import EngineBackend

    backend = EngineBackend(engine)
    _flush(engine)
    capital_qa.run(country="Germany", temperature=0, backend=backend)  # the preamble; its answer is in it
    countries = [c for c, _ in (CAPITAL_QUESTIONS * (1 + n // len(CAPITAL_QUESTIONS)))[:n]]
    t0 = time.perf_counter()
    states = capital_qa.run_batch(
        [{"country": c} for c in countries], temperature=0, backend=backend, num_threads=batch
    )
    wall = time.perf_counter() - t0
    metas = [st.get_meta_info("answer") if st.error() is None else {} for st in states]
    tokens = sum(m.get("completion_tokens", 0) for m in metas)
    return Run(
        wall_s=wall,
        window_s=wall,
        tokens=tokens,
        output_tokens=tokens,
        verify_ct=sum(m.get("spec_verify_ct", 0) or 0 for m in metas),
        failed=sum(st.error() is not None for st in states),
        outputs={(i, 0): st["answer"] if st.error() is None else str(st.error()) for i, st in enumerate(states)},
    )


def make_engines(opts: argparse.Namespace) -> dict[str, Any]:
    """The off and on engines (same settings but speculation), each warmed by one request."""
    from radixrt.engine import Engine

    common: dict[str, Any] = dict(
        max_total_tokens=opts.max_total_tokens,
        max_running_requests=max(64, max(opts.batch_list)),
        log_level=opts.log_level,
    )
    if opts.device:
        common["device"] = opts.device
    common.update(getattr(opts, "engine_kwargs", None) or {})  # callers' extra settings (gpu_check's)
    spec: dict[str, Any] = {}
    if opts.algorithm.lower() != "none":
        spec = dict(
            speculative_algorithm=opts.algorithm,
            speculative_num_draft_tokens=opts.num_draft_tokens,
            speculative_tree_width=getattr(opts, "tree_width", 2),
        )
    engines = {"off": Engine(opts.model, **common)}
    try:
        engines["on"] = Engine(opts.model, **common, **spec)
    except BaseException:
        engines["off"].shutdown()
        raise
    for e in engines.values():
        e.generate(input_ids=[100, 200, 300, 400], sampling_params={"max_new_tokens": 4, "temperature": 0})
    return engines


def program_count(batch: int, scale: float) -> int:
    return max(batch, round(4 * scale))


def _mismatches(name: str, batch: int, ref: dict, got: dict, label: str) -> list[str]:
    bad = []
    for key in sorted(set(ref) | set(got)):
        a, b = ref.get(key), got.get(key)
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a or [], b or [])) if x != y), None)
            bad.append(f"MISMATCH {name} batch {batch} {label} request {key}: first difference at {first}")
    return bad


def bench_case(engines: dict[str, Any], tok: Tokens, name: str, batch: int, opts: argparse.Namespace) -> dict:
    """Both engines on one workload at one batch size, ``opts.repeats`` times; one table row."""
    n = program_count(batch, opts.scale)
    wl = build(name, tok, n, opts.seed, opts.sizes) if name in TOKEN_WORKLOADS else None
    runs: dict[str, list[Run]] = {s: [] for s in SYSTEMS}
    mismatches: list[str] = []
    for rep in range(opts.repeats):
        for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
            engine = engines[system]
            run = run_tokens(engine, wl, batch) if wl is not None else run_dsl(engine, n, batch)
            runs[system].append(run)
            print(
                f"[speculative]   {name} batch {batch} {system}: {run.wall_s:.1f} s, {run.tok_s:.2f} tok/s, "
                f"{run.output_tokens} tokens in {run.verify_ct} verification steps",
                file=sys.stderr,
            )
        ref = runs["off"][0].outputs
        for system in SYSTEMS:
            mismatches += _mismatches(name, batch, ref, runs[system][-1].outputs, f"{system} repeat {rep}")
    for line in mismatches:
        print(line, file=sys.stderr)
    on, off = runs["on"], runs["off"]
    verify = sum(r.verify_ct for r in on)
    return {
        "workload": name,
        "batch": batch,
        "programs": n,
        "requests": len(off[0].outputs),
        "output_tokens": off[0].output_tokens,
        "timing": "decode" if wl is not None else "e2e",
        "off_tok_s": round(statistics.median(r.tok_s for r in off), 2),
        "on_tok_s": round(statistics.median(r.tok_s for r in on), 2),
        "speedup": round(statistics.median(b.tok_s / a.tok_s if a.tok_s else 0.0 for a, b in zip(off, on)), 3),
        "accept_length": round(sum(r.output_tokens for r in on) / verify, 3) if verify else None,
        "verify_ct": verify,
        "off_wall_s": round(statistics.median(r.wall_s for r in off), 3),
        "on_wall_s": round(statistics.median(r.wall_s for r in on), 3),
        "failed": sum(r.failed for r in off + on),
        "equal": not mismatches,
        "mismatches": mismatches[:20],
    }


def run_bench(opts: argparse.Namespace) -> dict[str, Any]:
    """Every workload x batch size of ``opts``; the report (rows, settings, elapsed)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    engines = make_engines(opts)
    try:
        off = engines["off"]
        tok = Tokens(off.tokenizer, off.scheduler.vocab_size)
        rows = []
        for name in opts.workload_list:
            for batch in opts.batch_list:
                rows.append(bench_case(engines, tok, name, batch, opts))
                r = rows[-1]
                print(
                    f"[speculative] {name} batch {batch}: off {r['off_tok_s']} on {r['on_tok_s']} tok/s, "
                    f"speedup {r['speedup']}, accept {r['accept_length']}, equal {r['equal']}",
                    file=sys.stderr,
                )
        model = off.model_path
    finally:
        for e in engines.values():
            e.shutdown()
    import torch

    settings = {k: v for k, v in vars(opts).items() if k not in ("func", "sizes", "engine_kwargs")}
    return {
        "model": model,
        "torch_threads": torch.get_num_threads(),
        "settings": {**settings, "sizes": asdict(opts.sizes)},
        "rows": rows,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


COLUMNS = (
    "workload",
    "batch",
    "requests",
    "output_tokens",
    "timing",
    "off_tok_s",
    "on_tok_s",
    "speedup",
    "accept_length",
    "equal",
)


def render(report: dict[str, Any]) -> str:
    """The Markdown table (the same on stdout and in ``--markdown-out``)."""
    s = report["settings"]
    head = (
        f"speculative decoding ({s['algorithm']}, {s['num_draft_tokens']} draft tokens, "
        f"tree width {s.get('tree_width', 1)}) on vs off, "
        f"{report['model']}, torch threads {report['torch_threads']}, repeats {s['repeats']}, "
        f"{report['elapsed_s']} s"
    )
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in report["rows"]:
        cells = [
            "-" if r.get(c) is None else ("yes" if r[c] is True else "NO" if r[c] is False else str(r[c]))
            for c in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n\n" + "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a local model folder")
    p.add_argument("--workload", action="append", choices=[*WORKLOADS, "all"], help="repeatable (default: all)")
    p.add_argument("--batches", default="1,8,32", help="batch sizes (programs in flight)")
    p.add_argument("--repeats", type=int, default=1, help="runs per engine; medians are reported")
    p.add_argument("--scale", type=float, default=1.0, help="programs per batch size: max(batch, 4 x scale)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algorithm", default="RADIX", help="speculative_algorithm of the 'on' engine (none: off too)")
    p.add_argument("--num-draft-tokens", type=int, default=16, help="speculative_num_draft_tokens")
    p.add_argument("--tree-width", type=int, default=2, help="speculative_tree_width (1: chains)")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool of each engine, in tokens")
    p.add_argument("--device", default=None, help="the engines' device (default: the engine's)")
    p.add_argument(
        "--engine-config",
        type=parse_config,
        dest="engine_kwargs",
        default=None,
        help="more settings of both engines, key=value,... (e.g. quantization=int8,enable_torch_compile=true)",
    )
    for f, default in asdict(Sizes()).items():
        p.add_argument("--" + f.replace("_", "-"), type=int, default=default, help=f"workload size ({default})")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--json-out", default=None, help="write the report as JSON here")
    p.add_argument("--markdown-out", default=None, help="write the table as Markdown here")


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The options of `run_bench` (callers may add ``engine_kwargs``: more settings for both engines)."""
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.speculative",
        description=__doc__.split("\n\n")[0],
    )
    add_args(p)
    opts = p.parse_args(argv)
    names = opts.workload or ["all"]
    opts.workload_list = list(WORKLOADS) if "all" in names else list(dict.fromkeys(names))
    opts.batch_list = [int(b) for b in opts.batches.split(",") if b.strip()]
    opts.sizes = Sizes(**{f: getattr(opts, f) for f in asdict(Sizes())})
    return opts


def main(argv: Optional[list[str]] = None) -> int:
    opts = parse(argv)
    report = run_bench(opts)
    table = render(report)
    print(table)
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if opts.markdown_out:
        with open(opts.markdown_out, "w") as f:
            f.write(table + "\n")
    bad = any(not r["equal"] or r["failed"] for r in report["rows"])
    if bad:
        print("speculative bench: outputs differ from speculation off (or requests failed): see above", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
