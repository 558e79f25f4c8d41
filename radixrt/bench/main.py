"""``radixrt bench``: radixrt against its baselines on the workloads of the
SGLang paper and the seeds, offline (in-process Engine) and online (HTTP
server, Poisson arrivals), in one process and one run.

    radixrt bench                                    # every workload, offline + online, all baselines
    radixrt bench --workload shared-prefix --repeats 3 --offline-only
    radixrt bench --scale 0.1 --no-online            # a quick look
    radixrt bench --sweep prefix --sweep concurrency --offline-only --workload none
    radixrt bench --json-out r.json --markdown-out r.md --plot-dir docs/img

Workloads: see ``radixrt/bench/workloads.py`` (shared-prefix, few-shot,
multi-turn, agent-fanout, agent-loop (``agent_loop.py``), tree-of-thought,
json-extraction, no-sharing).

Systems, measured in the same run on the same machine:

* offline: radixrt with the lpm policy (the reference row), the fcfs and
  dfs-weight policies, radixrt with the radix cache off, and the plain
  transformers ``generate`` loop (batched, left-padded, replaying radixrt's
  requests wave by wave with the same output lengths);
* online: a radixrt server with the radix cache on and one with it off,
  programs arriving as a Poisson process at ``--request-rate`` (``auto``:
  ``--load`` times the offline radixrt program throughput of that workload).

Per run: wall time and its ratio to radixrt, request and output-token
throughput, TTFT and ITL percentiles (from streaming), cache hit rate in
tokens (cached prompt tokens / prompt tokens, from the responses), prompt
tokens computed against the ideal (a prefix cache with unlimited memory:
``radixrt.bench.common.ideal_prompt_tokens``), peak KV slots in use (tree +
running) and retractions. Figures are ratios from one run; absolute times only mean
something on the machine they were taken on.

Sweeps (offline; radixrt, cache off, transformers): the cost as the shared
prefix grows (``--prefix-lens``; ``--sweep-requests`` requests, each the
prefix + 16 unique tokens -> 8 output tokens) and as concurrency grows
(``--concurrency``: that many requests at once, each a
``--concurrency-prefix``-token shared prefix + 16 unique -> 16 output tokens;
the transformers loop gets the same batch size).

The pieces: this module (the flags and the run), ``driver`` (driving one
workload into one row), ``offline`` (the Engines, the transformers loop, the
sweeps), ``online`` (the two servers), ``report`` (the tables), ``workloads``,
``common`` (clients, counters, the ideal) and ``plots``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

from radixrt.bench.offline import Systems, bench_workload_offline, run_sweep
from radixrt.bench.online import run_online
from radixrt.bench.report import add_ratios, render
from radixrt.bench.workloads import WORKLOADS, make_workload
from radixrt.help_format import HelpFormatter


def add_bench_args(p: argparse.ArgumentParser) -> None:
    _add_workload_args(p)
    _add_run_args(p)
    _add_mode_args(p)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a local model folder")
    p.add_argument(
        "--workload",
        action="append",
        choices=[*WORKLOADS, "all", "none"],
        help="repeatable (default: all; none: only the sweeps)",
    )
    p.add_argument(
        "--prefix-groups",
        type=int,
        default=1,
        help="shared-prefix workload: distinct system prompts (the requests interleave them)",
    )
    p.add_argument("--repeats", type=int, default=1, help="offline runs per system; the median is reported")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the number of requests / programs")
    p.add_argument(
        "--policies",
        default="lpm,fcfs,dfs-weight",
        help="schedule policies to compare offline (lpm is the reference row)",
    )
    p.add_argument("--skip-cache-off", action="store_true", help="no radix-cache-off baseline")
    p.add_argument("--skip-transformers", action="store_true", help="no transformers generate baseline")
    p.add_argument("--hf-batch-size", type=int, default=8, help="batch size of the transformers generate loop")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    online = p.add_mutually_exclusive_group()
    online.add_argument(
        "--offline-only",
        "--no-online",
        dest="online",
        action="store_false",
        default=True,
        help="skip the HTTP server runs (default: run them)",
    )
    p.add_argument(
        "--request-rate",
        default="auto",
        help="online program arrivals per second, or auto (--load x the offline program rate)",
    )
    p.add_argument("--load", type=float, default=0.8, help="for --request-rate auto")
    p.add_argument("--timeout", type=float, default=1800.0, help="online per-request timeout (s)")
    p.add_argument("--page-size", type=int, default=1, help="tokens per KV-cache page")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool size in tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="most prompt tokens computed in one step")
    p.add_argument(
        "--sweep",
        action="append",
        choices=["prefix", "concurrency"],
        default=[],
        help="also measure cost growth with the shared prefix length / with concurrency",
    )
    p.add_argument("--prefix-lens", default="256,512,1024,2048,4096", help="prefix sweep: shared prefix lengths")
    p.add_argument("--sweep-requests", type=int, default=4, help="prefix sweep: requests sharing the prefix")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128", help="concurrency sweep: requests at once")
    p.add_argument("--concurrency-prefix", type=int, default=128, help="concurrency sweep: shared prefix tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads' prompts and arrival times")
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=True,
        help="no progress bars on stderr (default: show them)",
    )
    p.add_argument("--json-out", default=None, help="write every row as JSON here")
    p.add_argument("--markdown-out", default=None, help="write the tables as Markdown here")
    p.add_argument(
        "--plot-dir", default=None, help="write PNG plots here (needs matplotlib: pip install 'radixrt[bench]')"
    )


def _add_mode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="warning", help="log level of the in-process engines (info: per-step lines)")
    p.add_argument(
        "--scale-out",
        action="store_true",
        help="only the data-parallel routing benchmark: a multi-tenant workload on one replica with "
        "2x KV against two replicas behind the router per policy (options: python -m "
        "radixrt.bench.scale_out --help; docs/scale_out.md)",
    )
    p.add_argument(
        "--step-time",
        action="store_true",
        help="only measure the step loop: ms per decode step at batch 1, 64 and 128 on a tiny random "
        "Llama (options: python -m radixrt.bench.step_time --help)",
    )
    p.add_argument(
        "--hicache",
        action="store_true",
        help="only measure the host KV tier (multi-turn agents at 4x the device pool, tier on vs off) "
        "and the kv_cache_dtype sweep at a fixed KV budget (options: python -m "
        "radixrt.bench.hicache --help)",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="only radixrt beside llama.cpp (when llama_cpp is importable and a GGUF of the model is at "
        "hand) and transformers generate: one conversation, 16 unshared requests, 32 sharing a prefix "
        "(--scale multiplies their lengths; options: python -m radixrt.bench.peers --help)",
    )
    p.add_argument(
        "--radixrt-config",
        action="append",
        default=None,
        help="--peers: a radixrt row, EngineConfig fields as key=value,... (e.g. quantization=int8); "
        "repeatable (default: dtype=float32 and dtype=bfloat16)",
    )
    p.add_argument(
        "--beam",
        action="store_true",
        help="only measure beam search: the in-engine search against an API-level loop of one-token "
        "requests and n-way sampling, its peak KV, and the best-of-8 copy-on-write example (options: "
        "python -m radixrt.bench.beam --help)",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="only measure LoRA adapters: decode throughput of 32 requests mixing 0 to 8 adapters against the "
        "base model, and activated LoRA's time to first token on a 2,000-token history (needs peft; options: "
        "python -m radixrt.bench.lora --help)",
    )
    p.add_argument(
        "--storage",
        action="store_true",
        help="only measure the storage tier: time to first token on a 4,000-token prefix cold, warm in "
        "memory and after a restart, an agent workload's hit rate before and after the restart, two "
        "servers sharing a Redis store (options: python -m radixrt.bench.storage --help)",
    )
    p.add_argument(
        "--kv-budget",
        action="store_true",
        help="only measure KV budgets (h2o, infinigen, window) against full KV on long prose and code "
        "contexts: perplexity, greedy agreement, needle retrieval, peak KV and requests at once (options: "
        "python -m radixrt.bench.kv_budget --help)",
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        help="only measure speculative decoding drafted from the radix tree, on vs off: agent-loop, "
        "code-edit, DSL few-shot and no-repetition workloads at batch 1, 8 and 32 (options: python -m "
        "radixrt.bench.speculative --help)",
    )


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "res"} for r in rows]


def _run_mode(args: argparse.Namespace) -> Optional[int]:
    """Run the one benchmark a mode flag asks for (its exit status), or None without one."""
    if args.scale_out:
        from radixrt.bench import scale_out

        return scale_out.main(
            ([] if args.model == "default" else ["--model", args.model])
            + (["--json", args.json_out] if args.json_out else [])
        )
    if args.step_time:
        from radixrt.bench import step_time

        model = [] if args.model == "default" else ["--model", args.model]
        return step_time.main(model + (["--json", args.json_out] if args.json_out else []))
    if args.peers:
        from radixrt.bench import peers

        argv = ["--model", args.model, "--seed", str(args.seed), "--scale", str(args.scale)]
        argv += [x for c in args.radixrt_config or [] for x in ("--radixrt-config", c)]
        argv += ["--no-transformers"] if args.skip_transformers else []
        outs = [("--json", args.json_out), ("--markdown", args.markdown_out)]
        return peers.main(argv + [x for flag, value in outs if value for x in (flag, value)])
    if args.hicache:
        from radixrt.bench import hicache

        return hicache.main(["--model", args.model] + (["--json", args.json_out] if args.json_out else []))
    if args.beam:
        from radixrt.bench import beam

        return beam.main(["--model", args.model, "--best-of"] + (["--json", args.json_out] if args.json_out else []))
    if args.lora:
        from radixrt.bench import lora

        return lora.main(["--model", args.model] + (["--json", args.json_out] if args.json_out else []))
    if args.storage:
        from radixrt.bench import storage

        return storage.main(["--model", args.model] + (["--json", args.json_out] if args.json_out else []))
    if args.kv_budget:
        from radixrt.bench import kv_budget

        argv = ["--model", args.model, "--seed", str(args.seed), "--capacity", "--costs"]
        return kv_budget.main(argv + (["--json", args.json_out] if args.json_out else []))
    if args.speculative:
        from radixrt.bench import speculative

        argv = ["--model", args.model, "--repeats", str(args.repeats), "--scale", str(args.scale)]
        outs = [("--seed", str(args.seed)), ("--json-out", args.json_out), ("--markdown-out", args.markdown_out)]
        return speculative.main(argv + [x for flag, value in outs if value for x in (flag, value)])
    return None


def bench_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    status = _run_mode(args)
    if status is not None:
        return status
    names = args.workload or ["all"]
    if "none" in names:
        names = []
    elif "all" in names:
        names = list(WORKLOADS)
    started = time.perf_counter()
    systems = Systems(args)
    import torch

    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "model": systems.model_path,
        "torch_threads": torch.get_num_threads(),
        "workloads": [],
        "sweeps": [],
    }
    overrides: dict[str, dict[str, Any]] = {"shared-prefix": {"groups": args.prefix_groups}}
    workloads = [make_workload(n, systems.tokens, args.scale, args.seed, **overrides.get(n, {})) for n in names]
    rows_by_wl: dict[str, list[dict]] = {}
    try:
        for wl in workloads:
            print(f"\n== {wl.name}: {wl.shape}", file=sys.stderr)
            rows_by_wl[wl.name], _ = bench_workload_offline(systems, wl, args)
        for kind in args.sweep:
            report["sweeps"].append(run_sweep(kind, systems, args))
    finally:
        systems.shutdown()
    if args.online and workloads:
        run_online(workloads, rows_by_wl, args)
    for wl in workloads:
        rows = rows_by_wl[wl.name]
        add_ratios(rows)
        report["workloads"].append({"name": wl.name, "shape": wl.shape, "params": wl.params, "rows": _strip(rows)})
    report["elapsed_s"] = time.perf_counter() - started

    print(render(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if args.markdown_out:
        with open(args.markdown_out, "w") as f:
            f.write(render(report, markdown=True) + "\n")
    if args.plot_dir:
        from radixrt.bench.plots import plot_report

        for path in plot_report(report, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    failed = sum(r.get("failed", 0) for w in report["workloads"] for r in w["rows"])
    return 1 if failed else 0


def main(argv: Optional[list[str]] = None, prog: str = "python -m radixrt.bench.main") -> int:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog=prog, description=__doc__.split("\n\n")[0])
    add_bench_args(p)
    return bench_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
