"""Time limits on reading a request, so that slow clients ("slowloris": a
header line a second, a body byte a second) cannot hold connections open
without limit. Used by `radixrt serve` and `radixrt router`.

uvicorn bounds neither: ``timeout_keep_alive`` covers only the idle time
after a response (any byte received cancels it, and a fresh connection has
none), and h11 bounds the head's size, not its duration. `timed_h11_protocol`
gives uvicorn's h11 protocol two deadlines per request:

* the head (request line and headers) must be complete within
  ``header_timeout_s`` of its first byte; on a fresh connection, of the
  connection's opening (a connection that never sends anything is closed
  then as well);
* the body must be complete within ``body_timeout_s`` of the head's end.

Past a deadline the connection is closed. A 408 (JSON, ``connection:
close``) goes out first when the client had begun a request and no answer to
it had started. A timeout of 0 means no limit. The app sees a body timeout as
a client that left (``http.disconnect``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


def request_timeout_response(message: str) -> bytes:
    """A complete HTTP/1.1 408 answer with an OpenAI-shaped JSON error body."""
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 408}}
    ).encode()
    head = (
        f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head and body deadlines of this module
    (class attributes; `timed_h11_protocol` makes a subclass with others)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._phase = ""  # what the armed deadline waits for: "head", "body" or "" (none armed)
        self._began = False  # bytes of the request being waited for have arrived

    # -- asyncio.Protocol --------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head", began=False)

    def data_received(self, data: bytes) -> None:
        if not self._phase and self.conn.their_state is h11.IDLE:
            self._arm("head", began=True)  # the next request on a kept-alive connection
        elif data:
            self._began = True
        super().data_received(data)
        self._follow()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()  # a pipelined request may have been read here

    # -- deadlines -----------------------------------------------------------------
    def _arm(self, phase: str, began: bool) -> None:
        self._disarm()
        timeout = self.header_timeout_s if phase == "head" else self.body_timeout_s
        self._began = began
        if timeout > 0:
            self._phase = phase
            self._deadline = self.loop.call_later(timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = ""

    def _follow(self) -> None:
        """Move the deadline along with the client's side of the exchange."""
        state = self.conn.their_state
        if self._phase == "head" and state is not h11.IDLE:
            self._disarm()  # the head is complete (or the connection failed)
            if state is h11.SEND_BODY:
                self._arm("body", began=True)
        elif self._phase == "body" and state is not h11.SEND_BODY:
            self._disarm()
        elif not self._phase and state is h11.SEND_BODY:
            self._arm("body", began=True)

    def _expired(self) -> None:
        phase, began = self._phase, self._began
        self._deadline, self._phase = None, ""
        if self.transport.is_closing():
            return
        timeout = self.header_timeout_s if phase == "head" else self.body_timeout_s
        what = "request headers" if phase == "head" else "request body"
        answered = phase == "body" and self.cycle is not None and self.cycle.response_started
        if began and not answered:
            self.transport.write(
                request_timeout_response(f"The {what} did not arrive within {timeout:g} s; the connection is closed.")
            )
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.info("closing the connection of %s: its %s took longer than %g s", client, what, timeout)
        self.transport.close()


def timed_h11_protocol(
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
) -> type[TimedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these deadlines
    (seconds; 0: no limit)."""
    if header_timeout_s < 0 or body_timeout_s < 0:
        raise ValueError("request read timeouts must be >= 0 (0: no limit)")
    return type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s)},
    )


HEADER_TIMEOUT_HELP = (
    "a request's line and headers must arrive within this many seconds of their first byte (of "
    "the connection's opening, for its first request), else a 408 and the connection is closed "
    "(0: no limit)"
)
BODY_TIMEOUT_HELP = (
    "a request's body must arrive within this many seconds of its headers, else a 408 and the "
    "connection is closed (0: no limit)"
)


def add_read_timeout_args(parser: Any) -> None:
    """``--header-read-timeout-s`` and ``--body-read-timeout-s`` of `radixrt router` (`radixrt serve`
    has them as `ServerArgs` fields, with the same defaults and help)."""
    parser.add_argument(
        "--header-read-timeout-s",
        dest="header_read_timeout_s",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help=HEADER_TIMEOUT_HELP,
    )
    parser.add_argument(
        "--body-read-timeout-s",
        dest="body_read_timeout_s",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help=BODY_TIMEOUT_HELP,
    )
