"""Tensor parallelism: one process per rank, the model's layers split across them.

Rank 0 lives in the scheduler's process and is the only rank that schedules
and samples; it sends each forward (and each LM-head call) to the other ranks,
which run the same computation on their shard in lockstep (`follower.py`).
Every rank owns a KV pool for its own KV heads with the same slot numbering,
so one radix tree and one allocator (rank 0's) describe all of them.
"""

from radixrt.executor.parallel.group import TPGroup
from radixrt.executor.parallel.sharding import HeadSplit, shard_model, split_heads

__all__ = ["TPGroup", "HeadSplit", "shard_model", "split_heads"]
