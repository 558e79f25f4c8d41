"""Host cost of the penalty stage per step: ``python -m radixrt.bench.penalty_stage``.

A batch of rows with repetition and frequency penalties, each output growing
by one token per step, through ``Sampler.process_logits`` (stages 1-3) for
``--steps`` steps; prints the median time per step. The rows carry their
``TokenCounts`` across steps as the scheduler's requests do (``--no-carry``:
a fresh count each step, i.e. the cost of rebuilding from the whole lists).
The figure includes the ``[B, V]`` float32 copy every processed batch makes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from radixrt.sampling.params import SamplingParams
from radixrt.sampling.penalties import TokenCounts
from radixrt.sampling.sampler import Sampler, SamplingRow


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=500, help="output tokens before the first timed step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--no-carry", action="store_true", help="rebuild the counts from the lists every step")
    args = p.parse_args(argv)
    rng = random.Random(0)
    sampler = Sampler(args.vocab, [0])
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, temperature=0)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    outputs = [[rng.randrange(args.vocab) for _ in range(args.output_len)] for _ in range(args.batch)]
    counts = [TokenCounts() for _ in range(args.batch)]
    logits = torch.randn(args.batch, args.vocab)
    times = []
    for _ in range(args.steps + 1):
        rows = [
            SamplingRow(params, i, outputs[i], prompts[i], counts=None if args.no_carry else counts[i])
            for i in range(args.batch)
        ]
        t = time.perf_counter()
        sampler.process_logits(logits, rows)
        times.append(time.perf_counter() - t)
        for out in outputs:
            out.append(rng.randrange(args.vocab))
    per_step = statistics.median(times[1:]) * 1e3  # the first step builds the counts
    mode = "rebuilt each step" if args.no_carry else "carried across steps"
    print(
        f"penalty stage, batch {args.batch}, prompt {args.prompt_len}, output {args.output_len}+: "
        f"{per_step:.2f} ms/step (counts {mode}, {torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    main()
