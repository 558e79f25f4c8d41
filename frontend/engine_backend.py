"""The in-process backend: a ``radixrt.Engine`` in this Python process.

The engine is imported lazily (it pulls in torch); this module itself does
not import it. Program worker threads call ``engine.generate`` directly (it
is thread-safe), so all of them can have requests in flight at once and the
engine's scheduler batches them.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from typing import Any, Iterator, Optional

from radixrt.requests.chat_roles import derive_default_system_prompt, derive_role_markers

from .backend import normalize_markers
from .errors import BackendError
from .native_backend import NativeBackend

_DONE = object()


class _LoopThread:
    """A daemon thread running an asyncio loop, for calling async APIs from threads."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="radixrt-frontend-loop", daemon=True)
        self.thread.start()

    def call(self, make: Any) -> Any:
        async def run() -> Any:
            r = make()
            return (await r) if inspect.isawaitable(r) else r

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def iterate(self, make_aiter: Any) -> Iterator[Any]:
        q: "queue.Queue[Any]" = queue.Queue()

        async def pump() -> None:
            try:
                it = make_aiter()
                if inspect.isawaitable(it):
                    it = await it
                if hasattr(it, "__aiter__"):
                    async for item in it:
                        q.put(item)
                elif isinstance(it, (dict, list)):
                    q.put(it)
                else:
                    for item in it:
                        q.put(item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                q.put(e)
            finally:
                q.put(_DONE)

        asyncio.run_coroutine_threadsafe(pump(), self.loop)
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)


class EngineBackend(NativeBackend):
    """Runs programs on an in-process ``radixrt.Engine``.

    ``EngineBackend(engine)`` wraps an existing engine;
    ``EngineBackend(model_path="default", **config)`` creates one.
    ``radixrt.set_default_backend(engine)`` wraps an engine automatically.
    """

    def __init__(self, engine: Any = None, use_async: bool = False, **engine_kwargs: Any) -> None:
        super().__init__()
        # radixrt.Engine.generate is thread-safe, so program threads call it
        # directly; use_async routes calls through engine.async_generate on a
        # private event loop thread instead (for engines whose sync API is not).
        self.use_async = use_async
        if engine is None:
            from radixrt.engine import Engine  # lazy: torch lives behind this import

            engine = Engine(**engine_kwargs)
        elif engine_kwargs:
            raise TypeError("pass either an engine or engine keyword arguments, not both")
        self.engine = engine
        self._loop: Optional[_LoopThread] = None
        self._loop_lock = threading.Lock()
        markers, default_system = _chat_template_of(engine)
        if markers is not None:
            self._markers = markers
        self._default_system = default_system

    def _get_loop(self) -> _LoopThread:
        if self._loop is None:
            with self._loop_lock:
                if self._loop is None:
                    self._loop = _LoopThread()
        return self._loop

    @staticmethod
    def _kwargs(payload: dict[str, Any]) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if "text" in payload:
            kw["prompt"] = payload["text"]
        if "input_ids" in payload:
            kw["input_ids"] = payload["input_ids"]
        kw["sampling_params"] = payload.get("sampling_params")
        for k in (
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_text_in_logprobs",
            "stream",
            "cache_salt",
            "lora_path",
        ):
            if k in payload:
                kw[k] = payload[k]
        return kw

    def _request(self, payload: dict[str, Any]) -> Any:
        kw = self._kwargs(payload)
        try:
            if self.use_async:
                return self._get_loop().call(lambda: self.engine.async_generate(**kw))
            return self.engine.generate(**kw)
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"engine request failed: {type(e).__name__}: {e}") from e

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        kw = self._kwargs(payload)
        kw["stream"] = True
        try:
            if self.use_async:
                yield from self._get_loop().iterate(lambda: self.engine.async_generate(**kw))
            else:
                yield from self.engine.generate(**kw)
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"engine request failed: {type(e).__name__}: {e}") from e

    # passthroughs ---------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            if self._loop is not None:
                self._loop.close()


def _chat_template_of(engine: Any) -> tuple[Optional[dict[str, tuple[str, str]]], Optional[str]]:
    """The engine's role markers and default system prompt: as it reports
    them, else derived from its tokenizer's chat template (None where neither
    gives one)."""
    markers = normalize_markers(getattr(engine, "chat_role_markers", None))
    tok = getattr(engine, "tokenizer", None)
    if markers is None and tok is not None:
        markers = derive_role_markers(tok)
    default_system = getattr(engine, "chat_default_system_prompt", None)
    if default_system is None and tok is not None:
        try:
            default_system = derive_default_system_prompt(tok)
        except Exception:  # noqa: BLE001 - templates vary; no default system prompt then
            default_system = None
    return markers, default_system or None


_wrapped: dict[int, EngineBackend] = {}
_wrapped_lock = threading.Lock()


def backend_for_engine(engine: Any) -> EngineBackend:
    """The (one, cached) EngineBackend wrapping ``engine``."""
    with _wrapped_lock:
        b = _wrapped.get(id(engine))
        if b is None or b.engine is not engine:
            b = EngineBackend(engine)
            _wrapped[id(engine)] = b
        return b
