"""Tensor-parallel overhead per decode step: ``python -m radixrt.bench.tp_overhead``.

Decode step time at each ``--tp`` size and batch size, measured as
``(time for long - time for short) / (long - short)`` generated tokens, so
prefill and start-up cancel out; the median over ``--repeats``. On the CPU
(gloo) the ranks share the cores, so this measures the communication and
coordination cost, not a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import radixrt


def step_ms(engine: radixrt.Engine, batch: int, short: int, long: int, repeats: int) -> float:
    prompts = [f"Story {i}: once upon a time" for i in range(batch)]

    def run(n: int) -> float:
        t = time.perf_counter()
        engine.generate(prompts, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        return time.perf_counter() - t

    run(4)  # warm up
    return statistics.median((run(long) - run(short)) / (long - short) * 1e3 for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=80)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    base: dict[int, float] = {}
    for tp in args.tp:
        engine = radixrt.Engine(args.model, tp_size=tp, max_total_tokens=8192)
        try:
            for bs in args.batch:
                ms = step_ms(engine, bs, args.short, args.long, args.repeats)
                base.setdefault(bs, ms)
                print(f"tp {tp} batch {bs:>3}: {ms:7.1f} ms/step  ({ms / base[bs]:.2f}x tp {args.tp[0]})", flush=True)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
