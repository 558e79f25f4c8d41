"""SGLang's sessions: ``/open_session``, ``/close_session`` and ``session_params`` on ``/generate``.

A session remembers its finished turns, so that a turn sends only its new tokens: its prompt is
an earlier turn's tokens (prompt and output) followed by them. The radix cache already holds
those earlier tokens' KV, so a turn computes only what is new (``cached_tokens`` says so); the
session only spares the client resending them. SGLang's two kinds:

* **streaming** (``"streaming": true``): one line of turns. Each turn continues the last one that
  finished (``rid`` is ignored); one turn at a time; a turn that fails or is aborted is forgotten,
  so the next continues the last good one. ``offset``, ``replace`` and ``drop_previous_output``
  are refused.
* **tree** (the default): each finished turn is a node named by its request id
  (``meta_info.id``). ``session_params.rid`` names the node to continue (none: a new root), which
  must have finished; ``drop_previous_output`` continues from its prompt only; a nonzero
  ``offset`` cuts that context as SGLang slices it (``context[:offset]``: a negative one counts
  from the end, 0 or one past the end keeps it all); ``replace`` first forgets the node's children
  (without ``rid``: every node). A turn still running when its parent was forgotten, or when its
  session was closed, is served and not remembered.

A continuing turn drops a leading BOS from its new tokens (the context has one). Bounds: at most
`MAX_SESSIONS` sessions open (when full, one idle for `IDLE_EVICT_S` is closed to make room), at
most `MAX_TURNS` turns remembered per session (a streaming one keeps its last only; a full tree
session keeps a new turn whole, needing no ancestor, and forgets its oldest turn that no other
continues: a long conversation goes on) and `MAX_STORED_TOKENS` tokens over all sessions (a tree
turn keeps only what it added to the turn it continues: its new tokens and its output; a streaming
session its last turn whole): a turn past the tokens is served but not
remembered (continuing it is then a 400 that says so); a session with a ``timeout`` closes after
that many idle seconds, counted from its last turn's end (never while a turn runs). A turn is
remembered once under its id (a turn named like one the session holds is not: ids cannot make a
turn its own ancestor). Whoever knows a session's id may use it: ids the server makes are random
(unguessable), one a client chooses is as secret as the client keeps it.
Every method is thread-safe. A front (the server's ``/generate``, `Engine.generate`) runs a turn
with `start_turn` before it submits the request and `end_turn` as the group's ``on_done``.
"""

from __future__ import annotations

import threading
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from radixrt.requests.errors import RequestError
from radixrt.requests.finish import LENGTH, STOP
from radixrt.requests.intake import RequestSpec
from radixrt.requests.router import ReqGroup
from radixrt.requests.token_id_lists import is_int

MAX_SESSIONS = 256
MAX_TURNS = 32
MAX_STORED_TOKENS = 1 << 23  # 32 MB of int32 token ids over all sessions
IDLE_EVICT_S = 600.0
MAX_SESSION_ID_CHARS = 128


@dataclass
class Turn:
    """A finished turn, kept as what it added: its prompt is the first ``shared`` tokens of its
    parent's context (the parent's prompt, and its output unless ``drop``) followed by ``new``
    (`SessionStore._prompt` puts it back together); then its output."""

    shared: int
    new: array
    output: array
    parent: Optional[str]
    drop: bool = False


@dataclass
class Session:
    streaming: bool
    timeout: Optional[float]
    last_active: float = field(default_factory=time.monotonic)
    turns: dict[str, Turn] = field(default_factory=dict)  # by request id; streaming: the last one only
    last: Optional[str] = None  # streaming: the turn the next continues
    in_flight: int = 0  # turns begun and not finished (either kind): the session is not idle

    def expired(self, now: float) -> bool:
        """Idle (no turn in flight) for longer than its timeout, counted from its last turn's end."""
        return self.timeout is not None and not self.in_flight and now - self.last_active > self.timeout


@dataclass(frozen=True)
class SessionTurn:
    """A turn being served: its session (``session``: the one open when it began, not one opened
    later under the same id), the prompt to run, the turn it continues (the first ``shared``
    tokens of the prompt are that turn's context, its output left out with ``drop``)."""

    session_id: str
    session: Session
    prompt: list[int]
    parent: Optional[str]
    shared: int = 0
    drop: bool = False


def _error(message: str, field_name: str = "session_params") -> RequestError:
    return RequestError(message, field_name)


class SessionStore:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._stored = 0  # tokens the remembered turns hold, over all sessions
        self._lock = threading.Lock()

    def open(self, session_id: Any = None, streaming: Any = False, timeout: Any = None) -> str:
        """A new session's id (``session_id`` when given and not open). RequestError on bad input."""
        if session_id is not None and (not isinstance(session_id, str) or not 0 < len(session_id) <= 128):
            raise _error(f"'session_id' must be a string of 1 to {MAX_SESSION_ID_CHARS} characters.", "session_id")
        if not isinstance(streaming, bool):
            raise _error("'streaming' must be a boolean.", "streaming")
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if timeout is not None and not (number and 0 < timeout < float("inf")):
            raise _error("'timeout' must be a positive, finite number of seconds.", "timeout")
        with self._lock:
            self._reap()
            if len(self._sessions) >= MAX_SESSIONS and not self._evict_idle():
                raise _error(
                    f"{MAX_SESSIONS} sessions are open, none idle for {IDLE_EVICT_S:.0f} s (the oldest idle one "
                    "is closed then); close one, or open it later.",
                    "session_id",
                )
            sid = session_id or uuid.uuid4().hex
            if sid in self._sessions:
                raise _error(f"a session {sid!r} is already open.", "session_id")
            self._sessions[sid] = Session(streaming, None if timeout is None else float(timeout))
            return sid

    def close(self, session_id: Any) -> None:
        with self._lock:
            if not isinstance(session_id, str) or session_id not in self._sessions:
                raise _error(f"no open session {str(session_id)[:128]!r}.", "session_id")
            self._close(session_id)

    def begin(self, params: Any, new_ids: list[int], bos: Optional[int]) -> SessionTurn:
        """The prompt of a turn of ``params["id"]`` that sends ``new_ids``; RequestError naming
        ``session_params`` when the session or its turn cannot take it."""
        if not isinstance(params, dict) or not isinstance(params.get("id"), str):
            raise _error("'session_params' must be an object with the session's 'id'.")
        sid, rid = params["id"], params.get("rid")
        offset, replace, drop = params.get("offset"), params.get("replace"), params.get("drop_previous_output")
        if rid is not None and not isinstance(rid, str) or offset is not None and not is_int(offset):
            raise _error("'session_params.rid' must be a string and 'offset' an integer.")
        if any(flag is not None and not isinstance(flag, bool) for flag in (replace, drop)):
            raise _error("'session_params.replace' and 'drop_previous_output' must be booleans.")
        with self._lock:
            self._reap()
            session = self._sessions.get(sid)
            if session is None:
                raise _error(f"no open session {sid[:128]!r} (closed, timed out, or never opened).")
            session.last_active = time.monotonic()
            if session.streaming:
                if replace or drop or offset:
                    raise _error("a streaming session takes neither 'replace', 'offset' nor 'drop_previous_output'.")
                if session.in_flight:
                    raise _error("this streaming session already has a turn running.")
                parent = session.last
            else:
                parent = self._tree_parent(session, rid, bool(replace))
            context: list[int] = []
            if parent is not None:
                context = self._prompt(session, parent)
                if not drop:
                    context += session.turns[parent].output
                if offset:  # SGLang's: 0 keeps the context, and it slices as Python does
                    context = context[:offset]
                if new_ids and bos is not None and new_ids[0] == bos:
                    new_ids = new_ids[1:]
            prompt = context + list(new_ids)
            if not prompt:
                raise _error("a session turn must hold some tokens.")
            session.in_flight += 1
            return SessionTurn(sid, session, prompt, parent, len(context), bool(drop))

    @staticmethod
    def _prompt(session: Session, rid: str) -> list[int]:
        """Turn ``rid``'s whole prompt, from the root of its line of turns down (every turn's
        parent is remembered while the turn is)."""
        line = []
        turn: Optional[Turn] = session.turns[rid]
        while turn is not None:
            line.append(turn)
            turn = session.turns[turn.parent] if turn.parent is not None else None
        prompt: list[int] = []
        parent_output: Sequence[int] = ()
        for turn in reversed(line):
            context = prompt if turn.drop else prompt + list(parent_output)
            prompt = context[: turn.shared] + list(turn.new)
            parent_output = turn.output
        return prompt

    def _tree_parent(self, session: Session, rid: Optional[str], replace: bool) -> Optional[str]:
        if rid is not None and rid not in session.turns:
            raise _error(
                f"this session has no finished turn {rid[:128]!r} to continue (or it is not remembered: a "
                f"session keeps its latest {MAX_TURNS} turns, all sessions {MAX_STORED_TOKENS} tokens)."
            )
        if replace:
            if rid is None:
                for old in list(session.turns):
                    self._drop(session, old)
            else:
                self._forget_children(session, rid)
        return rid

    def _forget_children(self, session: Session, rid: str) -> None:
        """Forget every turn below ``rid`` (iteratively: a long line of turns is no deep recursion)."""
        below, frontier = set(), [rid]
        while frontier:
            parent = frontier.pop()
            children = [r for r, t in session.turns.items() if t.parent == parent and r not in below and r != rid]
            below.update(children)
            frontier += children
        for r in below:
            self._drop(session, r)

    def _drop(self, session: Session, rid: str) -> None:
        turn = session.turns.pop(rid)
        self._stored -= len(turn.new) + len(turn.output)

    def finish(self, turn: SessionTurn, rid: str, output_ids: list[int], ok: bool) -> None:
        """Remember a served turn (``ok``: it finished, not failed or aborted)."""
        with self._lock:
            session = self._sessions.get(turn.session_id)
            if session is not turn.session:  # closed meanwhile (and maybe another opened under its id)
                return
            session.in_flight = max(0, session.in_flight - 1)
            session.last_active = time.monotonic()  # idle from now
            if not ok:
                return  # a streaming session continues from its last good turn
            shared, parent, drop = turn.shared, turn.parent, turn.drop
            if session.streaming:  # a line of turns: only the newest is continued, kept whole
                for old in list(session.turns):
                    self._drop(session, old)
                session.last = None
                shared, parent, drop = 0, None, False
            new = turn.prompt[shared:]
            size = len(new) + len(output_ids)
            if parent is not None and parent not in session.turns:
                return  # its parent was replaced while it ran: a turn nothing leads to
            if rid in session.turns:
                return  # served, not remembered (a duplicate id would tie turns into loops)
            full = len(session.turns) >= MAX_TURNS
            if full:  # kept whole (it needs no ancestor), and the oldest turn nothing continues goes
                new, shared, parent, drop = turn.prompt, 0, None, False
                size = len(new) + len(output_ids)
            if self._stored + size > MAX_STORED_TOKENS:
                return
            if full:
                continued = {t.parent for t in session.turns.values()}
                self._drop(session, next(r for r in session.turns if r not in continued))
            session.turns[rid] = Turn(shared, array("i", new), array("i", output_ids), parent, drop)
            self._stored += size
            if session.streaming:
                session.last = rid

    def _reap(self) -> None:
        now = time.monotonic()
        for sid in [s for s, session in self._sessions.items() if session.expired(now)]:
            self._close(sid)

    def _evict_idle(self) -> bool:
        """Close the least recently used session idle for `IDLE_EVICT_S`, if any (the store is full)."""
        now = time.monotonic()
        idle = [(s.last_active, sid) for sid, s in self._sessions.items() if not s.in_flight]
        if not idle or now - min(idle)[0] < IDLE_EVICT_S:
            return False
        self._close(min(idle)[1])
        return True

    def _close(self, sid: str) -> None:
        session = self._sessions.pop(sid)
        self._stored -= sum(len(t.new) + len(t.output) for t in session.turns.values())


def start_turn(store: SessionStore, params: Any, specs: list[RequestSpec], bos: Optional[int]) -> Optional[SessionTurn]:
    """The session turn of a call with ``session_params`` ``params`` (its one spec's prompt becomes
    the turn's whole prompt), or None without; RequestError where the session cannot take it. The
    caller ends the turn (`end_turn`) however the call goes on, refused included."""
    if params is None:
        return None
    if len(specs) != 1 or specs[0].sampling.n != 1 or specs[0].sampling.beam_width > 1:
        raise _error("'session_params' takes one prompt, with n = 1 and no beam search.")
    turn = store.begin(params, specs[0].input_ids, bos)
    specs[0].input_ids = turn.prompt
    return turn


def end_turn(store: SessionStore, turn: Optional[SessionTurn], group: Optional[ReqGroup]) -> None:
    """Remember a turn whose request finished (a failed, aborted or refused one, ``group`` None
    where it was never submitted: forgotten)."""
    if turn is None:
        return
    if group is None:
        store.finish(turn, "", [], ok=False)
        return
    st = group.states[0]
    fr = st.acc.finish_reason
    ok = st.error is None and fr is not None and fr.type in (STOP, LENGTH)
    store.finish(turn, st.acc.rid, list(st.acc.output_ids), ok)
