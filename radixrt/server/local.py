"""Run a radixrt server as a subprocess on this machine and wait until it
answers (used by tests, the serving benchmark, and anyone who wants a local
server from Python)::

    srv = LocalServer("--max-total-tokens", "8192", api_key="k").wait_ready()
    ... srv.url ...
    srv.stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(
        self,
        *extra: str,
        model: str = "default",
        api_key: Optional[str] = None,
        port: Optional[int] = None,
        env: Optional[dict] = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="radixrt-server-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "radixrt.server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-n:]

    def wait_ready(self, timeout: float = 300.0) -> "LocalServer":
        deadline = time.monotonic() + timeout
        # One client for every poll: each new httpx client builds an SSL context (about 80 ms of
        # CPU), which polling four times a second would take from the server starting beside it.
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
