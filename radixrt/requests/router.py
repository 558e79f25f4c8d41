"""One result router for both fronts: requests out, results back by request id.

The in-process `Engine` and the server's `TokenizerManager` differ only in how
messages travel (a queue to a scheduler thread; ZMQ sockets to the scheduler
and detokenizer processes). What happens to a request between them is here:

* `ResultRouter.submit`: validated specs -> one `ReqGroup` of per-sample
  `ReqState`s (prompt-major), registered in the front's `RidTable` (a rid
  already running is refused, all or nothing) and sent on by the `Transport`
  under their internal ids (intake's "Request ids");
* `ResultRouter.deliver`: one step's `TokenOutput`s (with the text the
  server's detokenizer made, or none) folded into each sample's
  `ResultAccumulator`; a finished output for a request's internal id that is
  not a sample's (the scheduler refused an ``n > 1`` request before making
  its samples) ends every sample of it;
* `abort_group` / `abort_rid`: stop a caller's requests, or the request of a
  client's rid; `finish_all` / `fail_all`: end everything (the scheduler died);
* a group's ``on_done`` (given to `submit`) runs once, on the group's loop, when its last
  sample is done however it ended (finished, failed, aborted): what a front keeps about a
  call past its answer (a session's turn) is kept there, whoever waits or has left.

Threads and delivery. A group belongs to the event loop that submitted it,
and its states change on that loop only. `deliver` may run on any thread: on
the group's own loop (the server's socket reader) it applies the outputs at
once; from elsewhere (the Engine's scheduler thread) it appends them to that
loop's `_Mailbox` and wakes the loop at most once per batch of outputs, not
once per output: a loop still draining earlier outputs is not woken again.
The tables (states, requests, rids) are guarded by one lock, never held while
the transport sends or while outputs are applied, so a transport may deliver
from inside a send (a test's in-process pipeline does).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import AsyncIterator, Callable, Iterable, Mapping, Optional, Protocol, Sequence

from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import RequestSpec
from radixrt.requests.messages import TokenOutput
from radixrt.requests.results import ResultAccumulator
from radixrt.requests.rids import RidEntry, RidTable

__all__ = ["ReqGroup", "ReqState", "ResultObserver", "ResultRouter", "Transport"]

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """How a front reaches its scheduler."""

    def send_request(self, spec: RequestSpec, entry: RidEntry) -> None:
        """Send ``spec`` on under ``entry``'s internal ids."""

    def send_abort(self, iids: Sequence[str]) -> None:
        """Abort the requests or samples of internal ids ``iids`` ("" aborts every request), in one message."""


class ResultObserver:
    """Hears of sent requests (on the submitting loop), outputs and finished samples (on the group's
    loop): the server's metrics, the request log. Each hook does nothing unless overridden; none raises."""

    def on_submit(self, spec: RequestSpec, entry: RidEntry) -> None:
        """``spec`` was sent under ``entry``'s ids."""

    def on_output(self, st: "ReqState", out: TokenOutput, now: float) -> None:
        """``st`` took output ``out`` (not its first update if it was refused)."""

    def on_finish(self, st: "ReqState", now: float, inflight: int) -> None:
        """``st`` finished, failed or was aborted; ``inflight`` samples are left."""


class _Mailbox:
    """The updates waiting for one event loop, and whether a wake-up is on its way."""

    __slots__ = ("_loop", "updates", "armed", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # weakly: the mailbox is the value of a map keyed weakly by its loop, which a strong
        # reference here would keep alive forever (one per `asyncio.run` that ever submitted)
        self._loop = weakref.ref(loop)
        self.updates: list[_Update] = []
        self.armed = False

    @property
    def loop(self) -> Optional[asyncio.AbstractEventLoop]:
        """The mailbox's loop; None once it was collected (its callers are gone)."""
        return self._loop()


class ReqState:
    """One sample being generated (a sub-request when n > 1); ``rid`` and
    ``parent`` are internal ids (the client's rid is ``acc.rid``)."""

    __slots__ = (
        "rid",
        "parent",
        "acc",
        "group",
        "input_ids",
        "error",
        "version",
        "sent_version",
        "sent_logprobs",
        "sent_text",
        "sent_ids",
        "t_start",
        "t_first",
        "t_last",
        "done",
        "log_metrics",
    )

    def __init__(self, rid: str, parent: str, acc: ResultAccumulator, group: "ReqGroup", input_ids: list[int]) -> None:
        self.rid = rid
        self.parent = parent
        self.acc = acc
        self.group = group
        self.input_ids = input_ids
        self.error: Optional[str] = None  # a failure of the runtime itself (a child process died)
        self.version = 0  # bumped on every update
        self.sent_version = 0  # what the stream consumer has seen
        self.sent_logprobs = 0  # output logprobs already streamed
        self.sent_text = 0  # characters of text already streamed (OpenAI deltas)
        self.sent_ids = 0  # output ids already streamed (OpenAI's return_token_ids)
        self.t_start = time.perf_counter()
        self.t_first: Optional[float] = None
        self.t_last: Optional[float] = None
        self.done = False  # finished, failed or aborted: no more updates
        self.log_metrics = True  # counted in the metrics (the spec's log_metrics)

    @property
    def has_news(self) -> bool:
        return self.version != self.sent_version


class ReqGroup:
    """The samples of one call (an HTTP request, an `Engine.generate`), in
    answer order (prompt-major), and the event that wakes its reader."""

    def __init__(self, mailbox: _Mailbox, on_done: Optional[Callable[["ReqGroup"], None]] = None) -> None:
        self.states: list[ReqState] = []
        self.parents: list[str] = []  # the requests' internal ids
        self.rids: list[str] = []  # and their clients' rids (given or assigned), in order
        self.event = asyncio.Event()
        self.mailbox = mailbox
        self.on_done = on_done  # run once by `settle`

    def settle(self) -> None:
        """Run ``on_done`` once every sample is done (its faults are logged, not raised: the
        router's caller is whoever delivered the outputs)."""
        if self.on_done is None or not self.done:
            return
        hook, self.on_done = self.on_done, None
        try:
            hook(self)
        except Exception:
            logger.exception("a request group's on_done hook failed")

    @property
    def done(self) -> bool:
        return all(s.done for s in self.states)

    async def wait(self) -> None:
        while not self.done:
            await self.event.wait()
            self.event.clear()

    async def updates(self) -> AsyncIterator[list[ReqState]]:
        """Yield the states with news (each time at least one), until all are done."""
        while True:
            news = [s for s in self.states if s.has_news]
            if news:
                # Marked seen before the consumer runs: it must read the states
                # it is given before its next await.
                for s in news:
                    s.sent_version = s.version
                yield news
                continue
            if self.done:
                return
            await self.event.wait()
            self.event.clear()


# (state, output or None for a failure, the detokenized text or the failure's reason)
_Update = tuple[ReqState, Optional[TokenOutput], Optional[str]]


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ResultRouter:
    """Routes one front's requests out and their results back (see the module docstring)."""

    def __init__(self, tokenizer: object, transport: Transport, observers: Sequence[ResultObserver] = ()) -> None:
        self.tokenizer = tokenizer
        self.transport = transport
        self.observers = tuple(observers)
        self._lock = threading.Lock()
        self._states: dict[str, ReqState] = {}  # the live samples, by internal id
        self._requests: dict[str, list[ReqState]] = {}  # the live requests' samples, by internal id
        self._rids = RidTable()  # the clients' rids of the live requests
        self._mailboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]" = weakref.WeakKeyDictionary()

    @property
    def states(self) -> Mapping[str, ReqState]:
        """The live samples by internal id (read-only)."""
        return self._states

    @property
    def inflight(self) -> int:
        return len(self._states)

    # ------------------------------------------------------------------ out
    def submit(
        self,
        specs: Sequence[RequestSpec],
        live_text: bool = True,
        on_done: Optional[Callable[[ReqGroup], None]] = None,
    ) -> ReqGroup:
        """Register ``specs`` (validated) as one group of the running loop and send
        them; nothing is sent if one's rid is running (RequestError, param 'rid').
        ``live_text`` False: the accumulators make text only when a sample
        finishes (nobody reads it before; the text is the same). ``on_done``: the
        group's hook (`ReqGroup.settle`), not run if this raises."""
        loop = asyncio.get_running_loop()
        with self._lock:
            box = self._mailboxes.get(loop)
            if box is None:
                box = self._mailboxes[loop] = _Mailbox(loop)
            group = ReqGroup(box, on_done)
            entries = self._rids.add([spec.rid for spec in specs], [spec.sampling.n for spec in specs])
            for spec, entry in zip(specs, entries):
                spec.group = entries[0].iid  # one call: the scheduler's queue takes turns between calls
                self._register(group, spec, entry, live_text)
        for spec, entry in zip(specs, entries):
            self.transport.send_request(spec, entry)
            for observer in self.observers:
                observer.on_submit(spec, entry)
        return group

    def _register(self, group: ReqGroup, spec: RequestSpec, entry: RidEntry, live_text: bool) -> None:
        samples = []
        for iid, rid in zip(entry.sample_iids, entry.sample_rids):
            acc = ResultAccumulator(
                rid,
                self.tokenizer,
                spec.sampling,
                spec.return_logprob,
                spec.return_text_in_logprobs,
                live_text=live_text,
                token_ids_logprob=bool(spec.token_ids_logprob),
                prompt_ids=spec.input_ids,
                return_prompt_token_ids=spec.return_prompt_token_ids,
            )
            st = ReqState(iid, entry.iid, acc, group, spec.input_ids)
            st.log_metrics = spec.log_metrics
            self._states[iid] = st
            samples.append(st)
        group.states.extend(samples)
        group.parents.append(entry.iid)
        group.rids.append(entry.rid)
        self._requests[entry.iid] = samples

    # ------------------------------------------------------------------ back
    def deliver(self, outputs: Sequence[TokenOutput], texts: Optional[Sequence[str]] = None) -> None:
        """Route one batch of outputs (``texts[i]``: the cumulative text of
        ``outputs[i]`` when detokenized elsewhere); any thread. Outputs of ids
        no longer live are dropped."""
        by_box: dict[_Mailbox, list[_Update]] = {}
        with self._lock:
            for i, out in enumerate(outputs):
                st = self._states.get(out.rid)
                text = None if texts is None else texts[i]
                if st is not None:
                    updates = by_box.get(st.group.mailbox)
                    if updates is None:
                        updates = by_box[st.group.mailbox] = []
                    updates.append((st, out, text))
                elif out.finished and out.rid in self._requests:  # refused before its samples were made
                    for sub in self._requests[out.rid]:
                        by_box.setdefault(sub.group.mailbox, []).append((sub, out, text))
        self._dispatch(by_box)

    def _dispatch(self, by_box: dict[_Mailbox, list[_Update]]) -> None:
        """Apply the updates of the running loop now; post the others, waking each loop at most once."""
        current = _running_loop()
        wake = []
        here = [box for box in by_box if current is not None and box.loop is current]
        with self._lock:
            for box, updates in by_box.items():
                if box in here:
                    continue
                box.updates.extend(updates)
                if not box.armed:
                    box.armed = True
                    wake.append(box)
        for box in wake:
            loop = box.loop
            try:
                if loop is None:
                    raise RuntimeError("collected")
                loop.call_soon_threadsafe(self._drain, box)
            except RuntimeError:  # that loop is closed (or gone): its callers are gone
                self._drop_loop(box)
        for box in here:
            self._apply(by_box[box])

    def _drop_loop(self, box: _Mailbox) -> None:
        """Forget the live samples of a closed loop (nobody can read them) and abort their requests."""
        with self._lock:
            box.updates.clear()
            dead = [st for st in self._states.values() if st.group.mailbox is box]
        if dead:
            self.transport.send_abort(list(dict.fromkeys(st.parent for st in dead)))
        for st in dead:
            st.done = True
        if dead:
            self._forget(dead, time.perf_counter())
        for group in {id(st.group): st.group for st in dead}.values():
            group.settle()

    def _drain(self, box: _Mailbox) -> None:
        with self._lock:
            updates, box.updates = box.updates, []
            box.armed = False
        self._apply(updates)

    def _apply(self, updates: Iterable[_Update]) -> None:
        """Fold updates into their states (on the states' loop) and wake their groups."""
        now = time.perf_counter()
        observers = self.observers
        finished: list[ReqState] = []
        ended: list[ReqGroup] = []
        for st, out, text in updates:
            if st.done:  # aborted or failed meanwhile
                continue
            if out is None:
                st.error = text
                st.done = True
            elif not self._add(st, out, text):  # a fault in one output fails its request alone
                finished.append(st)
            else:
                for observer in observers:
                    observer.on_output(st, out, now)
                if out.finish_reason is not None:
                    st.done = True
                    finished.append(st)
            st.version += 1
            st.group.event.set()
            if st.done:
                ended.append(st.group)
        if finished:
            self._forget(finished, now)
        for group in ended:
            group.settle()

    @staticmethod
    def _add(st: ReqState, out: TokenOutput, text: Optional[str]) -> bool:
        """Fold ``out`` into ``st``; False (``st`` failed, done) where that raised: a bug met by one
        request's output must not drop the other requests' outputs of the same batch."""
        try:
            st.acc.add(out, text)
            if out.input_token_logprobs is not None:  # n > 1: the first sample computed them for all
                for sib in st.group.states:
                    if sib.parent == st.parent and sib is not st and sib.acc.return_logprob:
                        sib.acc.take_input_logprobs(out)
                        sib.version += 1
            return True
        except Exception as e:  # contained to this request, and logged
            logger.exception("request %s: its output could not be read", st.rid)
            st.error, st.done = f"internal error reading its output: {type(e).__name__}", True
            return False

    def _forget(self, finished: list[ReqState], now: float) -> None:
        """Drop finished samples from the tables, and their requests once all their samples are done."""
        with self._lock:
            for st in finished:
                self._states.pop(st.rid, None)
                samples = self._requests.get(st.parent)
                if samples is not None and all(s.done for s in samples):
                    del self._requests[st.parent]
                    self._rids.remove(st.parent)
            inflight = len(self._states)
        for observer in self.observers:
            for st in finished:
                observer.on_finish(st, now, inflight)

    # ------------------------------------------------------------------ aborts and failures
    def abort_group(self, group: ReqGroup, reason: str) -> None:
        """Stop every unfinished sample of ``group`` (on its loop): the scheduler
        frees their KV, and they end now with an abort finish reason."""
        with self._lock:
            live = [p for p in group.parents if p in self._requests]
        if live:
            self.transport.send_abort(live)
        finished = []
        for st in group.states:
            if not st.done:
                st.acc.finish_reason = FinishReason.abort(reason)
                st.version += 1
                st.done = True
                finished.append(st)
        if finished:
            self._forget(finished, time.perf_counter())
        group.event.set()
        group.settle()

    def abort_rid(self, rid: str) -> None:
        """Abort the request of the client's rid ``rid`` with its samples, or
        the one sample of that rid ("" aborts every request). Rids match
        exactly; an unknown one is ignored. The samples end when the
        scheduler's abort outputs arrive. TypeError for a rid that is not a string: a
        missing one (None) must not abort everyone's requests."""
        if not isinstance(rid, str):
            raise TypeError(f"rid must be a string ('' aborts every request), got {type(rid).__name__}")
        if not rid:
            self.transport.send_abort([""])
            return
        with self._lock:
            iids = self._rids.resolve(rid)
        if iids:
            self.transport.send_abort(list(iids))

    def finish_all(self, reason: FinishReason) -> None:
        """End every live sample with ``reason`` as if the scheduler had sent it."""
        with self._lock:
            outs = [TokenOutput(iid, [], 0, 0, 0, reason) for iid in self._states]
        self.deliver(outs)

    def fail_all(self, reason: str) -> None:
        """End every live sample with the error ``reason`` and forget them all
        (the runtime behind the transport is gone)."""
        by_box: dict[_Mailbox, list[_Update]] = {}
        with self._lock:
            for st in self._states.values():
                by_box.setdefault(st.group.mailbox, []).append((st, None, reason))
            self._states.clear()
            self._requests.clear()
            self._rids.clear()
        self._dispatch(by_box)
