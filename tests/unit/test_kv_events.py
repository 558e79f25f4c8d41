"""KV cache events (radixrt/memory/kv_events.py): what a router sees of the radix tree, in vLLM's
schema. A consumer that keeps only the events must be able to rebuild every cached prefix."""

from __future__ import annotations

import random

import msgspec
import pytest

from radixrt.memory.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
    decode_batch,
    encode_batch,
)
from radixrt.memory.kv_pool import PageAllocator
from radixrt.memory.radix_cache import RadixCache


class Follower:
    """A router's view: block hash -> (parent hash, the block's tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple] = {}

    def apply(self, batch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    self.blocks[h] = (parent, tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size]))
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.blocks.pop(h)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()

    def sequences(self) -> set[tuple]:
        """Every cached prefix that ends at a block (the tokens from its sequence's start)."""
        out = set()
        for h in self.blocks:
            tokens: list = []
            while h is not None:
                parent, toks = self.blocks[h]
                tokens[:0] = toks
                h = parent
            out.add(tuple(tokens))
        return out


def _tree_prefixes(tree: RadixCache, page_size: int) -> set[tuple]:
    out = set()
    for sub in tree.root.children.values():
        stack = [(c, []) for c in sub.children.values()]
        while stack:
            node, path = stack.pop()
            for i in range(page_size, len(node.key) + 1, page_size):
                out.add(tuple(path + node.key[:i]))
            stack.extend((c, path + node.key) for c in node.children.values())
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_follower_rebuilds_every_cached_prefix(page_size):
    rng = random.Random(page_size)
    alloc = PageAllocator(4000 // page_size, page_size)
    tree = RadixCache(alloc, page_size=page_size)
    tree.insert([1, 2, 3, 4] * page_size, alloc.pages_to_slots(alloc.alloc_pages(4)))  # before the recorder
    recorder = KVEventRecorder(page_size)
    tree.add_node_observer(recorder)
    follower = Follower()
    for step in range(300):
        n = rng.randrange(1, 12) * page_size
        key = [rng.randrange(6) for _ in range(n)]
        pages = alloc.alloc_pages(n // page_size)
        if pages is None:
            tree.evict(200)
            continue
        slots = alloc.pages_to_slots(pages)
        present = tree.insert(key, slots, namespace=rng.choice([None, "tenant"]))
        if present:
            alloc.free_slots(slots[:present])
        if step % 25 == 24:
            tree.evict(rng.randrange(1, 100))
        batch = recorder.drain()
        if batch is not None:
            follower.apply(decode_batch(encode_batch(batch)))  # through the wire format
        if step == 150:
            tree.reset()
            follower.apply(recorder.drain())
            assert follower.blocks == {}
    # the same prefix in two namespaces is two different chains, so compare the union per page count
    assert follower.sequences() == _tree_prefixes(tree, page_size)


def test_the_wire_format_is_vllms():
    recorder = KVEventRecorder(2)
    alloc = PageAllocator(100, 2)
    tree = RadixCache(alloc, page_size=2)
    tree.add_node_observer(recorder)
    tree.insert([5, 6, 7, 8], alloc.pages_to_slots(alloc.alloc_pages(2)))
    raw = msgspec.msgpack.decode(encode_batch(recorder.drain()))
    ts, events = raw[0], raw[1]
    assert isinstance(ts, float) and raw[2:] in ([], [None])  # [ts, events, data_parallel_rank]
    tag, hashes, parent, tokens, block_size, lora_id, medium = events[0]
    assert tag == "BlockStored" and len(hashes) == 2 and parent is None and tokens == [5, 6, 7, 8]
    assert block_size == 2 and lora_id is None and medium is None
    tree.reset()
    assert msgspec.msgpack.decode(encode_batch(recorder.drain()))[1] == [["AllBlocksCleared"]]
