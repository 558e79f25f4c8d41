"""Real servers on 127.0.0.1 for the e2e tests (``radixrt serve`` in a child process)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Optional

import httpx

from radixrt.server.local import LocalServer


def serving(*flags: str, model: str, api_key: Optional[str] = None) -> Iterator[LocalServer]:
    """Start a server with ``flags``, yield it once ready, then stop it with
    SIGTERM and assert a clean exit; its files are removed whatever happens.
    Meant for ``yield from serving(...)`` in a fixture."""
    srv = LocalServer(*flags, model=model, api_key=api_key)
    try:
        srv.wait_ready()
        yield srv
        assert srv.stop() == 0, srv.log_tail()
    finally:
        srv.cleanup()


@contextlib.contextmanager
def client_of(*flags: str, model: str) -> Iterator[httpx.Client]:
    """A client of a server started with ``flags`` for one test's requests; the
    server is stopped and its files removed afterwards, whatever happens."""
    srv = LocalServer(*flags, model=model)
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
