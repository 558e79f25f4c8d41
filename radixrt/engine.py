"""`radixrt.Engine`: the runtime in-process, thread-safe for many callers.

The scheduler runs in one background thread fed through a queue; callers
(threads or asyncio tasks) submit requests and receive their TokenOutputs on
a queue of their own. Detokenization happens in the caller's thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Optional, Union

from radixrt.config import EngineConfig
from radixrt.requests.messages import AbortReq, ControlReply, FlushCacheReq, GenerateReq, StatsReq, TokenBatch, TokenOutput
from radixrt.requests.results import ResultAccumulator
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
_IDLE_POLL_S = 0.05


@dataclass
class _Submission:
    """One prompt's request and where its outputs arrive (one accumulator per sample)."""

    req: GenerateReq
    accs: dict[str, ResultAccumulator]
    inbox: Any  # queue.Queue or asyncio.Queue of TokenOutput


class Engine:
    """In-process engine. ``Engine(model_path="default", **EngineConfig fields)``."""

    def __init__(self, model_path: str = "default", **kwargs: Any) -> None:
        log_level = kwargs.get("log_level")
        if log_level:
            logging.getLogger("radixrt").setLevel(log_level.upper())
        self.config = EngineConfig(model_path=model_path, **kwargs)
        self.scheduler = Scheduler(self.config)
        self.tokenizer = self.scheduler.tokenizer
        self.model_path = self.scheduler.runner.model_path
        self.context_length = self.scheduler.context_length
        self._inbox: queue.Queue = queue.Queue()
        self._control: queue.Queue = queue.Queue()
        self._routes: dict[str, tuple[_Submission, Optional[asyncio.AbstractEventLoop]]] = {}
        self._routes_lock = threading.Lock()
        self._control_lock = threading.Lock()
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._idle = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, name="radixrt-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ scheduler thread
    def _serve(self) -> None:
        try:
            self.scheduler.event_loop(self._recv, self._send, self._stopping.is_set)
        except BaseException as e:  # surface to callers instead of hanging them
            logger.exception("scheduler thread died")
            self._error = e
            with self._routes_lock:
                routes = list(self._routes.items())
            for rid, _ in routes:
                self._deliver(TokenOutput(rid, [], 0, 0, 0, {"type": "abort", "message": f"engine error: {e}"}))

    def _recv(self, block: bool) -> list[Any]:
        msgs = []
        if block:
            self._idle.set()
            try:
                msgs.append(self._inbox.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return []
        self._idle.clear()
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _send(self, msg: Any) -> None:
        if isinstance(msg, TokenBatch):
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, ControlReply):
            self._control.put(msg)

    def _deliver(self, out: TokenOutput) -> None:
        with self._routes_lock:
            route = self._routes.get(out.rid)
            if out.finished:
                self._routes.pop(out.rid, None)
        if route is None:
            return
        sub, loop = route
        if loop is None:
            sub.inbox.put(out)
        else:
            loop.call_soon_threadsafe(sub.inbox.put_nowait, out)

    # ------------------------------------------------------------------ request building
    def _make_requests(
        self, prompt: Prompt, sampling_params: Any, input_ids: Any, return_logprob: Any,
        logprob_start_len: Any, top_logprobs_num: Any, cache_salt: Optional[str],
    ) -> tuple[list[GenerateReq], bool]:
        """Tokenize and validate. Raises ValueError for bad input before anything is queued."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if any(not isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            if any(t == "" for t in texts):
                raise ValueError("the prompt is empty: give a non-empty text or input_ids")
            ids_list = [self.tokenizer.encode(t) for t in texts]
        else:
            single = not input_ids or isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
        n = len(ids_list)

        def per_item(value: Any, default: Any) -> list[Any]:
            if isinstance(value, list) and not single:
                if len(value) != n:
                    raise ValueError(f"got {len(value)} per-prompt values for {n} prompts")
                return [default if v is None else v for v in value]
            return [default if value is None else value] * n

        params = per_item(sampling_params, {})
        logprob_flags = per_item(return_logprob, False)
        starts = per_item(logprob_start_len, -1)
        tops = per_item(top_logprobs_num, 0)
        reqs = []
        for i, ids in enumerate(ids_list):
            if isinstance(params[i], SamplingParams):
                sp = params[i]
            elif isinstance(params[i], dict):
                sp = SamplingParams.from_dict(params[i])
            else:
                raise ValueError("sampling_params must be a dict (or a list of dicts for a batch)")
            self.scheduler.validate(ids, sp)
            start = int(starts[i])
            if bool(logprob_flags[i]) and start >= len(ids):
                raise ValueError(f"logprob_start_len {start} is not below the prompt length {len(ids)}")
            if int(tops[i]) < 0:
                raise ValueError("top_logprobs_num must be >= 0")
            reqs.append(GenerateReq(
                rid=f"{uuid.uuid4().hex[:12]}{next(self._ids)}", input_ids=ids, sampling=sp,
                return_logprob=bool(logprob_flags[i]) or int(tops[i]) > 0,
                logprob_start_len=start, top_logprobs_num=int(tops[i]), cache_salt=cache_salt,
            ))
        return reqs, single

    def _submit(self, req: GenerateReq, return_text_in_logprobs: bool, loop=None) -> _Submission:
        if self._error is not None:
            raise RuntimeError(f"the engine's scheduler died: {self._error}")
        n = req.sampling.n
        rids = [req.rid] if n == 1 else [f"{req.rid}-{i}" for i in range(n)]
        accs = {
            rid: ResultAccumulator(rid, self.tokenizer, req.sampling, req.return_logprob, return_text_in_logprobs)
            for rid in rids
        }
        sub = _Submission(req, accs, asyncio.Queue() if loop else queue.Queue())
        with self._routes_lock:
            for rid in rids:
                self._routes[rid] = (sub, loop)
        self._inbox.put(req)
        return sub

    # ------------------------------------------------------------------ public API
    def generate(
        self, prompt: Prompt = None, sampling_params: Any = None, input_ids: Any = None,
        return_logprob: Any = False, logprob_start_len: Any = None, top_logprobs_num: Any = None,
        return_text_in_logprobs: bool = False, stream: bool = False, cache_salt: Optional[str] = None,
    ) -> Union[dict, list[dict], Iterator[dict]]:
        """SGLang's Engine.generate: one prompt -> a result dict (a list of n
        dicts when n > 1); a batch -> a flat list. ``stream`` yields cumulative results."""
        reqs, single = self._make_requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, cache_salt
        )
        if stream:
            if not single or reqs[0].sampling.n != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream(self._submit(reqs[0], return_text_in_logprobs))
        subs = [self._submit(r, return_text_in_logprobs) for r in reqs]
        results = [r for sub in subs for r in self._collect(sub)]
        return results[0] if single and len(results) == 1 else results

    def _collect(self, sub: _Submission) -> list[dict]:
        pending = set(sub.accs)
        while pending:
            out = sub.inbox.get()
            sub.accs[out.rid].add(out)
            if out.finished:
                pending.discard(out.rid)
        return [acc.to_dict() for acc in sub.accs.values()]

    def _stream(self, sub: _Submission) -> Iterator[dict]:
        acc = next(iter(sub.accs.values()))
        sent = 0
        try:
            while not acc.finished:
                acc.add(sub.inbox.get())
                yield acc.to_dict(logprob_offset=sent)
                sent = len(acc.output_token_logprobs)
        finally:
            if not acc.finished:
                self.abort_request(sub.req.rid)

    async def async_generate(
        self, prompt: Prompt = None, sampling_params: Any = None, input_ids: Any = None,
        return_logprob: Any = False, logprob_start_len: Any = None, top_logprobs_num: Any = None,
        return_text_in_logprobs: bool = False, stream: bool = False, cache_salt: Optional[str] = None,
    ) -> Union[dict, list[dict], AsyncIterator[dict]]:
        reqs, single = self._make_requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, cache_salt
        )
        loop = asyncio.get_running_loop()
        if stream:
            if not single or reqs[0].sampling.n != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._astream(self._submit(reqs[0], return_text_in_logprobs, loop))
        subs = [self._submit(r, return_text_in_logprobs, loop) for r in reqs]
        gathered = await asyncio.gather(*(self._acollect(s) for s in subs))
        results = [r for rs in gathered for r in rs]
        return results[0] if single and len(results) == 1 else results

    async def _acollect(self, sub: _Submission) -> list[dict]:
        pending = set(sub.accs)
        try:
            while pending:
                out = await sub.inbox.get()
                sub.accs[out.rid].add(out)
                if out.finished:
                    pending.discard(out.rid)
        except asyncio.CancelledError:
            self.abort_request(sub.req.rid)
            raise
        return [acc.to_dict() for acc in sub.accs.values()]

    async def _astream(self, sub: _Submission) -> AsyncIterator[dict]:
        acc = next(iter(sub.accs.values()))
        sent = 0
        try:
            while not acc.finished:
                acc.add(await sub.inbox.get())
                yield acc.to_dict(logprob_offset=sent)
                sent = len(acc.output_token_logprobs)
        finally:
            if not acc.finished:
                self.abort_request(sub.req.rid)

    def abort_request(self, rid: str = "") -> None:
        """Abort a request by id ("" aborts all); its KV slots are released."""
        self._inbox.put(AbortReq(rid))

    def _control_call(self, msg: Any) -> ControlReply:
        with self._control_lock:
            self._inbox.put(msg)
            return self._control.get()

    def flush_cache(self) -> bool:
        return self._control_call(FlushCacheReq()).ok

    def get_stats(self) -> dict:
        return self._control_call(StatsReq()).payload

    def get_server_info(self) -> dict:
        import dataclasses

        return {
            **dataclasses.asdict(self.config),
            "model_path": self.model_path,
            "context_length": self.context_length,
            "max_total_num_tokens": self.scheduler.kv.allocator.num_pages * self.config.page_size,
            "stats": self.get_stats(),
        }

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    @property
    def chat_role_markers(self) -> dict[str, tuple[str, str]]:
        from radixrt.requests.chat_roles import derive_role_markers

        return derive_role_markers(self.tokenizer)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until the scheduler has no work and waits for input (tests use
        this before inspecting scheduler state from another thread)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._idle.clear()
            if self._idle.wait(timeout=1.0) and self._inbox.empty() and not self.scheduler.has_work():
                return
        raise TimeoutError("engine did not become idle")

    def shutdown(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)
        self.scheduler.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
