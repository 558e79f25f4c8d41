"""SGLang's ``--crash-dump-folder``: the requests of the last minutes before a crash, written to a
file so that the one that crashed the server can be found and sent again.

`CrashDump` hears every request the front sends on (`ResultObserver.on_submit`) and how each
sample ended, and keeps those received in the last `WINDOW_S` seconds (at most `MAX_REQUESTS`, and
at most `MAX_TOKENS` token ids in all, 4 bytes each: a flood of long prompts costs a bounded memory).
When a child process of the server dies, `CrashDump.write` puts them in
``<folder>/crash_dump_<UTC time>_<pid>.jsonl``: a first line with the reason and the time, then
one JSON object per request (its client's rid, internal id, when it was received, its prompt's
token ids, the sampling parameters it set, its adapter, and for each sample that ended its finish
reason and output ids; ``in_flight`` marks one that had not ended). A line is ready to replay:
``{"input_ids": ..., "sampling_params": ...}`` on ``/generate``. SGLang writes a pickle; JSON
lines read anywhere and hold no code. The file holds prompts: it is the operator's to keep."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from array import array
from typing import Any, Optional

from radixrt.requests.intake import RequestSpec
from radixrt.requests.request_log import set_sampling_fields
from radixrt.requests.rids import RidEntry
from radixrt.requests.router import ReqState, ResultObserver

logger = logging.getLogger(__name__)

WINDOW_S = 300.0  # SGLang's: the last 5 minutes
MAX_REQUESTS = 10_000
MAX_TOKENS = 16 << 20  # prompt and output token ids kept, 64 MiB of them


@dataclasses.dataclass
class KeptRequest:
    """One request as the dump keeps it (its fields are its line's, with ``in_flight`` added)."""

    rid: str  # the client's
    id: str  # the internal one, which the scheduler's lines name
    received_at: float  # time.time()
    input_ids: array
    sampling_params: dict[str, Any]  # the fields it set
    lora_path: Optional[str]
    n: int  # its samples
    samples: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # the ended ones, by internal id

    @property
    def tokens(self) -> int:
        """Token ids it holds, prompt and outputs."""
        return len(self.input_ids) + sum(len(s["output_ids"]) for s in self.samples.values())


class CrashDump(ResultObserver):
    """Keeps the recent requests (module docstring) for `write`; ``folder`` is made on the first write."""

    def __init__(
        self, folder: str, window_s: float = WINDOW_S, max_requests: int = MAX_REQUESTS, max_tokens: int = MAX_TOKENS
    ) -> None:
        self.folder = folder
        self.window_s = window_s
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._requests: collections.OrderedDict[str, KeptRequest] = collections.OrderedDict()
        self._tokens = 0  # token ids the kept records hold

    def on_submit(self, spec: RequestSpec, entry: RidEntry) -> None:
        now = time.time()
        self._make_room(now, len(spec.input_ids))
        self._tokens += len(spec.input_ids)
        self._requests[entry.iid] = KeptRequest(
            entry.rid,
            entry.iid,
            round(now, 3),
            array("i", spec.input_ids),
            set_sampling_fields(spec.sampling),
            spec.lora,
            entry.n,
        )

    def on_finish(self, st: ReqState, now: float, inflight: int) -> None:
        record = self._requests.get(st.parent)
        if record is None:  # older than the window
            return
        fr = st.acc.finish_reason
        finish = fr.to_dict() if fr is not None else {"type": "error" if st.error else "abort"}
        self._tokens += len(st.acc.output_ids)
        record.samples[st.rid] = {"finish_reason": finish, "output_ids": array("i", st.acc.output_ids)}

    def _make_room(self, now: float, tokens: int) -> None:
        """Drop the oldest records while they are out of the window or a new one of ``tokens`` ids
        would pass a bound."""
        while self._requests and (
            len(self._requests) >= self.max_requests
            or self._tokens + tokens > self.max_tokens
            or next(iter(self._requests.values())).received_at < now - self.window_s
        ):
            self._tokens -= self._requests.popitem(last=False)[1].tokens

    def write(self, reason: str) -> Optional[str]:
        """Write the kept requests (module docstring); the file's path, or None where it could not be written
        (logged: a dump must not stand in the way of the server's exit)."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = os.path.join(self.folder, f"crash_dump_{stamp}_{os.getpid()}.jsonl")
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"reason": reason, "time": time.time(), "requests": len(self._requests)}) + "\n")
                for record in self._requests.values():
                    line = {**dataclasses.asdict(record), "in_flight": len(record.samples) < record.n}
                    f.write(json.dumps(line, default=_plain) + "\n")
        except OSError as e:
            logger.error("could not write the crash dump to %s: %s", path, e)
            return None
        return path


def _plain(value: Any) -> Any:
    """JSON for what `json` does not write itself: token id arrays as lists, anything else as text."""
    return value.tolist() if isinstance(value, array) else str(value)
