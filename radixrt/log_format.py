"""The prefix of every process's log lines: ``[time name] LEVEL logger: message``.

A ``--dp`` replica sets ``RADIXRT_REPLICA`` (its index) before it starts, and every process it
starts inherits it: the lines of replica 1's server, scheduler, detokenizer and tensor-parallel
followers then read ``[time server dp1]``, ``[time scheduler dp1]``... so an operator can tell
which replica wrote a line."""

from __future__ import annotations

import os

REPLICA_ENV = "RADIXRT_REPLICA"


def log_format(name: str) -> str:
    """The logging format of the process called ``name`` (its replica's index added, under ``--dp``)."""
    replica = os.environ.get(REPLICA_ENV)
    label = f"{name} dp{replica}" if replica else name
    return f"[%(asctime)s {label}] %(levelname)s %(name)s: %(message)s"
