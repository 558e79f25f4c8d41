"""Real servers on 127.0.0.1 for the e2e tests (``radixrt serve`` in a child process)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Optional

import httpx

from radixrt.server.local import LocalServer

# the session tiny_server's API key and request limits (tests/e2e/conftest.py)
TINY_SERVER_KEY = "test-key"
TINY_SERVER_ADMIN_KEY = "test-admin-key"  # the operator's (the cache's debug view, test_dashboard.py)
TINY_SERVER_MAX_N = 4
TINY_SERVER_MAX_TOP = 5


# SGLang's flag: the server starts without loading xgrammar (and the torch it imports) into its HTTP
# process; its first request with a grammar loads it instead. That import is 1.5-2 s of CPU a start,
# which the suite's servers that see no grammar would spend for nothing. The session's default_server
# keeps the warm-up (the default path), and so does test_http_hardening.py's server, whose event-loop
# timings assume xgrammar was loaded before the first request.
SKIP_WARMUP = "--skip-server-warmup"


def serving(*flags: str, model: str, api_key: Optional[str] = None, warmup: bool = False) -> Iterator[LocalServer]:
    """Start a server with ``flags`` (and ``SKIP_WARMUP`` unless ``warmup``), yield it once ready, then
    stop it with SIGTERM and assert a clean exit: exit code 0 within 15 s, and its child processes gone
    5 s later. Its files are removed whatever happens. Meant for ``yield from serving(...)`` in a fixture."""
    srv = LocalServer(*flags, *(() if warmup else (SKIP_WARMUP,)), model=model, api_key=api_key)
    try:
        srv.wait_ready()
        pids = httpx.get(srv.url + "/get_server_info", headers=srv.headers, timeout=30).json()["process_ids"]
        yield srv
        t0 = time.monotonic()
        assert srv.stop(signal.SIGTERM) == 0, srv.log_tail()
        assert time.monotonic() - t0 < 15
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids.values()), pids
    finally:
        srv.cleanup()


@contextlib.contextmanager
def client_of(*flags: str, model: str) -> Iterator[httpx.Client]:
    """A client of a server started with ``flags`` and ``SKIP_WARMUP`` for one test's requests; the
    server is stopped and its files removed afterwards, whatever happens."""
    srv = LocalServer(*flags, SKIP_WARMUP, model=model)
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as client:
            yield client
    finally:
        srv.stop()
        srv.cleanup()


def info_and_metrics(client: httpx.Client) -> tuple[dict, str]:
    """The server's ``/get_server_info`` (JSON) and ``/metrics`` (text)."""
    return client.get("/get_server_info").json(), client.get("/metrics").text


def pid_alive(pid: int) -> bool:
    """A process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][:1] != "Z"


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class MemoryWatchdog:
    """Kills ``pids`` (SIGKILL) as soon as one of them holds more than
    ``limit_bytes`` resident, so that a test provoking unbounded growth fails
    instead of taking the machine down. Use as a context manager; ``peak``
    is each process's highest RSS seen (polled every ``interval_s``),
    ``tripped`` names the process that passed the limit, if any."""

    def __init__(self, pids: dict[str, int], limit_bytes: int, interval_s: float = 0.05) -> None:
        import threading

        self.pids, self.limit, self.interval = pids, limit_bytes, interval_s
        self.peak = {name: rss_bytes(pid) for name, pid in pids.items()}
        self.tripped: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import signal

        while not self._stop.wait(self.interval):
            for name, pid in self.pids.items():
                rss = rss_bytes(pid)
                self.peak[name] = max(self.peak[name], rss)
                if rss > self.limit and self.tripped is None:
                    self.tripped = f"{name} (pid {pid}) reached {rss / 2**30:.2f} GiB"
                    for p in self.pids.values():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGKILL)

    def __enter__(self) -> "MemoryWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
