"""SGLang's ``--uvicorn-access-log-exclude-prefixes``: the access-log lines of chosen paths left out
(health probes and metrics scrapes, which would otherwise fill the log)."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

ACCESS_LOGGER = "uvicorn.access"


class ExcludedPaths(logging.Filter):
    """Drops uvicorn access-log records whose request path (its query included) starts with one of
    ``prefixes``; every other record passes."""

    def __init__(self, prefixes: Sequence[str]) -> None:
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client address, method, path and query, HTTP version, status code)
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else None
        return not (isinstance(path, str) and path.startswith(self.prefixes))


def exclude_access_log_paths(prefixes: Optional[Sequence[str]]) -> None:
    """Leave out the access-log lines of paths starting with any of ``prefixes`` (None or empty:
    none). Call after ``uvicorn.Config`` is made: it configures the access logger afresh."""
    if prefixes:
        logging.getLogger(ACCESS_LOGGER).addFilter(ExcludedPaths(prefixes))
