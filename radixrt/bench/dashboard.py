"""What the cache's live view costs (``/dashboard``, ``/debug/radix``, ``/debug/stream``).

    python -m radixrt.bench.dashboard                 # both parts
    python -m radixrt.bench.dashboard --skip-server   # the snapshot only (no model)

1. **Snapshot of a big tree**: a radix tree of ``--nodes`` (100,000) nodes in
   two namespaces, built in process; the median time of `radix_snapshot` as
   the scheduler takes it for the page (depth 8, 500 nodes, the hidden sizes
   counted within their budget) and for everything (every node listed), and
   of encoding the page's answer as JSON; the scheduler's time for one stream
   tick (`Scheduler.stats`, 32 requests running on a tiny model); and the
   share of the scheduler's thread the page takes (10 ticks and one tree a
   second).
2. **Decode with the page open**: one server (embedded model); ``--batch``
   fresh requests (the cache flushed) decode ``--tokens`` tokens each, alone and then with a viewer that
   reads ``/debug/stream`` at 10 updates a second and ``/debug/radix`` once a
   second (what the page does), alternating ``--repeats`` times; the ratio of
   the median wall times is the step-time overhead. The viewer runs in this
   process, on the same two cores, as a browser on the same machine would.

Not a timed benchmark.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from typing import Any, Optional

import httpx

from radixrt.help_format import HelpFormatter


def build_tree(nodes: int, seed: int = 0) -> Any:
    """A radix tree of about ``nodes`` nodes: random branching prompts in two namespaces."""
    from radixrt.memory.kv_pool import PageAllocator
    from radixrt.memory.radix_cache import RadixCache
    from radixrt.memory.radix_snapshot import radix_snapshot

    rng = random.Random(seed)
    alloc = PageAllocator(40 * nodes, 1)
    tree = RadixCache(alloc, page_size=1)
    inserted = 0
    while True:
        key = [rng.randrange(50) for _ in range(rng.randrange(2, 12))] + [rng.randrange(1000) for _ in range(8)]
        slots = alloc.alloc_pages(len(key))
        present = tree.insert(key, slots, namespace=rng.choice([None, None, "tenant"]))
        if present:
            alloc.free_slots(slots[:present])
        inserted += 1
        if inserted % 2000 == 0:
            counted = radix_snapshot(tree.root, max_nodes=2, count_budget=20 * nodes)["namespaces"]
            if sum(ns["nodes"] for ns in counted) >= nodes:
                return tree


def snapshot_times(nodes: int, repeats: int) -> dict[str, float]:
    from radixrt.memory.radix_snapshot import radix_snapshot

    tree = build_tree(nodes)
    out: dict[str, float] = {}
    for name, kw in (("page view (depth 8, 500 nodes)", {}), ("every node", {"max_depth": 64, "max_nodes": nodes})):
        times, encode = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            snap = radix_snapshot(tree.root, **kw)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            json.dumps(snap)
            encode.append(time.perf_counter() - t)
        out[f"{name}: snapshot ms"] = 1000 * statistics.median(times)
        out[f"{name}: JSON ms"] = 1000 * statistics.median(encode)
        out[f"{name}: nodes listed"] = len(snap["nodes"])
    return out


def stats_cost(repeats: int = 200) -> float:
    """Milliseconds the scheduler spends answering one stream tick (`Scheduler.stats`), with 32
    requests running on a tiny random model."""
    import tempfile

    from radixrt.bench.tiny_model import make_tiny_model
    from radixrt.config import EngineConfig
    from radixrt.requests.messages import GenerateReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler

    with tempfile.TemporaryDirectory() as tmp:
        sched = Scheduler(EngineConfig(model_path=make_tiny_model(tmp, "llama"), max_total_tokens=65536))
        for i in range(32):
            sp = SamplingParams(max_new_tokens=100)
            sched.add_request(GenerateReq(rid=f"r{i}", input_ids=list(range(10 + i, 300 + i)), sampling=sp))
        for _ in range(5):
            sched.step()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            sched.stats()
            times.append(time.perf_counter() - t)
        sched.close()
    return 1000 * statistics.median(times)


class Viewer:
    """What the page does: the stream at 10 a second, the tree once a second."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.events = 0
        self.snapshots = 0
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._tree)]

    def _stream(self) -> None:
        with httpx.stream("GET", self.url + "/debug/stream", params={"rate": 10}, timeout=None) as r:
            for line in r.iter_lines():
                self.events += line.startswith("data: ")
                if self.stop.is_set():
                    return

    def _tree(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.wait(1.0):
                client.get("/debug/radix", params={"max_depth": 8, "max_nodes": 300})
                self.snapshots += 1

    def __enter__(self) -> "Viewer":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


def decode_wall(client: httpx.Client, batch: int, tokens: int, seed: int) -> float:
    """Seconds for ``batch`` fresh prompts (the cache flushed first) to decode ``tokens`` each."""
    client.post("/flush_cache")
    rng = random.Random(seed)
    prompts = [" ".join(str(rng.randrange(10**6)) for _ in range(60)) for _ in range(batch)]
    sp = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
    t = time.perf_counter()
    r = client.post("/generate", json={"text": prompts, "sampling_params": sp})
    r.raise_for_status()
    return time.perf_counter() - t


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    from radixrt.server.local import LocalServer

    srv = LocalServer("--max-total-tokens", "32768", model=args.model).wait_ready()
    walls: dict[str, list[float]] = {"closed": [], "open": []}
    seen = {"events": 0, "snapshots": 0}
    try:
        with httpx.Client(base_url=srv.url, timeout=3600) as client:
            decode_wall(client, args.batch, 8, seed=99)  # warm-up
            for i in range(args.repeats):
                walls["closed"].append(decode_wall(client, args.batch, args.tokens, seed=2 * i))
                with Viewer(srv.url) as viewer:
                    walls["open"].append(decode_wall(client, args.batch, args.tokens, seed=2 * i + 1))
                seen["events"] += viewer.events
                seen["snapshots"] += viewer.snapshots
    finally:
        srv.stop()
        srv.cleanup()
    closed, opened = statistics.median(walls["closed"]), statistics.median(walls["open"])
    return {
        "batch": args.batch,
        "tokens": args.tokens,
        "page closed s": closed,
        "page open s": opened,
        "overhead %": 100 * (opened / closed - 1),
        "stream events seen": seen["events"],
        "snapshots seen": seen["snapshots"],
        "walls": walls,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.dashboard",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="default")
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"snapshot": snapshot_times(args.nodes, 5)}
    result["snapshot"]["one stream tick: scheduler ms"] = tick = stats_cost()
    page = result["snapshot"]["page view (depth 8, 500 nodes): snapshot ms"]
    # what the page costs the scheduler's thread per second: 10 ticks and one tree
    result["snapshot"]["scheduler busy per second of viewing %"] = (10 * tick + page) / 10
    for k, v in result["snapshot"].items():
        print(f"{k:<48} {v:10.3f}")
    if not args.skip_server:
        result["overhead"] = overhead(args)
        for k, v in result["overhead"].items():
            if k != "walls":
                print(f"{k:<48} {v:10.2f}" if isinstance(v, float) else f"{k:<48} {v:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
