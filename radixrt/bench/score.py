"""Decoder-only scoring (``POST /v1/score``): what the radix tree saves when items share a query.

    python -m radixrt.bench.score                      # embedded model, 64 items after a ~400-token query
    python -m radixrt.bench.score --items 16 --query-words 100 --repeats 1

One call scores every item (a yes/no classification of a review, with
``apply_softmax``) against a server with the radix cache and one without
(``--disable-radix-cache``), the cache flushed before each repeat; each row
is the median wall time of ``--repeats`` calls, as the client sees it. With
the cache, each item's request reuses the query's KV and computes only its
own tokens; without, every item computes the whole query again. The largest
score difference between the two servers is printed beside them.

Not a timed benchmark; the default run takes about three minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Optional

import httpx

from radixrt.help_format import HelpFormatter

WORDS = ("river", "stone", "light", "garden", "music", "winter", "paper", "north", "engine", "quiet")


def score_body(client: httpx.Client, items: int, query_words: int, seed: int) -> dict:
    """The call: a review as the query, ``items`` short items, the labels " yes" and " no"."""
    rng = random.Random(seed)
    review = " ".join(rng.choice(WORDS) for _ in range(query_words))
    query = f"Review: {review}\nIs this review positive? Answer:"
    texts = [f" (item {i}) " + " ".join(rng.choice(WORDS) for _ in range(8)) for i in range(items)]
    labels = [client.post("/tokenize", json={"prompt": w}).json()["tokens"][0] for w in (" yes", " no")]
    return {"query": query, "items": texts, "label_token_ids": labels, "apply_softmax": True}


def run(url: str, args: argparse.Namespace) -> tuple[float, int, list[list[float]]]:
    """(median wall seconds, prompt tokens, scores) of the call on the server at ``url``."""
    with httpx.Client(base_url=url, timeout=3600) as client:
        body = score_body(client, args.items, args.query_words, args.seed)
        walls, answer = [], {}
        for _ in range(args.repeats):
            client.post("/flush_cache")
            start = time.perf_counter()
            r = client.post("/v1/score", json=body)
            r.raise_for_status()
            walls.append(time.perf_counter() - start)
            answer = r.json()
    return statistics.median(walls), answer["usage"]["prompt_tokens"], answer["scores"]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m radixrt.bench.score", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--model", default="default")
    p.add_argument("--items", type=int, default=64, help="items scored in the call")
    p.add_argument("--query-words", type=int, default=400, help="words of the review (the shared query)")
    p.add_argument("--repeats", type=int, default=3, help="calls per server (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the review's and the items' words")
    args = p.parse_args(argv)
    from radixrt.server.local import LocalServer

    rows = []
    for name, flags in (("radix cache", []), ("no radix cache", ["--disable-radix-cache"])):
        srv = LocalServer(*flags, model=args.model).wait_ready()
        try:
            rows.append((name, *run(srv.url, args)))
        finally:
            srv.stop()
            srv.cleanup()
    print(f"/v1/score: {args.items} items after a {args.query_words}-word query, median of {args.repeats}")
    print(f"{'server':<16} {'wall s':>8} {'items/s':>8} {'prompt tokens':>14}")
    for name, wall, tokens, _ in rows:
        print(f"{name:<16} {wall:8.2f} {args.items / wall:8.1f} {tokens:>14}")
    (_, cached, _, a), (_, uncached, _, b) = rows
    diff = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    print(f"radix cache vs none: {uncached / cached:.1f}x faster; largest score difference {diff:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
