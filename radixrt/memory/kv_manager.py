"""Moves KV slots between the free list, the radix tree and running requests.

Every slot is at all times exactly one of: free (in the allocator), owned by
the radix tree, or private to one request (``req.slots[req.tree_len:]``, in
whole pages). `check_invariant` asserts ``free + tree + private == total``.

It also keeps the device-side request-to-slot table (`ReqToTokenPool`) in step
with ``req.slots``: a running request owns one row of it (``req.row``), given
at `admit` and taken back at `release`.

A request is seen through `RequestKV` (kv_handle.py), the KV fields it holds
and what they are keyed by; this class is the only writer of those fields.

The prefix cache is any `PrefixCache` (prefix_cache.py): the device radix
tree, the tree over a host tier, or the cache that keeps nothing; this class
only calls that interface. With a tier below the device, `match(load=True)`
loads a prefix it holds back into device slots, `release(swap=True)` moves a
retracted request's KV down (swap preemption), and `take_transfers` hands the
copies these queued to the step being launched (host_pool.py).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence, cast

from radixrt.memory.kv_handle import RequestKV
from radixrt.memory.kv_pool import PageAllocator
from radixrt.memory.kv_transfer import KVTransfers
from radixrt.memory.prefix_cache import PrefixCache
from radixrt.memory.radix_node import MatchResult
from radixrt.memory.req_to_token import ReqToTokenPool


class KVCacheManager:
    def __init__(
        self,
        allocator: PageAllocator,
        tree: PrefixCache,
        req_to_token: ReqToTokenPool,
        copy_slots: Optional[Callable[[Sequence[int], Sequence[int]], None]] = None,
    ) -> None:
        """``copy_slots(src, dst)``: copies the pool's K/V of slots ``src`` to ``dst``
        (`KVPool.copy_slots`), which `keep_branch` needs with pages above one slot."""
        self.allocator = allocator
        self.tree = tree
        self.req_to_token = req_to_token
        self.copy_slots = copy_slots
        self.page_size = allocator.page_size
        self.swapped_out_requests = 0
        self.swapped_out_tokens = 0
        self.swap_declined = 0  # retractions the swap cost model left to recompute (the planner counts them)

    # -- queries -----------------------------------------------------------------
    def match(self, req: RequestKV, load: bool = False) -> MatchResult:
        """Longest usable cached prefix of the request (does not lock, counts nothing).
        ``load``: also load back what a lower tier holds of it (copies queued)."""
        cap = req.max_prefix_len
        return self.tree.match_prefix(req.seq[:cap], namespace=req.namespace, record_stats=False, load_back=load)

    def record_admission(self, req: RequestKV, hit: int, host_hit: int = 0, storage_hit: int = 0) -> None:
        """Count a request's prompt in the hit-rate statistics, once, at first admission;
        ``host_hit`` of the ``hit`` tokens came back from the host tier, ``storage_hit``
        of those were read from the storage tier for it. Every node of its matched
        path counts a hit (``TreeNode.hits``)."""
        self.tree.record_match(req.prompt_len, hit, host_hit)
        self.tree.storage_hit_tokens += storage_hit
        node = req.last_node if hit else None
        while node is not None and node.key:
            node.hits += 1
            node = node.parent

    def take_transfers(self) -> KVTransfers:
        """The copies between tiers queued since the last call, for the step being launched."""
        return self.tree.take_transfers()

    def available_slots(self) -> int:
        """Slots obtainable now: free ones plus what eviction could free."""
        return self.allocator.num_free_slots + self.tree.evictable_size()

    # -- ownership transitions -----------------------------------------------------
    def admit(self, req: RequestKV, match: MatchResult) -> None:
        """Give a waiting request the matched prefix (its slots are tree-owned; the
        node is locked) and a row of the request-to-slot table."""
        assert not req.slots and req.last_node is None and req.row is None
        self.tree.lock(match.node)
        req.last_node = match.node
        req.slots = list(match.slots)
        req.tree_len = match.length
        req.row = self.req_to_token.alloc_row()
        if match.length:
            self.req_to_token.write(req.row, 0, req.slots)

    def extend(self, req: RequestKV, num_tokens: int) -> bool:
        """Reserve slots for the request's next ``num_tokens`` tokens, evicting
        unlocked tree leaves if needed. On failure nothing changes."""
        P = self.page_size
        room = (-len(req.slots)) % P  # unused slots in the request's private last page
        take = min(room, num_tokens)
        pages_needed = -(-(num_tokens - take) // P)
        if pages_needed > self.allocator.num_free_pages:
            self.tree.evict((pages_needed - self.allocator.num_free_pages) * P)
        pages = self.allocator.alloc_pages(pages_needed) if pages_needed else []
        if pages is None:
            return False
        start = len(req.slots)
        if take:
            last = req.slots[-1]
            req.slots.extend(range(last + 1, last + 1 + take))
        if pages:
            req.slots.extend(self.allocator.pages_to_slots(pages)[: num_tokens - take])
        self.req_to_token.write(_row(req), start, req.slots[start:])
        return True

    def extend_decode(self, reqs: Sequence[RequestKV]) -> bool:
        """Reserve one slot for the next token of each request, in one allocator
        call (the decode fast path): a request with room in its private last page
        takes the next slot of it, the others a fresh page each, handed out in
        order as `extend(req, 1)` for each in turn would. Unlocked tree leaves are
        evicted if needed. All or nothing: on failure no slot is taken (eviction
        may have happened) and False is returned."""
        P = self.page_size
        fresh = len(reqs) if P == 1 else sum(1 for r in reqs if not len(r.slots) % P)
        short = fresh - self.allocator.num_free_pages
        if short > 0:
            self.tree.evict(short * P)
        pages = self.allocator.alloc_pages(fresh)
        if pages is None:
            return False
        rows: list[Optional[int]] = []
        cols: list[int] = []
        if P == 1:
            slots = pages
            for r, s in zip(reqs, slots):
                own = r.slots
                rows.append(r.row)
                cols.append(len(own))
                own.append(s)
        else:
            slots = []
            new_pages = iter(pages)
            for r in reqs:
                own = r.slots
                n = len(own)
                s = own[-1] + 1 if n % P else next(new_pages) * P
                own.append(s)
                rows.append(r.row)
                slots.append(s)
                cols.append(n)
        assert None not in rows, "a request being extended holds a table row"
        self.req_to_token.write_many(cast("list[int]", rows), cols, slots)
        return True

    def cache_prefix(self, req: RequestKV, limit: Optional[int] = None, computed: bool = True) -> None:
        """Hand the request's whole pages among its first ``limit`` slots (default:
        all) to the tree (RadixAttention's insert after prefill). Duplicates of
        what the tree already held are freed, and the request switches to the
        tree's slots, locked through its new node.

        The scheduler calls it when it launches a prefill chunk, before the
        chunk's KV is computed (``computed=False``: a write-through copy to the
        host runs after that step's forward): steps run in launch order, so
        only a later step can read those slots, and the request's lock keeps
        them from eviction."""
        if not self.tree.stores_prefixes or not req.insert_into_tree:
            return
        P = self.page_size
        length = min(len(req.slots), len(req.slots) if limit is None else limit)
        length = min(length, req.tree_limit if req.tree_limit is not None else length) // P * P
        if length <= req.tree_len:
            return
        key = req.seq[:length]
        present = self.tree.insert(key, req.slots[:length], namespace=req.namespace, computed=computed)
        if present > req.tree_len:
            self.allocator.free_slots(req.slots[req.tree_len : present])
        match = self.tree.match_prefix(key, namespace=req.namespace, record_stats=False)
        assert match.length == length, (match.length, length)
        self.tree.lock(match.node)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        if present > req.tree_len:  # the tree's own copies replace the freed duplicates
            req.slots[req.tree_len : present] = match.slots[req.tree_len : present]
            self.req_to_token.write(_row(req), req.tree_len, req.slots[req.tree_len : present])
        req.tree_len = length
        req.last_node = match.node

    def truncate(self, req: RequestKV, length: int) -> None:
        """Forget the KV of the request's tokens from ``length`` on (a rejected
        jump-forward draft). Only private slots can go (``length >= tree_len``);
        pages no longer used are freed, and the kept last page's unused slots are
        reused by the next ``extend``."""
        assert req.tree_len <= length <= len(req.slots), (req.tree_len, length, len(req.slots))
        dropped = req.slots[length:]
        if not dropped:
            return
        P = self.page_size
        kept_pages = {s // P for s in req.slots[req.tree_len : length]}
        pages = sorted({s // P for s in dropped} - kept_pages)
        if pages:
            self.allocator.free_pages(pages)
        del req.slots[length:]

    def keep_branch(self, req: RequestKV, base: int, branch: Sequence[int]) -> None:
        """A draft tree was verified: of the tokens from sequence index ``base``
        on, keep those at ``base + branch[d]`` (the accepted branch, top down) as
        indices ``base .. base + len(branch) - 1`` and free the others' slots.
        With one-slot pages the kept slots are not moved: the request's slot list
        (and table row) is rewritten. With larger pages a request's slots must
        follow its pages, so the kept branch's K/V are copied down into the
        first ``len(branch)`` draft slots instead (``copy_slots``; every source is
        read before any is written, so a source that is also a destination is
        read first)."""
        assert req.tree_len <= base, "a draft's slots are private"
        tail = req.slots[base:]
        kept = [tail[a] for a in branch]
        if kept != tail[: len(kept)]:
            if self.page_size == 1:
                taken = set(branch)
                req.slots[base:] = kept + [s for i, s in enumerate(tail) if i not in taken]
                self.req_to_token.write(_row(req), base, kept)
            else:
                assert self.copy_slots is not None, "a tree branch in pages of several slots needs copy_slots"
                moved = [d for d, a in enumerate(branch) if a != d]
                self.copy_slots([tail[branch[d]] for d in moved], [tail[d] for d in moved])
        self.truncate(req, base + len(branch))

    def compact(self, req: RequestKV, kept: Sequence[int], freed: Sequence[int], computed: int) -> None:
        """A request under a KV budget now lists only ``kept``, all private (its
        own slots, or fresh ones from `alloc_private`; the caller has written
        what each column holds), and gives back ``freed``, private slots it no
        longer lists. Tree-owned slots it stops listing stay the tree's (its
        lock holds them). ``computed``: its computed tokens, ``computed -
        len(kept)`` more than it now lists. Needs one-slot pages."""
        assert self.page_size == 1, "a KV budget needs page_size 1"
        assert not req.insert_into_tree, "only a request that never inserts into the tree compacts"
        if freed:
            self.allocator.free_slots(freed)
        req.slots = list(kept)
        req.tree_len = 0
        req.kv_dropped = computed - len(kept)
        if kept:
            self.req_to_token.write(_row(req), 0, req.slots)

    def alloc_private(self, n: int) -> Optional[list[int]]:
        """``n`` free slots (evicting unlocked tree leaves if needed) for the
        caller to hand to a request through `compact`, or None when memory is
        short (nothing is taken then). Needs one-slot pages."""
        assert self.page_size == 1, "private slots one by one need page_size 1"
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc_pages(n)

    def fork(self, parent: RequestKV, child: RequestKV) -> Optional[list[tuple[int, int]]]:
        """Give ``child`` (holding nothing) the KV of ``parent``'s slots, as a beam
        search's new branch: the parent's whole pages go to the tree first
        (`cache_prefix`) and the child shares them under a lock of its own; the
        parent's private rest (a partly filled last page, or everything when the
        cache keeps no prefixes) goes to fresh pages of the child's: copy on
        write. Returns the ``(source, destination)`` slot pairs whose K/V the
        caller must copy before the child's next step, or None when memory or
        a table row is short (nothing changes then)."""
        assert not child.slots and child.last_node is None and child.row is None
        self.cache_prefix(parent)
        P = self.page_size
        tail = parent.slots[parent.tree_len :]
        pages_needed = -(-len(tail) // P)
        if not self.req_to_token.num_free_rows:
            return None
        if pages_needed > self.allocator.num_free_pages:
            self.tree.evict((pages_needed - self.allocator.num_free_pages) * P)
        pages = self.allocator.alloc_pages(pages_needed) if pages_needed else []
        if pages is None:
            return None
        copies = self.allocator.pages_to_slots(pages)[: len(tail)]
        if parent.last_node is not None:
            self.tree.lock(parent.last_node)
        child.last_node = parent.last_node
        child.tree_len = parent.tree_len
        child.slots = parent.slots[: parent.tree_len] + copies
        child.row = self.req_to_token.alloc_row()
        self.req_to_token.write(child.row, 0, child.slots)
        return list(zip(tail, copies))

    def release(self, req: RequestKV, swap: bool = False, keep_prefix: bool = True) -> None:
        """A request stops running (finished, aborted or retracted): its computed
        prefix goes to the tree (unless not ``keep_prefix``: a dropped beam), its
        lock is dropped, its private pages are freed. ``swap`` (a retraction,
        with a host tier): the part of its KV no other request shares moves to
        the host now, freeing its device slots, and is loaded back when it is
        admitted again."""
        if keep_prefix:
            self.cache_prefix(req)
        node = req.last_node
        private = req.slots[req.tree_len :]
        if private:
            P = self.page_size
            pages = sorted({s // P for s in private})
            self.allocator.free_pages(pages)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.slots = []
        req.tree_len = 0
        req.kv_dropped = 0
        req.last_node = None
        if req.row is not None:
            self.req_to_token.free_row(req.row)
            req.row = None
        if swap and node is not None and node.key:
            moved = self.tree.offload(node)
            if moved:
                self.swapped_out_requests += 1
                self.swapped_out_tokens += moved

    # -- accounting ----------------------------------------------------------------
    def private_pages(self, running: Iterable[RequestKV]) -> int:
        P = self.page_size
        return sum(-(-(len(r.slots) - r.tree_len) // P) for r in running)

    def usage(self, running: Iterable[RequestKV]) -> dict[str, int]:
        P = self.page_size
        return {
            "total_slots": self.allocator.num_pages * P,
            "free_slots": self.allocator.num_free_slots,
            "tree_slots": self.tree.total_size(),
            "evictable_slots": self.tree.evictable_size(),  # of tree_slots: cache no request holds
            "private_slots": self.private_pages(running) * P,
        }

    def host_usage(self) -> Optional[dict[str, int]]:
        """Host tier slots (free + tree + reading == total), or None without a host tier."""
        return self.tree.lower_tiers().get("host")

    def check_invariant(self, running: Iterable[RequestKV]) -> None:
        u = self.usage(running)
        total = u["free_slots"] + u["tree_slots"] + u["private_slots"]
        assert total == u["total_slots"], f"KV slots leaked or double-owned: {u}"
        h = self.host_usage()
        if h is not None:
            used = h["free_slots"] + h["tree_slots"] + h.get("reading_slots", 0)
            assert used == h["total_slots"], f"host KV slots leaked: {h}"


def _row(req: RequestKV) -> int:
    """The request's row of the request-to-slot table (an admitted request has one)."""
    assert req.row is not None, "an admitted request holds a table row"
    return req.row
