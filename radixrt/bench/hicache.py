"""``radixrt bench --hicache``: what the host KV tier and the KV cache dtype buy.

Two measurements, each in one process and one run (ratios, not absolute
times, carry over to other machines):

1. **Host tier on vs off** on a multi-turn agent workload whose working set is
   about ``--working-set`` x the device KV pool: ``--users`` agents share a
   system prompt; each turn every agent sends its whole history (system,
   task, and per earlier turn the model's reply and a tool result) plus a new
   tool result, all agents at once. With the tier off, the other agents'
   turns evict an agent's history from the device before it comes back, so
   it is recomputed; with it on, the history waits in host memory and is
   loaded back. Reported: prompt tokens computed (and their ratio to
   tier-off; the target is at most 0.4), the ideal (a cache with unlimited
   memory), hit rate by tier (device / host), output-token and prompt-token
   throughput, and whether every output equals the tier-off run's (greedy).
2. **kv_cache_dtype sweep** (auto / int8 / fp8_e4m3) at a fixed KV memory
   budget (``--kv-budget-mib``): the pool holds ``budget / bytes_per_token``
   tokens; ``--sweep-requests`` distinct requests arrive at once; reported:
   the pool's tokens, the most requests running at once, and throughput.

    radixrt bench --hicache                          # both, embedded model
    python -m radixrt.bench.hicache --only tier --users 8 --turns 4
    python -m radixrt.bench.hicache --only dtype --kv-budget-mib 64
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.bench.common import ideal_prompt_tokens
from radixrt.help_format import HelpFormatter


@dataclass
class AgentWorkload:
    """Token-level multi-turn agents (token ids drawn at random: no tokenizer needed)."""

    users: int
    turns: int
    system_tokens: int
    task_tokens: int
    tool_tokens: int
    output_tokens: int
    seed: int

    def first_prompts(self, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Each agent's first prompt and, per turn after the first, its new tool result."""
        rng = random.Random(self.seed)
        lo, hi = 100, max(101, vocab - 1)
        system = [rng.randrange(lo, hi) for _ in range(self.system_tokens)]
        firsts = [system + [rng.randrange(lo, hi) for _ in range(self.task_tokens)] for _ in range(self.users)]
        tools = [
            [[rng.randrange(lo, hi) for _ in range(self.tool_tokens)] for _ in range(self.turns - 1)]
            for _ in range(self.users)
        ]
        return firsts, tools

    def final_history_tokens(self) -> int:
        """Tokens of one agent's history at its last turn (the working set is users x this)."""
        return self.system_tokens + self.task_tokens + (self.turns - 1) * (self.output_tokens + self.tool_tokens)


def run_agents(engine: Any, wl: AgentWorkload, vocab: int) -> dict[str, Any]:
    """Drive the workload turn by turn (all agents of a turn at once); returns the
    engine's counters, the requests and outputs, and the wall time."""
    firsts, tools = wl.first_prompts(vocab)
    histories = [list(p) for p in firsts]
    sp = {"max_new_tokens": wl.output_tokens, "temperature": 0, "ignore_eos": True}
    requests: list[tuple[list[int], list[int]]] = []
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, wl.users)) as pool:
        for turn in range(wl.turns):
            if turn:
                for u in range(wl.users):
                    histories[u] = histories[u] + outputs[-wl.users + u] + tools[u][turn - 1]
            prompts = [list(h) for h in histories]
            res = list(pool.map(lambda p: engine.generate(input_ids=p, sampling_params=sp), prompts))
            for p, r in zip(prompts, res):
                requests.append((p, r["output_ids"]))
                outputs.append(r["output_ids"])
    wall = time.perf_counter() - t0
    engine.wait_idle()
    stats = engine.get_stats()
    return {"stats": stats, "requests": requests, "outputs": outputs, "wall_s": wall}


def bench_tier(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import radixrt

    wl = AgentWorkload(
        args.users, args.turns, args.system_tokens, args.task_tokens, args.tool_tokens, args.output_tokens, args.seed
    )
    working_set = wl.users * wl.final_history_tokens()
    # at least two agents' histories fit at once (fewer agents than --working-set would not)
    pool = args.max_total_tokens or max(
        256, int(working_set / args.working_set), 2 * (wl.final_history_tokens() + wl.output_tokens)
    )
    rows = []
    runs: dict[bool, dict[str, Any]] = {}
    for tier in (False, True):
        kw: dict[str, Any] = dict(
            max_total_tokens=pool,
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=max(8, wl.users),
            log_level=args.log_level,
        )
        if tier:
            kw.update(
                enable_hierarchical_cache=True,
                host_kv_size=args.host_kv_size or 4 * working_set,
                hicache_write_policy=args.write_policy,
            )
        engine = radixrt.Engine(model, **kw)
        try:
            vocab = engine.scheduler.vocab_size
            run = run_agents(engine, wl, vocab)
        finally:
            engine.shutdown()
        runs[tier] = run
        st, cache = run["stats"], run["stats"]["cache"]
        prompt = sum(len(p) for p, _ in run["requests"])
        out = sum(len(o) for o in run["outputs"])
        rows.append(
            {
                "host_tier": "on" if tier else "off",
                "device_pool_tokens": pool,
                "working_set_tokens": working_set,
                "prompt_tokens": prompt,
                "prompt_tokens_computed": st["prompt_tokens_computed"],
                "ideal_prompt_tokens": ideal_prompt_tokens(run["requests"]),
                "hit_rate": round(cache["hit_rate"], 4),
                "device_hit_rate": round(cache["device_hit_rate"], 4),
                "host_hit_rate": round(cache["host_hit_rate"], 4),
                "host_loaded_tokens": cache.get("host_loaded_tokens", 0),
                "host_offloaded_tokens": cache.get("host_offloaded_tokens", 0),
                "retractions": st["retractions"],
                "wall_s": round(run["wall_s"], 3),
                "output_tok_s": round(out / run["wall_s"], 2),
                "prompt_tok_s": round(prompt / run["wall_s"], 2),
            }
        )
    off, on = rows
    on["computed_vs_off"] = round(on["prompt_tokens_computed"] / max(1, off["prompt_tokens_computed"]), 4)
    on["speedup_vs_off"] = round(off["wall_s"] / max(on["wall_s"], 1e-9), 3)
    on["outputs_equal_off"] = runs[True]["outputs"] == runs[False]["outputs"]
    return {"workload": {**wl.__dict__, "working_set_over_pool": round(working_set / pool, 2)}, "rows": rows}


def _peak_running(engine: Any, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        out.append(int(engine.get_stats()["running"]))
        stop.wait(0.02)


def bench_dtypes(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import radixrt
    from radixrt.memory.kv_format import kv_footprint

    budget = args.kv_budget_mib * (1 << 20)
    rows = []
    for dtype in args.dtypes.split(","):
        probe = None
        engine = None
        try:
            # the pool's size from the budget, by the same arithmetic the pool uses
            probe = radixrt.Engine(model, max_total_tokens=256, kv_cache_dtype=dtype, log_level=args.log_level)
            mc = probe.scheduler.runner.model_config
            model_dtype = str(probe.scheduler.runner.dtype)
            vocab = probe.scheduler.vocab_size
            probe.shutdown()
            probe = None
            fp = kv_footprint(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, model_dtype)
            tokens = fp.tokens_in(budget)
            engine = radixrt.Engine(
                model,
                max_total_tokens=tokens,
                kv_cache_dtype=dtype,
                max_running_requests=args.sweep_requests,
                chunked_prefill_size=args.chunked_prefill_size,
                log_level=args.log_level,
            )
            rng = random.Random(args.seed)
            prompts = [
                [rng.randrange(100, vocab - 1) for _ in range(args.sweep_prompt_tokens)]
                for _ in range(args.sweep_requests)
            ]
            sp = {"max_new_tokens": args.sweep_output_tokens, "temperature": 0, "ignore_eos": True}
            seen: list[int] = []
            stop = threading.Event()
            poller = threading.Thread(target=_peak_running, args=(engine, stop, seen), daemon=True)
            t0 = time.perf_counter()
            poller.start()
            with ThreadPoolExecutor(len(prompts)) as pool:
                res = list(pool.map(engine.generate, [None] * len(prompts), [sp] * len(prompts), prompts))
            wall = time.perf_counter() - t0
            stop.set()
            poller.join()
            st = engine.get_stats()
            out = sum(len(r["output_ids"]) for r in res)
            rows.append(
                {
                    "kv_cache_dtype": dtype,
                    "bytes_per_token": fp.bytes_per_token,
                    "pool_tokens": tokens,
                    "peak_running": max(seen or [0]),
                    "peak_kv_used_slots": st["peak_kv_used_slots"],
                    "retractions": st["retractions"],
                    "wall_s": round(wall, 3),
                    "output_tok_s": round(out / wall, 2),
                }
            )
        finally:
            for e in (probe, engine):
                if e is not None:
                    e.shutdown()
    return {
        "budget_mib": args.kv_budget_mib,
        "requests": args.sweep_requests,
        "prompt_tokens": args.sweep_prompt_tokens,
        "output_tokens": args.sweep_output_tokens,
        "rows": rows,
    }


def _table(rows: list[dict], cols: list[str]) -> str:
    head = "| " + " | ".join(cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def render(report: dict[str, Any]) -> str:
    parts = []
    if "tier" in report:
        t = report["tier"]
        parts.append(f"host tier on vs off: {t['workload']}")
        parts.append(
            _table(
                t["rows"],
                [
                    "host_tier",
                    "device_pool_tokens",
                    "working_set_tokens",
                    "prompt_tokens",
                    "prompt_tokens_computed",
                    "ideal_prompt_tokens",
                    "computed_vs_off",
                    "hit_rate",
                    "device_hit_rate",
                    "host_hit_rate",
                    "retractions",
                    "wall_s",
                    "output_tok_s",
                    "speedup_vs_off",
                    "outputs_equal_off",
                ],
            )
        )
    if "dtype" in report:
        d = report["dtype"]
        parts.append(
            f"kv_cache_dtype at {d['budget_mib']} MiB of KV, {d['requests']} requests of "
            f"{d['prompt_tokens']} + {d['output_tokens']} tokens at once:"
        )
        parts.append(
            _table(
                d["rows"],
                [
                    "kv_cache_dtype",
                    "bytes_per_token",
                    "pool_tokens",
                    "peak_running",
                    "peak_kv_used_slots",
                    "retractions",
                    "wall_s",
                    "output_tok_s",
                ],
            )
        )
    return "\n\n".join(parts)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a local model folder")
    p.add_argument("--only", choices=["tier", "dtype"], default=None, help="run one of the two measurements")
    p.add_argument("--users", type=int, default=8, help="agents (conversations) at once")
    p.add_argument("--turns", type=int, default=5, help="turns per agent")
    p.add_argument("--system-tokens", type=int, default=64, help="system prompt all agents share")
    p.add_argument("--task-tokens", type=int, default=128, help="each agent's own first message")
    p.add_argument("--tool-tokens", type=int, default=160, help="tool result appended per turn")
    p.add_argument("--output-tokens", type=int, default=8, help="tokens the model writes per turn")
    p.add_argument(
        "--working-set",
        type=float,
        default=4.0,
        help="device pool = the agents' final histories / this (unless --max-total-tokens)",
    )
    p.add_argument("--max-total-tokens", type=int, default=None, help="device KV pool in tokens")
    p.add_argument("--host-kv-size", type=int, default=None, help="host tier in tokens (default 4x working set)")
    p.add_argument("--write-policy", default="write_through", choices=["write_through", "write_back"])
    p.add_argument("--chunked-prefill-size", type=int, default=1024)
    p.add_argument("--kv-budget-mib", type=float, default=64.0, help="dtype sweep: KV memory budget")
    p.add_argument("--dtypes", default="auto,int8,fp8_e4m3", help="dtype sweep: kv_cache_dtypes")
    p.add_argument("--sweep-requests", type=int, default=48, help="dtype sweep: requests at once")
    p.add_argument("--sweep-prompt-tokens", type=int, default=192, help="dtype sweep: prompt tokens each")
    p.add_argument("--sweep-output-tokens", type=int, default=32, help="dtype sweep: output tokens each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--json", default=None, help="write the report as JSON here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"model": args.model}
    if args.only in (None, "tier"):
        report["tier"] = bench_tier(args.model, args)
    if args.only in (None, "dtype"):
        report["dtype"] = bench_dtypes(args.model, args)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.hicache",
        description=__doc__.split("\n\n")[0],
    )
    add_args(p)
    args = p.parse_args(argv)
    report = run(args)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
