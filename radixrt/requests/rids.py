"""Request ids: the internal id (`new_request_id`), the ids of ``n > 1``
samples (`sample_rids`) and the table of a front's running rids (`RidTable`).
See `radixrt.requests.intake` for how rids and internal ids relate."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

from radixrt.requests.errors import RequestError


def sample_rids(rid: str, n: int) -> list[str]:
    """The ids of the ``n`` samples of request ``rid``: ``[rid]`` when n == 1,
    else ``rid-0 .. rid-{n-1}``. Aborting ``rid`` aborts all of them."""
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


def new_request_id() -> str:
    """A fresh random id (uuid4 hex): unguessable, and free of '-'."""
    return uuid.uuid4().hex


class RidAllocator:
    """Callable giving a fresh `new_request_id` on every call."""

    def __call__(self) -> str:
        return new_request_id()


@dataclass
class RidEntry:
    """A running request: its rid (the client's label) and its internal id."""

    rid: str
    iid: str
    n: int

    @property
    def sample_iids(self) -> list[str]:
        return sample_rids(self.iid, self.n)

    @property
    def sample_rids(self) -> list[str]:
        return sample_rids(self.rid, self.n)


class RidTable:
    """The rids of the running requests of one front, and their internal ids.

    Not thread-safe: the Engine calls it under its lock, the server from its
    event loop only."""

    def __init__(self) -> None:
        self._by_rid: dict[str, RidEntry] = {}
        self._by_iid: dict[str, RidEntry] = {}

    def __len__(self) -> int:
        return len(self._by_iid)

    def _sample_of(self, rid: str) -> Optional[tuple[RidEntry, int]]:
        """(request, sample index) when ``rid`` is the rid of a sample of a running request."""
        head, sep, tail = rid.rpartition("-")
        if not sep or not (tail.isascii() and tail.isdigit()) or tail != str(int(tail)):
            return None
        entry = self._by_rid.get(head)
        if entry is None or entry.n == 1 or int(tail) >= entry.n:
            return None
        return entry, int(tail)

    def running(self, rid: str) -> bool:
        """``rid`` names a running request or one of its samples."""
        return rid in self._by_rid or self._sample_of(rid) is not None

    def add(self, rids: Sequence[Optional[str]], ns: Sequence[int]) -> list[RidEntry]:
        """Register one request per item (a rid, or None for a new random
        one; its ``n``), all or none: RequestError (param 'rid') if a given
        rid, or one of its samples' rids, is already running, here or earlier
        in ``rids``: no two running requests or samples share a rid."""
        added: list[RidEntry] = []
        try:
            for rid, n in zip(rids, ns):
                if rid is None:
                    rid = new_request_id()
                    while self.running(rid):  # pragma: no cover - a uuid4 collision
                        rid = new_request_id()
                elif self.running(rid):
                    raise RequestError(f"a request with rid {rid!r} {self._where(rid, added)}", "rid")
                elif (taken := self._sample_rid_taken(rid, n)) is not None:
                    raise RequestError(
                        f"rid {rid!r} with n={n} names its samples {rid}-0 to {rid}-{n - 1}, and a request "
                        f"with rid {taken!r} {self._where(taken, added)}",
                        "rid",
                    )
                entry = RidEntry(rid, new_request_id(), n)
                self._by_rid[rid] = self._by_iid[entry.iid] = entry
                added.append(entry)
        except BaseException:
            for entry in added:
                self.remove(entry.iid)
            raise
        return added

    def _sample_rid_taken(self, rid: str, n: int) -> Optional[str]:
        """The first of request ``rid``'s sample rids that a running request holds (n > 1)."""
        return next((s for s in sample_rids(rid, n) if s in self._by_rid), None) if n > 1 else None

    def _where(self, rid: str, added: list[RidEntry]) -> str:
        """Where the request that holds ``rid`` (or whose sample it is) came from."""
        holder = self._by_rid.get(rid) or (self._sample_of(rid) or (None,))[0]
        return "is earlier in this call" if any(holder is e for e in added) else "is already running"

    def remove(self, iid: str) -> None:
        """Forget the request of internal id ``iid`` (finished or aborted)."""
        entry = self._by_iid.pop(iid, None)
        if entry is not None and self._by_rid.get(entry.rid) is entry:
            del self._by_rid[entry.rid]

    def resolve(self, rid: str) -> list[str]:
        """The internal ids an abort of ``rid`` stops: the request of that rid
        (which the scheduler stops with its samples), or else the one sample
        of that rid; nothing for an unknown rid. Never a prefix match."""
        entry = self._by_rid.get(rid)
        if entry is not None:
            return [entry.iid]
        sample = self._sample_of(rid)
        if sample is not None:
            return [sample[0].sample_iids[sample[1]]]
        return []

    def clear(self) -> None:
        self._by_rid.clear()
        self._by_iid.clear()
