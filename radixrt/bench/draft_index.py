"""What the draft index of speculative decoding costs, on real token text.

    python -m radixrt.bench.draft_index [--model default] [--sizes 1000,10000,100000]

For each size, a radix tree (`RadixCache`, no KV pool) with a `DraftIndex`
attached takes that many tokens of Python standard-library source, tokenized
by the model's tokenizer, in runs of 2,000 tokens. It prints, in CPU time of
this process: the index's cost per inserted token and its memory per token
held; the cost of a 16-token chain per drafted token for requests that copy a
run of the tree (the tokens drafted per call beside it), and per call when
nothing matches; and the cost per token of evicting the whole tree. A
``dict.get`` on a small dict is timed in the same run, as the yardstick of
the machine's speed. Cost per drafted token should not grow with the size.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import time
import timeit

from radixrt.help_format import HelpFormatter
from radixrt.memory.draft_index import DraftIndex, OwnTokens
from radixrt.memory.radix_cache import RadixCache

RUN = 2000
# Pure-Python standard-library modules (about 900k tokens of source in all).
SOURCES = (
    "argparse",
    "difflib",
    "inspect",
    "tarfile",
    "zipfile",
    "pathlib",
    "typing",
    "dataclasses",
    "logging",
    "subprocess",
    "configparser",
    "pydoc",
    "tokenize",
    "ast",
    "shutil",
    "statistics",
    "calendar",
    "textwrap",
    "csv",
    "ipaddress",
    "fractions",
    "_pydecimal",
    "optparse",
    "smtplib",
    "ftplib",
    "imaplib",
    "mailbox",
    "doctest",
    "pickletools",
    "email.message",
    "http.client",
    "urllib.request",
    "unittest.case",
    "gettext",
)


def _corpus(model: str, tokens: int) -> list[list[int]]:
    """Runs of `RUN` tokens of standard-library source, `tokens` in all."""
    from transformers import AutoTokenizer

    from radixrt.executor.model_store import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    runs: list[list[int]] = []
    ids: list[int] = []
    for name in SOURCES:
        if len(runs) * RUN >= tokens:
            break
        ids.extend(tok(inspect.getsource(importlib.import_module(name)))["input_ids"])
        while len(ids) >= RUN and len(runs) * RUN < tokens:
            runs.append(ids[:RUN])
            del ids[:RUN]
    return runs


def _measure(runs: list[list[int]], rng: random.Random) -> dict[str, float]:
    tree = RadixCache(None)
    bare = RadixCache(None)
    index = DraftIndex()
    tree.add_observer(index)
    t0 = time.process_time()
    for run in runs:
        tree.insert(run, [0] * len(run))
    t_insert = time.process_time() - t0
    t0 = time.process_time()
    for run in runs:
        bare.insert(run, [0] * len(run))
    t_insert -= time.process_time() - t0  # the index's share only
    held = sum(map(len, runs))
    stats = index.stats()
    owns = []
    for _ in range(200):
        run = rng.choice(runs)
        cut = rng.randrange(16, len(run) - 32)
        owns.append(OwnTokens([1, 2, 3] + run[cut - 16 : cut]))
    drafted = 0
    t0 = time.process_time()
    for own in owns:
        drafted += len(index.propose(None, own, 16))
    t_propose = time.process_time() - t0
    nothing = OwnTokens([rng.randrange(40_000, 49_000) for _ in range(64)])
    t0 = time.process_time()
    for _ in range(200):
        index.propose(None, nothing, 16)
    t_nothing = time.process_time() - t0
    t0 = time.process_time()
    tree.evict(held)
    t_evict = time.process_time() - t0
    assert index.stats()["entries"] == 0
    return {
        "tokens": held,
        "insert_us": 1e6 * t_insert / held,
        "bytes": stats["bytes_per_token"],
        "entries": stats["entries"],
        "propose_us": 1e6 * t_propose / max(drafted, 1),
        "drafted": drafted / len(owns),
        "nothing_us": 1e6 * t_nothing / 200,
        "evict_us": 1e6 * t_evict / held,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.draft_index",
        description=__doc__.split("\n")[0],
    )
    ap.add_argument("--model", default="default", help="whose tokenizer makes the tokens (default: the embedded model)")
    ap.add_argument("--sizes", default="1000,10000,100000", help="tree sizes in tokens, comma-separated")
    args = ap.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    runs = _corpus(args.model, sizes[-1])
    ref = min(timeit.repeat("d.get(5)", "d = {i: i for i in range(100)}", number=200_000, repeat=5)) / 200_000
    print(f"yardstick: dict.get {ref * 1e9:.0f} ns")
    head = ("tokens", "insert us/tok", "bytes/tok", "entries", "propose us/drafted", "drafted/call", "no-match us/call")
    print(" | ".join(head) + " | evict us/tok")
    for size in sizes:
        r = _measure(runs[: max(1, size // RUN)] if size >= RUN else [runs[0][:size]], random.Random(0))
        print(
            f"{r['tokens']} | {r['insert_us']:.2f} | {r['bytes']:.0f} | {r['entries']} | {r['propose_us']:.2f} | "
            f"{r['drafted']:.1f} | {r['nothing_us']:.1f} | {r['evict_us']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
