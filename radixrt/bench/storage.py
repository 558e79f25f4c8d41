"""The storage tier: what a restart and a second server cost with and without it.

    python -m radixrt.bench.storage                    # embedded model, 4,000-token prefix
    python -m radixrt.bench.storage --prefix-tokens 1000 --agents 2 --turns 3
    radixrt bench --storage

Everything goes through `Engine.generate` (what a client of the Engine sees;
time to first token is the wall time of a request for one token, after one
unrelated warm-up request per engine), each engine with
``--hicache-storage-backend file`` on a fresh directory:

1. **fill**: a fresh engine computes a long shared prefix (``cold``: the
   recompute a server without the tier pays after every restart) and runs an
   agent workload (agents sharing a system prompt, each turn resending the
   agent's whole history) once (``first pass``);
2. **warm**: the same engine answers new questions on the prefix
   (``warm in memory``) and replays the workload (``replay, before restart``);
3. **restart**: the engine is shut down and a new one opens the same store
   and restores its most recently used sequences in the background (the
   default): its first request on the prefix once the restore is done
   (``after restart``, the median over ``--restarts`` restarts; the restore's
   time from the engine's start is reported beside it) and a replay of the
   workload (``replay, after restart``); the same request sent right after
   the warm-up, while the restore may still run (``after restart, during
   the restore``); and with the restore off, the blocks read when the
   request needs them (``after restart, read on demand``).

Then **two servers**: with a Redis server on 127.0.0.1 (``redis-server`` on
the PATH; skipped otherwise), engine A runs the workload on a cold shared
store and engine B, started next to it, runs the same workload: the prompt
tokens B computed against those A computed. Finally **slow disk**: the bytes
the restart read and what they would take at a SATA SSD's and a network
disk's read speed.

Not a timed test; the default run takes a few minutes on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from radixrt.bench.common import report_out
from radixrt.help_format import HelpFormatter

SLOW_DISKS = {"SATA SSD (500 MB/s)": 500e6, "network disk (125 MB/s)": 125e6}


@dataclass
class Pass:
    name: str
    hit_rate: float
    prompt_tokens_computed: int
    storage_hit_tokens: int
    wall_s: float


def _words(rng: random.Random, n: int) -> str:
    vocab = "alpha beta gamma delta ledger invoice route cargo tariff berth crane vessel manifest".split()
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(n))


def workload(agents: int, turns: int, seed: int) -> list[str]:
    """Prompts of ``agents`` agents x ``turns`` turns sharing one system prompt;
    each turn resends the agent's whole history (as chat agents do)."""
    rng = random.Random(seed)
    system = "System: you are a logistics agent. Tools: lookup, book, cancel. " + _words(rng, 500)
    histories = [f"{system}\nTask {a}: " + _words(rng, 60) for a in range(agents)]
    prompts = []
    for _ in range(turns):
        for a in range(agents):
            histories[a] += f"\nCall: lookup({_words(rng, 6)})\nResult: " + _words(rng, 90)
            prompts.append(histories[a] + "\nNext:")
    return prompts


def _engine(model: str, **flags: Any) -> Any:
    """A started engine that has served one unrelated short request (what any
    process pays once on its first forward is not a cost of a tier)."""
    import radixrt

    engine = radixrt.Engine(model, **flags)
    engine.generate("Warm-up.", {"max_new_tokens": 1})
    return engine


def _ttft(engine: Any, prompt: str) -> float:
    t = time.perf_counter()
    engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0.0})
    return time.perf_counter() - t


def _pass(engine: Any, name: str, prompts: list[str]) -> Pass:
    before = engine.scheduler.stats()
    t = time.perf_counter()
    for p in prompts:
        engine.generate(p, {"max_new_tokens": 8, "temperature": 0.0})
    wall = time.perf_counter() - t
    after = engine.scheduler.stats()
    q = after["cache"]["queried_tokens"] - before["cache"]["queried_tokens"]
    hit = after["cache"]["hit_tokens"] - before["cache"]["hit_tokens"]
    return Pass(
        name,
        round(hit / q, 4) if q else 0.0,
        after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
        after["cache"]["storage_hit_tokens"] - before["cache"]["storage_hit_tokens"],
        round(wall, 2),
    )


def _prefix(tokens: int, seed: int) -> str:
    return "Reference manual. " + _words(random.Random(seed + 1), int(tokens / 2.4))


def three_phases(args: argparse.Namespace, store: str) -> dict[str, Any]:
    flags = dict(hicache_storage_backend="file", hicache_storage_dir=store, **_extra(args))
    prefix, prompts = _prefix(args.prefix_tokens, args.seed), workload(args.agents, args.turns, args.seed)
    ask = [f"\nQuestion {i}: which entry comes first?" for i in range(3 * args.restarts + 4)]
    e = _engine(args.model, **flags)
    cold = _ttft(e, prefix + ask[0])
    prefix_tokens = len(e.tokenizer.encode(prefix + ask[0]))
    first = _pass(e, "first pass (cold store)", prompts)
    warm = statistics.median(_ttft(e, prefix + q) for q in ask[1:4])
    before = _pass(e, "replay, before restart", prompts)
    e.shutdown()
    n = args.restarts
    off = dict(flags, hicache_storage_restore_tokens=0)
    on_demand = [_restart(args, off, prefix + q) for q in ask[4 : 4 + n]]
    restored = [
        _restart(args, flags, prefix + q, replay=prompts if i == 0 else None)
        for i, q in enumerate(ask[4 + n : 4 + 2 * n])
    ]
    racing = [_restart(args, flags, prefix + q, wait=False) for q in ask[4 + 2 * n :]]
    after = restored[0].pop("replay")
    restart = statistics.median(r["ttft_s"] for r in restored)
    on_demand_s = statistics.median(r["ttft_s"] for r in on_demand)
    racing_s = statistics.median(r["ttft_s"] for r in racing)
    read_bytes = on_demand[-1]["read_bytes"]
    return {
        "prefix_tokens": prefix_tokens,
        "ttft_s": {
            "cold": round(cold, 3),
            "warm in memory": round(warm, 3),
            "after restart": round(restart, 3),
            "after restart, read on demand": round(on_demand_s, 3),
            "after restart, during the restore": round(racing_s, 3),
        },
        "restart_vs_warm": round(restart / warm, 2),
        "restart_vs_cold": round(restart / cold, 3),
        "on_demand_vs_warm": round(on_demand_s / warm, 2),
        "during_restore_vs_warm": round(racing_s / warm, 2),
        "restore": [r["restore"] for r in restored],
        "passes": [asdict(p) for p in (first, before, after) if p is not None],
        "replay_hit_rate_kept": round(after.hit_rate / before.hit_rate, 3) if after and before.hit_rate else None,
        "restart_read_bytes": read_bytes,
        "slow_disk_extra_s": {k: round(read_bytes / bps, 3) for k, bps in SLOW_DISKS.items()},
    }


def _restart(
    args: argparse.Namespace, flags: dict[str, Any], prompt: str, replay: Optional[list[str]] = None, wait: bool = True
) -> dict:
    """A restarted engine's time to first token on ``prompt`` after its warm-up request
    and, when it restores the store at start and ``wait``, after the restore is done (how
    long that took from the engine's start is reported beside it); then a replay of ``replay``."""
    e = _engine(args.model, **flags)
    ready = time.perf_counter()
    while wait and (restore := e.scheduler.stats()["storage_kv"]["restore"]) is not None and not restore["done"]:
        time.sleep(0.01)
    restore = e.scheduler.stats()["storage_kv"]["restore"]
    if restore is not None:  # how long a request had to wait for it, counted from the warm-up's answer
        restore["after_ready_s"] = round(time.perf_counter() - ready, 3) if restore["done"] else None
    out: dict[str, Any] = {"ttft_s": _ttft(e, prompt), "restore": restore}
    stats = e.scheduler.stats()["storage_kv"]
    out["read_bytes"] = stats["hit_blocks"] * stats["stored_bytes"] // max(1, stats["blocks"])
    if replay is not None:
        out["replay"] = _pass(e, "replay, after restart", replay)
    e.shutdown()
    return out


def two_servers(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    server = shutil.which("redis-server")
    if server is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            flags = dict(hicache_storage_backend="redis", hicache_storage_url=f"redis://127.0.0.1:{port}/0")
            prompts = workload(args.agents, args.turns, args.seed + 7)
            a = _engine(args.model, **flags, **_extra(args))
            pass_a = _pass(a, "server A, cold store", prompts)
            b = _engine(args.model, **flags, **_extra(args))
            pass_b = _pass(b, "server B, A's workload", prompts)
            a.shutdown()
            b.shutdown()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return {
        "passes": [asdict(pass_a), asdict(pass_b)],
        "b_computed_vs_a": round(pass_b.prompt_tokens_computed / max(1, pass_a.prompt_tokens_computed), 3),
    }


def _extra(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"dtype": args.dtype} if args.dtype else {}
    if args.block_tokens:
        extra["hicache_storage_block_tokens"] = args.block_tokens
    return extra


def render(report: dict[str, Any]) -> str:
    r = report["three_phases"]
    t = r["ttft_s"]
    lines = [
        f"storage tier, {r['prefix_tokens']}-token prefix: time to first token",
        f"  cold (recompute) {t['cold']:.3f} s | warm in memory {t['warm in memory']:.3f} s | "
        f"after restart {t['after restart']:.3f} s  (restart = {r['restart_vs_warm']}x warm, "
        f"{r['restart_vs_cold']}x cold)",
        f"  the restore at start: {r['restore'][0]} (each restart: "
        + ", ".join(f"{x['seconds']} s from the tier's start, {x['after_ready_s']} s after ready" for x in r["restore"])
        + ")",
        f"  after restart with the restore off (blocks read on demand): {t['after restart, read on demand']:.3f} s "
        f"({r['on_demand_vs_warm']}x warm)",
        f"  after restart, sent while the restore runs: {t['after restart, during the restore']:.3f} s "
        f"({r['during_restore_vs_warm']}x warm)",
        "agent workload: pass, hit rate, prompt tokens computed, storage hit tokens, wall s",
    ]
    for p in r["passes"]:
        lines.append(
            f"  {p['name']:<26} {p['hit_rate']:.3f}  {p['prompt_tokens_computed']:>7}  "
            f"{p['storage_hit_tokens']:>7}  {p['wall_s']}"
        )
    lines.append(f"  hit rate kept across the restart: {r['replay_hit_rate_kept']}")
    two = report.get("two_servers")
    if two is None:
        lines.append("two servers: skipped (no redis-server on the PATH)")
    else:
        for p in two["passes"]:
            lines.append(f"  {p['name']:<26} {p['hit_rate']:.3f}  {p['prompt_tokens_computed']:>7}")
        lines.append(f"  server B computed {two['b_computed_vs_a']}x the prompt tokens server A did")
    mb = r["restart_read_bytes"] / 1e6
    slow = ", ".join(f"{k}: +{v} s" for k, v in r["slow_disk_extra_s"].items())
    lines.append(f"slow disk: the restart read {mb:.0f} MB; at {slow}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.storage",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default=None, help="the engines' dtype (default: the engine's own choice)")
    p.add_argument("--prefix-tokens", type=int, default=4000)
    p.add_argument("--block-tokens", type=int, default=None, help="tokens per stored block (default: the engine's)")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--restarts", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-two-servers", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="radixrt-kv-store-") as store:
        report: dict[str, Any] = {"three_phases": three_phases(args, store)}
    report["two_servers"] = None if args.no_two_servers else two_servers(args)
    return report_out(report, render(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
