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

from .errors import BackendError
from .backend import BaseBackend, normalize_markers
from .native_backend import NativeBackend


class RuntimeEndpoint(NativeBackend):
    """A radixrt (or SGLang) server reached over HTTP.

    Uses ``POST /generate`` for everything (``select`` included, via
    prefill-only logprob requests), ``GET /get_model_info`` for the chat role
    markers (``chat_role_markers``; plain markers when the server does not
    report them, or pass ``chat_template={"user": (prefix, suffix), ...}``),
    ``POST /flush_cache`` and ``GET /get_server_info``.
    """

    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Any = None,
                 chat_template: Optional[dict] = None, chat_template_name: Optional[str] = None,
                 timeout: Optional[float] = None, default_system_prompt: Optional[str] = None) -> None:
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
            except Exception:
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
    """

    def __init__(self, model_path: str = "default", host: str = "127.0.0.1", port: Optional[int] = None,
                 api_key: Optional[str] = None, startup_timeout: float = 600.0, log_level: str = "warning",
                 python: Optional[str] = None, env: Optional[dict[str, str]] = None, **server_args: Any) -> None:
        self.model_path = model_path
        self.host = host
        self.port = port or _free_port(host)
        self.url = f"http://{host}:{self.port}"
        cmd = [python or sys.executable, "-m", "radixrt.cli", "serve", "--model", str(model_path),
               "--host", host, "--port", str(self.port), "--log-level", log_level]
        if api_key:
            cmd += ["--api-key", api_key]
        for k, v in server_args.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                cmd.append(flag)
            elif v is False or v is None:
                continue
            else:
                cmd += [flag, str(v)]
        self.cmd = cmd
        self._log = tempfile.NamedTemporaryFile(prefix="radixrt-serve-", suffix=".log", delete=False)
        self.log_path = self._log.name
        self.process: Optional[subprocess.Popen] = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        atexit.register(self.shutdown)
        try:
            self._wait_ready(startup_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)
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
                        f"({' '.join(self.cmd)}):\n{self._log_tail()}"
                    )
                try:
                    if c.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"radixrt server at {self.url} not healthy after {timeout:.0f}s:\n{self._log_tail()}")

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

    def select(self, s, choices, temperature, choices_method):
        return self.endpoint.select(s, choices, temperature, choices_method)

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        return self.endpoint.flush_cache()

    def get_server_info(self) -> dict:
        return self.endpoint.get_server_info()

    def get_model_info(self) -> dict:
        return self.endpoint.get_model_info()

    def raw_generate(self, payload: dict[str, Any]) -> Any:
        return self.endpoint.raw_generate(payload)

    def generate_text(self, prompt: Any, sampling_params: Optional[dict] = None, **kwargs: Any) -> Any:
        """Plain ``/generate`` call: ``runtime.generate_text("Hi", {"max_new_tokens": 8})``."""
        return self.endpoint.raw_generate({"text": prompt, "sampling_params": sampling_params or {}, **kwargs})

    def shutdown(self) -> None:
        p, self.process = getattr(self, "process", None), None
        if hasattr(self, "endpoint"):
            try:
                self.endpoint.shutdown()
            except Exception:
                pass
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        try:
            self._log.close()
        except Exception:
            pass

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
