"""What the debug view (``GET /debug/radix``, ``/dashboard``) asks of the scheduler.

`radix_view` answers a `RadixSnapshotReq` between steps, on the scheduler's
thread: a bounded snapshot of the radix tree (radixrt/memory/radix_snapshot.py),
the KV pool by state, and the requests, each with the tree node its cached
path ends at (``node``: the page highlights that path) and how much of its
prompt the cache served. It only reads (a match would split nodes); its cost
is bounded by the request's limits, not by the tree's size.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.radix_node import TreeNode
from radixrt.memory.radix_snapshot import namespace_label, radix_snapshot
from radixrt.requests.messages import RadixSnapshotReq
from radixrt.scheduler.queues import RequestQueues

MAX_LISTED_REQUESTS = 256


def radix_view(
    kv: KVCacheManager,
    queues: RequestQueues,
    msg: RadixSnapshotReq,
    stored: Optional[Callable[[TreeNode], bool]] = None,
) -> dict[str, Any]:
    """The snapshot ``msg`` asks for, with the running and waiting requests;
    ``stored``: the storage tier's `holds` (nodes also on storage), if any."""
    tree = kv.tree
    snap = radix_snapshot(tree.root, msg.max_depth, msg.max_nodes, msg.tokens_per_node, stored=stored)
    requests = []
    for state, queue in (("running", queues.running), ("waiting", queues.waiting)):
        for r in queue[:MAX_LISTED_REQUESTS]:
            requests.append(
                {
                    "rid": r.parent,
                    "sample": r.rid,
                    "state": state,
                    "namespace": namespace_label(r.namespace),
                    "prompt_tokens": len(r.input_ids),
                    "output_tokens": len(r.output_ids),
                    "cached_tokens": r.cached_tokens,
                    "tree_tokens": r.tree_len,
                    "node": r.last_node.id if r.last_node is not None and r.last_node.key else None,
                }
            )
    return {
        **snap,
        "requests": requests,
        "kv": kv.usage(queues.running),
        "host_kv": kv.host_usage(),
        "cache": tree.stats(),
    }
