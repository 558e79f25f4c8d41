"""A 5-shot batch with a progress bar.

    python examples/few_shot_batch.py [--n 64]

Every program starts with the same five worked examples. ``run_batch``
prefills that shared prefix once before the batch; every program then
computes only its own question, and the requests batch together.

The program, ``capital_qa`` (a shared preamble, then one question), and its
questions are in ``radixrt/bench/example_programs.py``, where
``python -m radixrt.bench.programs`` takes them from as well.
"""

import argparse
import time

import radixrt as rt
from radixrt.bench.example_programs import CAPITAL_QUESTIONS, capital_qa


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args()
    engine = rt.Engine()
    rt.set_default_backend(engine)
    questions = (CAPITAL_QUESTIONS * (args.n // len(CAPITAL_QUESTIONS) + 1))[: args.n]

    t = time.time()
    states = capital_qa.run_batch([{"country": c} for c, _ in questions], temperature=0, progress_bar=True)
    elapsed = time.time() - t

    correct = sum(st["answer"].strip() == a for st, (_, a) in zip(states, questions))
    metas = [st.get_meta_info("answer") for st in states]
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    for st, (c, a) in list(zip(states, questions))[:5]:
        print(f"capital of {c}: {st['answer'].strip()} (expected {a})")
    print(f"\n{args.n} programs in {elapsed:.1f}s; {correct}/{args.n} correct")
    print(f"prompt tokens served from the radix cache: {cached}/{prompt} ({cached / prompt:.0%})")
    engine.shutdown()


if __name__ == "__main__":
    main()
