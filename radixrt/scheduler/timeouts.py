"""Requests that waited or ran too long end with a 503, as SGLang's ``SGLANG_REQ_WAITING_TIMEOUT``
and ``SGLANG_REQ_RUNNING_TIMEOUT`` end them.

``--request-waiting-timeout-s``: a request still waiting that many seconds after it arrived, never
admitted, is aborted ("Request waiting timeout reached."); ``--request-running-timeout-s``: a
running request that many seconds after its first admission is aborted ("Request running timeout
reached."). Unset, each flag takes SGLang's environment variable where set (a value of 0 or less:
no timeout). The scheduler polls them every `POLL_S` seconds at most, so the check costs nothing
on a fast step loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional

from radixrt.config.sections import SchedulingSettings
from radixrt.scheduler.request import Req

WAITING_ENV, RUNNING_ENV = "SGLANG_REQ_WAITING_TIMEOUT", "SGLANG_REQ_RUNNING_TIMEOUT"
WAITING_MESSAGE, RUNNING_MESSAGE = "Request waiting timeout reached.", "Request running timeout reached."
POLL_S = 0.05


def resolved(flag: Optional[float], env: str) -> Optional[float]:
    """The timeout in seconds (None: none) from the flag, else from ``$env``; ValueError on a
    variable that is not a number."""
    value = flag
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = float(raw) if raw else None
        except ValueError:
            raise ValueError(f"${env} must be a number of seconds, got {raw!r}") from None
    return value if value is not None and value > 0 else None


@dataclass
class RequestTimeouts:
    waiting_s: Optional[float]
    running_s: Optional[float]
    _next_poll: float = 0.0

    @classmethod
    def of(cls, scheduling: SchedulingSettings) -> "RequestTimeouts":
        """The timeouts the flags (or SGLang's variables) ask for."""
        return cls(
            resolved(scheduling.request_waiting_timeout_s, WAITING_ENV),
            resolved(scheduling.request_running_timeout_s, RUNNING_ENV),
        )

    def overdue(self, waiting: Iterable[Req], running: Iterable[Req], now: float) -> tuple[list[Req], list[Req]]:
        """(waiting requests past their waiting timeout, running ones past their running timeout);
        empty between polls."""
        if (self.waiting_s is None and self.running_s is None) or now < self._next_poll:
            return [], []
        self._next_poll = now + POLL_S
        late_waiting = late_running = []
        if self.waiting_s is not None:
            deadline = now - self.waiting_s
            late_waiting = [r for r in waiting if not r.admitted_once and r.queued_at < deadline]
        if self.running_s is not None:
            deadline = now - self.running_s
            late_running = [r for r in running if r.started_at is not None and r.started_at < deadline]
        return late_waiting, late_running
