"""The stored responses of ``/v1/responses``: a bounded LRU.

A stored response keeps its response object (what ``GET /v1/responses/{id}``
answers), its conversation as Responses items, input and output (what a
request with ``previous_response_id`` continues), and its own input items as
``GET /v1/responses/{id}/input_items`` lists them. Both are kept as JSON
bytes, so the size of an entry is known and nothing outside can change it.

Bounds: at most ``capacity`` entries and ``max_bytes`` in all; the least
recently used entries (stored, read or continued) go first. An entry larger
than ``max_bytes`` alone is not stored. Ids are random (128 bits): a stored
response is visible to whoever holds its id (and the server's API key, when
it has one).

Used from the event loop only, so it takes no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.server.http_utils import dumps


@dataclass(frozen=True)
class StoredResponse:
    body: bytes  # the response object, JSON
    items: bytes  # the conversation (input items then output items), JSON
    inputs: bytes = b"[]"  # this request's input items as listed (responses_items.listed_inputs), JSON

    @property
    def size(self) -> int:
        return len(self.body) + len(self.items) + len(self.inputs)

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation's items (a fresh list each call)."""
        return json.loads(self.items)

    def input_items(self) -> list[dict[str, Any]]:
        """The request's own input items, as listed (a fresh list each call)."""
        return json.loads(self.inputs)


class ResponseStore:
    """id -> StoredResponse, least recently used out beyond ``capacity`` entries or ``max_bytes``."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        if capacity < 0 or max_bytes < 0:
            raise ValueError("the responses store's capacity and size must be >= 0")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._d: "OrderedDict[str, StoredResponse]" = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._d)

    def put(
        self, rid: str, body: dict[str, Any], items: list[dict[str, Any]], inputs: Optional[list[dict[str, Any]]] = None
    ) -> bool:
        """Store a response; False when it cannot be (no room at all, or larger than the whole store)."""
        entry = StoredResponse(dumps(body), dumps(items), dumps(inputs or []))
        if self.capacity == 0 or entry.size > self.max_bytes:
            return False
        self.delete(rid)
        self._d[rid] = entry
        self.bytes += entry.size
        while len(self._d) > self.capacity or self.bytes > self.max_bytes:
            _, old = self._d.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> Optional[StoredResponse]:
        entry = self._d.get(rid)
        if entry is not None:
            self._d.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._d.pop(rid, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
