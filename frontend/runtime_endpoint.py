"""HTTP backends: ``RuntimeEndpoint`` (SGLang's native protocol) and ``Runtime``
(a local radixrt server subprocess wrapped in an endpoint)."""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Optional

import httpx

from .backend import BaseBackend, normalize_markers
from .errors import BackendError
from .native_backend import NativeBackend


class RuntimeEndpoint(NativeBackend):
    """A radixrt (or SGLang) server reached over HTTP.

    Uses ``POST /generate`` for everything (``select`` included, via
    prefill-only logprob requests), ``GET /get_model_info`` for the chat role
    markers (``chat_role_markers``; plain markers when the server does not
    report them, or pass ``chat_template={"user": (prefix, suffix), ...}``),
    ``POST /flush_cache`` and ``GET /get_server_info``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: Optional[str] = None,
        verify: Any = None,
        chat_template: Optional[dict] = None,
        chat_template_name: Optional[str] = None,
        timeout: Optional[float] = None,
        default_system_prompt: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            verify=True if verify is None else verify,
        )
        try:
            self.model_info = self.get_model_info()
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach a server at {self.base_url}: {e}") from e
        markers = normalize_markers(chat_template) or normalize_markers(self.model_info.get("chat_role_markers"))
        if markers is not None:
            self._markers = markers
        self._default_system = default_system_prompt or self.model_info.get("chat_default_system_prompt") or None

    # transport -------------------------------------------------------------------
    def _raise_for(self, r: httpx.Response, what: str) -> None:
        if r.status_code >= 400:
            try:
                body = r.json()
                msg = body.get("error", body) if isinstance(body, dict) else body
                if isinstance(msg, dict):
                    msg = msg.get("message", msg)
            except ValueError:  # not JSON
                msg = r.text[:2000]
            raise BackendError(f"{what} failed with HTTP {r.status_code}: {msg}")

    def _request(self, payload: dict[str, Any]) -> Any:
        try:
            r = self.client.post("/generate", json=payload)
        except httpx.HTTPError as e:
            raise BackendError(f"POST {self.base_url}/generate: {type(e).__name__}: {e}") from e
        self._raise_for(r, "POST /generate")
        return r.json()

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            with self.client.stream("POST", "/generate", json=payload) as r:
                if r.status_code >= 400:
                    r.read()
                    self._raise_for(r, "POST /generate (stream)")
                for line in r.iter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if isinstance(obj, dict) and "error" in obj and "text" not in obj:
                        raise BackendError(f"stream error: {obj['error']}")
                    yield obj
        except httpx.HTTPError as e:
            raise BackendError(f"POST {self.base_url}/generate (stream): {type(e).__name__}: {e}") from e

    # admin -------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        r = self.client.get("/get_model_info")
        self._raise_for(r, "GET /get_model_info")
        return r.json()

    def get_model_name(self) -> str:
        """The served model's folder (SGLang's: what its clients load the tokenizer from)."""
        return self.model_info["model_path"]

    def get_server_info(self) -> dict:
        r = self.client.get("/get_server_info")
        self._raise_for(r, "GET /get_server_info")
        return r.json()

    def flush_cache(self, empty_cache: bool = True) -> bool:
        r = self.client.post("/flush_cache")
        if r.status_code in (404, 405):
            r = self.client.get("/flush_cache")
        return r.status_code == 200

    def health(self) -> bool:
        try:
            return self.client.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def shutdown(self) -> None:
        self.client.close()


def _serve_command(
    python: str,
    model_path: str,
    host: str,
    port: int,
    log_level: str,
    api_key: Optional[str],
    server_args: dict[str, Any],
) -> list[str]:
    """The ``radixrt serve`` command line; each of ``server_args`` becomes a
    ``--flag`` (``True``: bare flag, ``False``/``None``: left out)."""
    cmd = [
        python,
        "-m",
        "radixrt.cli",
        "serve",
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        log_level,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    for k, v in server_args.items():
        if v is True:
            cmd.append("--" + k.replace("_", "-"))
        elif v is not False and v is not None:
            cmd += ["--" + k.replace("_", "-"), str(v)]
    return cmd


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Runtime(BaseBackend):
    """Launch ``radixrt serve`` as a subprocess and talk to it over HTTP.

    ``Runtime(model_path="default", port=None, host="127.0.0.1", **server_args)``;
    each keyword argument becomes a ``--flag`` of ``radixrt serve`` (``True``
    -> bare flag, ``False``/``None`` -> omitted). Waits for ``/health``.
    Use as a backend directly, or ``runtime.endpoint``; ``shutdown()`` stops it.

    The server's output goes to a temporary log file (``log_path``), deleted by
    ``shutdown()``. When the server fails to start, the error shows the log's
    tail and the file is kept (its path is in the error) for the full text.
    """

    def __init__(
        self,
        model_path: str = "default",
        host: str = "127.0.0.1",
        port: Optional[int] = None,
        api_key: Optional[str] = None,
        startup_timeout: float = 600.0,
        log_level: str = "warning",
        python: Optional[str] = None,
        env: Optional[dict[str, str]] = None,
        **server_args: Any,
    ) -> None:
        self.model_path = model_path
        self.host = host
        self.port = port or _free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.cmd = _serve_command(
            python or sys.executable, model_path, host, self.port, log_level, api_key, server_args
        )
        self._keep_log = False
        self.process: Optional[subprocess.Popen] = None
        self._log = tempfile.NamedTemporaryFile(prefix="radixrt-serve-", suffix=".log", delete=False)
        self.log_path = self._log.name
        atexit.register(self.shutdown)
        try:
            self.process = subprocess.Popen(
                self.cmd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
            self._wait_ready(startup_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)
        except Exception as e:
            # The server ran but did not come up: keep its log for the error to point at.
            self._keep_log = self.process is not None
            if self._keep_log and self.log_path not in str(e) and hasattr(e, "add_note"):
                e.add_note(f"radixrt server log kept at {self.log_path}")
            self.shutdown()
            raise
        except BaseException:
            self.shutdown()
            raise

    def _log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"radixrt server exited with code {self.process.returncode} during startup "
                        f"({' '.join(self.cmd)}); full log kept at {self.log_path}:\n{self._log_tail()}"
                    )
                try:
                    if c.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(
            f"radixrt server at {self.url} not healthy after {timeout:.0f}s; full log kept at "
            f"{self.log_path}:\n{self._log_tail()}"
        )

    # backend interface: delegate to the endpoint ---------------------------------
    @property
    def is_chat_model(self) -> bool:  # type: ignore[override]
        return False

    def get_role_markers(self):
        return self.endpoint.get_role_markers()

    def get_default_system_prompt(self):
        return self.endpoint.get_default_system_prompt()

    def generate(self, s, sampling):
        return self.endpoint.generate(s, sampling)

    def generate_stream(self, s, sampling):
        return self.endpoint.generate_stream(s, sampling)

    def select(self, s, choices, temperature, choices_method, lora=None):
        return self.endpoint.select(s, choices, temperature, choices_method, lora=lora)

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        return self.endpoint.flush_cache()

    def get_server_info(self) -> dict:
        return self.endpoint.get_server_info()

    def get_model_info(self) -> dict:
        return self.endpoint.get_model_info()

    def get_model_name(self) -> str:
        return self.endpoint.get_model_name()

    def raw_generate(self, payload: dict[str, Any]) -> Any:
        return self.endpoint.raw_generate(payload)

    def generate_text(self, prompt: Any, sampling_params: Optional[dict] = None, **kwargs: Any) -> Any:
        """Plain ``/generate`` call: ``runtime.generate_text("Hi", {"max_new_tokens": 8})``."""
        return self.endpoint.raw_generate({"text": prompt, "sampling_params": sampling_params or {}, **kwargs})

    def shutdown(self) -> None:
        """Stop the server (idempotent) and delete its log, unless it failed to start."""
        p, self.process = getattr(self, "process", None), None
        if hasattr(self, "endpoint"):
            try:
                self.endpoint.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process is stopped below
                pass
        if p is not None:
            _stop(p)
        self._close_log()

    def _close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is None:
            return
        log.close()
        if not self._keep_log:
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _stop(p: subprocess.Popen) -> None:
    """Terminate ``p`` (kill it after 15 s) and reap it."""
    if p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=5)
