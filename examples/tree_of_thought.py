"""Tree of thought: fan out reasoning paths with nested forks, score the leaves
with select, keep the best.

    python examples/tree_of_thought.py [--width 4] [--depth 2]

Every node's prompt extends its parent's, so each level re-uses the KV the
level above computed (RadixAttention), and the branches of a level run
concurrently and batch together.
"""
import argparse
import time

import radixrt as rt


@rt.function
def tree_of_thought(s, question, width=4, depth=2):
    s += rt.system("You solve problems by thinking step by step.")
    s += rt.user(question)
    s += rt.assistant_begin()
    frontier = [s]
    for level in range(depth):
        children = []
        for node in frontier:
            kids = node.fork(width)
            for kid in kids:
                kid += f"Step {level + 1}:" + rt.gen("thought", max_tokens=24, stop="\n", temperature=0.9,
                                                     top_p=0.95) + "\n"
            children.extend(kids)
        frontier = children
    for leaf in frontier:
        leaf += "Answer:" + rt.gen("answer", max_tokens=12, stop="\n", temperature=0) + "\n"
        leaf += "Is this answer correct (yes or no)?" + rt.select("verdict", choices=[" yes", " no"])
    leaves = []
    for leaf in frontier:
        yes_score = leaf.get_meta_info("verdict")["normalized_prompt_logprobs"][0]
        path = leaf.text()[len(s.text()):].split("Answer:")[0]
        leaves.append((yes_score, leaf["answer"].strip(), path))
    leaves.sort(key=lambda x: -x[0])
    return leaves


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--question", default="A farmer has 3 pens with 4 sheep in each pen. "
                                          "He buys 5 more sheep. How many sheep does he have?")
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
    print(f"radix cache: {stats['hit_tokens']} of {stats['queried_tokens']} prompt tokens were cache hits "
          f"({stats['hit_rate']:.0%})")
    engine.shutdown()


if __name__ == "__main__":
    main()
