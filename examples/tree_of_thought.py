"""Tree of thought: fan out reasoning paths with nested forks, score the leaves
with select, keep the best.

    python examples/tree_of_thought.py [--width 4] [--depth 2]

Every node's prompt extends its parent's, so each level re-uses the KV the
level above computed (RadixAttention), and the branches of a level run
concurrently and batch together.

The program, ``tree_of_thought``, is in ``radixrt/bench/example_programs.py``, where
``python -m radixrt.bench.programs`` takes it from as well.
"""

import argparse
import time

import radixrt as rt
from radixrt.bench.example_programs import TOT_QUESTION, tree_of_thought


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--question", default=TOT_QUESTION)
    args = ap.parse_args()
    engine = rt.Engine()
    rt.set_default_backend(engine)
    t = time.time()
    state = tree_of_thought.run(question=args.question, width=args.width, depth=args.depth)
    leaves = state.ret_value
    print(f"{len(leaves)} leaves in {time.time() - t:.1f}s; best three by the model's own 'yes' score:\n")
    for score, answer, path in leaves[:3]:
        print(f"score {score:6.2f} | answer: {answer}")
        print("        " + path.strip().replace("\n", "\n        ") + "\n")
    stats = engine.get_stats()["cache"]
    print(
        f"radix cache: {stats['hit_tokens']} of {stats['queried_tokens']} prompt tokens were cache hits "
        f"({stats['hit_rate']:.0%})"
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
