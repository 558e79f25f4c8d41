"""`radixrt.Engine`: the runtime in-process, thread-safe for many callers.

The scheduler runs in one background thread fed through a queue. Requests
enter through the front door (`radixrt.requests.intake`: normalization,
validation, request ids) in the caller's thread, so bad input raises
ValueError before anything is queued.

Request ids (intake's "Request ids"): the scheduler knows a request by a
random internal id; its ``rid`` (given, or random) is what ``meta_info.id``
shows and ``abort_request`` takes; a rid already running is refused.

One implementation of generation, async: `async_generate` runs it in the
caller's event loop; the sync API (`generate`, its ``stream=True`` iterator)
runs the same coroutines on a private loop thread (started on first use).
Results go through the server's result router (`radixrt.requests.router`)
over an in-process queue: one wake-up per loop per scheduler step, and
detokenization on that loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional, Sequence, Union

from radixrt.config import EngineConfig
from radixrt.config.lora import parse_lora_paths, unknown_adapter
from radixrt.engine_control import EngineControl
from radixrt.engine_stream import stream_group
from radixrt.loop_thread import LoopThread
from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import RequestSpec, build_specs, sequences_each, split_prompts, validate_call
from radixrt.requests.messages import REPLY_KINDS, AbortReq, ControlReply, TokenBatch
from radixrt.requests.request_log import RequestLog
from radixrt.requests.rids import RidEntry
from radixrt.requests.router import ReqGroup, ResultRouter
from radixrt.requests.scoring import score_with
from radixrt.requests.sessions import SessionStore, SessionTurn, end_turn, start_turn
from radixrt.requests.sglang_fields import engine_extras
from radixrt.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
_IDLE_POLL_S = 0.05


class _QueueTransport:
    """The router's transport in-process: the scheduler thread's inbox."""

    def __init__(self, inbox: queue.Queue) -> None:
        self.inbox = inbox

    def send_request(self, spec: RequestSpec, entry: RidEntry) -> None:
        self.inbox.put(spec.to_generate_req(entry.iid))

    def send_abort(self, iids: Sequence[str]) -> None:
        self.inbox.put(AbortReq(tuple(iids)))


class Engine(EngineControl):
    """In-process engine. ``Engine(model_path="default", **EngineConfig fields)``.

    One thread, ``radixrt-scheduler``, builds the scheduler (the model load included) and runs
    its loop; the constructor waits for it and raises what the build raised. Nothing of torch
    runs on the caller's thread: libgomp (the OpenMP runtime of torch's CPU wheels and of the C
    kernels) keeps a thread pool per thread that ever ran a parallel region, and once all pools'
    threads outnumber the cores, workers sleep between regions and each region pays a wake-up: a
    model built on the caller's thread and run on another took 18 ms instead of 9 ms per batch-1
    decode step on 2 cores (docs/benchmarks.md, "Server process"), as does torch work of the
    caller's own on its thread while an Engine runs."""

    def __init__(self, model_path: str = "default", **kwargs: Any) -> None:
        log_level = kwargs.get("log_level")
        if log_level:
            logging.getLogger("radixrt").setLevel(log_level.upper())
        self.config = EngineConfig(model_path=model_path, **kwargs)
        self._inbox: queue.Queue = queue.Queue()
        # replies by kind: a long call (a weight update) does not hold up the others (stats)
        self._control = {kind: queue.Queue() for kind in REPLY_KINDS.values()}
        self._control_locks = {kind: threading.Lock() for kind in REPLY_KINDS.values()}
        self._sync_loop: Optional[LoopThread] = None
        self._sync_loop_lock = threading.Lock()
        self._stopping = threading.Event()
        self._idle = threading.Event()
        self._error: Optional[BaseException] = None
        self._router_ready = threading.Event()
        built: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, args=(built,), name="radixrt-scheduler", daemon=True)
        self._thread.start()
        scheduler = built.get()
        if isinstance(scheduler, BaseException):
            self._thread.join()
            raise scheduler
        self.scheduler: Scheduler = scheduler
        self.tokenizer = scheduler.tokenizer
        self.model_path = scheduler.runner.model_path
        self.info = scheduler.runtime_info()
        self.context_length = self.info.context_length
        self.limits = self.info.limits
        debug = self.config.debug
        observers = [RequestLog(self.tokenizer, debug.log_requests_level)] if debug.log_requests else []
        self.router = ResultRouter(self.tokenizer, _QueueTransport(self._inbox), observers)
        # adapter names a request may give as lora_path (kept by load/unload_lora_adapter)
        self.lora_adapters: set[str] = set(parse_lora_paths(self.config.lora.lora_paths))
        self.sessions = SessionStore()  # SGLang's sessions (`open_session`), as the server's
        self._router_ready.set()

    # ------------------------------------------------------------------ scheduler thread
    def _serve(self, built: queue.Queue) -> None:
        """Build the scheduler and hand it (or the build's exception) to the constructor
        through ``built``, then run its loop until ``shutdown``."""
        try:
            scheduler = Scheduler(self.config)
        except BaseException as e:  # noqa: BLE001 - raised again by the constructor
            built.put(e)
            return
        built.put(scheduler)
        self._router_ready.wait()  # the loop's sends go through the router the constructor makes
        try:
            scheduler.event_loop(self._recv, self._send, self._stopping.is_set)
        except BaseException as e:  # surface to callers instead of hanging them
            logger.exception("scheduler thread died")
            self._error = e
            self.router.finish_all(FinishReason.abort(f"engine error: {e}"))

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
            self.router.deliver(msg.outputs)  # one wake-up per caller's loop, not one per output
        elif isinstance(msg, ControlReply):
            self._control[msg.kind].put(msg)

    # ------------------------------------------------------------------ requests
    def _prepare(
        self,
        prompt: Prompt,
        sampling_params: Any,
        input_ids: Any,
        return_logprob: Any,
        logprob_start_len: Any,
        top_logprobs_num: Any,
        return_text_in_logprobs: bool,
        cache_salt: Optional[str],
        stream: bool,
        rid: Any,
        priority: Any = None,
        return_cache_info: Any = False,
        lora_path: Any = None,
        token_ids_logprob: Any = None,
        sglang_fields: Optional[dict] = None,
    ) -> tuple[list[RequestSpec], bool, Optional[SessionTurn]]:
        """(validated specs, is_batch, the session turn begun or None) through the front door;
        ValueError on bad input."""
        fields = dict(sglang_fields or {})
        session_params = fields.pop("session_params", None)
        extras = engine_extras(fields)  # return_prompt_token_ids, extra_key, return_hidden_states
        prompts = split_prompts(
            prompt,
            input_ids,
            self.tokenizer.encode,
            text_name="prompt",
            allow_empty_batch=True,
            limits=self.limits,
            each=sequences_each(sampling_params),
        )
        specs = build_specs(
            prompts,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=bool(return_text_in_logprobs),
            cache_salt=cache_salt,
            rid=rid,
            priority=priority,
            return_cache_info=return_cache_info,
            lora_path=lora_path,
            token_ids_logprob=token_ids_logprob,
            sampling_defaults=self.limits.preferred_sampling,
            **extras,
        )
        turn = start_turn(self.sessions, session_params, specs, getattr(self.tokenizer, "bos_token_id", None))
        try:
            validate_call(specs, self.limits)
            unknown = unknown_adapter((s.lora for s in specs), self.lora_adapters)
            if unknown is not None:  # as the server answers it: a clear error now, not an aborted result
                raise ValueError(f"unknown LoRA adapter {unknown[:128]!r}; load it with load_lora_adapter.")
        except BaseException:
            end_turn(self.sessions, turn, None)
            raise
        return specs, prompts.batch, turn

    def _submit(self, specs: list[RequestSpec], turn: Optional[SessionTurn], stream: bool = False) -> ReqGroup:
        """Queue every spec for the scheduler as one group of the running loop,
        or none: ValueError if a rid is already running. A session ``turn`` ends
        with the group (`end_turn`), or now if the group is refused."""
        try:
            self._check_alive()
            on_done = None if turn is None else functools.partial(end_turn, self.sessions, turn)
            return self.router.submit(specs, live_text=stream, on_done=on_done)
        except BaseException:
            end_turn(self.sessions, turn, None)
            raise

    # ------------------------------------------------------------------ the async core
    async def _generate(
        self, specs: list[RequestSpec], batch: bool, turn: Optional[SessionTurn]
    ) -> Union[dict, list[dict]]:
        """Submit every prompt, wait for all, and answer in SGLang's shape;
        cancelling this aborts the requests."""
        group = self._submit(specs, turn)
        try:
            await group.wait()
        except asyncio.CancelledError:
            self.router.abort_group(group, "aborted: the caller was cancelled")
            raise
        results = [st.acc.to_dict() for st in group.states]
        return results[0] if not batch and len(results) == 1 else results

    async def _start_stream(
        self, specs: list[RequestSpec], batch: bool, turn: Optional[SessionTurn]
    ) -> AsyncIterator[dict]:
        """Submit ``specs`` now and return the iterator of their results (`stream_group`)."""
        group = self._submit(specs, turn, stream=True)
        incremental = self.config.output.incremental_streaming_output
        return stream_group(self.router, group, batch or len(group.states) > 1, incremental)

    # ------------------------------------------------------------------ public API
    def _loop(self) -> LoopThread:
        self._check_alive()  # after shutdown: an error, not a new loop thread left running
        with self._sync_loop_lock:
            if self._sync_loop is None:
                self._sync_loop = LoopThread()
            return self._sync_loop

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        return_logprob: Any = False,
        logprob_start_len: Any = None,
        top_logprobs_num: Any = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        cache_salt: Optional[str] = None,
        rid: Any = None,
        priority: Any = None,
        return_cache_info: Union[bool, str] = False,
        lora_path: Any = None,
        token_ids_logprob: Any = None,
        **sglang_fields: Any,
    ) -> Union[dict, list[dict], Iterator[dict]]:
        """SGLang's Engine.generate: one prompt -> a result dict (a list of n
        dicts when n > 1); a batch -> a flat list. ``stream`` yields cumulative results
        (only what is new in each with ``incremental_streaming_output``, as `/generate`;
        a batch's and n > 1's samples interleaved, each naming its ``index``).
        ``rid`` (a string, or one per prompt of a batch) names the request for
        ``meta_info.id`` and `abort_request`; one already running is refused.
        ``priority`` (an int, or one per prompt) orders the waiting queue when
        the engine runs with ``enable_priority_scheduling`` (a higher value
        first, unless ``schedule_low_priority_values_first``; older requests
        gain urgency per ``priority_aging_s``), else it is ignored; outside
        ``[-max_client_priority, max_client_priority]`` it is a RequestError
        (the in-process caller chose that bound and may raise it; the admin
        key's wider range is the server's, for its clients).
        ``return_cache_info`` adds ``meta_info.cache_info``: how the
        prompt matched the radix cache at admission; True explains it from the
        request's own text, ``"full"`` also shows where it diverged from the
        closest cached prompt, whoever sent that (the in-process caller is the
        operator; see `radixrt.memory.radix_explain`). ``lora_path``: a LoRA
        adapter's name, or one per prompt (None: the base model).
        ``token_ids_logprob`` (SGLang's): token ids whose logprobs every scored
        position returns (``meta_info.input_token_ids_logprobs`` and
        ``output_token_ids_logprobs``), or one list per prompt. SGLang's ``return_prompt_token_ids``
        adds each result's ``prompt_token_ids``, ``extra_key`` names a cache namespace (as ``cache_salt``),
        ``return_hidden_states`` (with ``enable_return_hidden_states``) adds ``meta_info.hidden_states``
        (`radixrt.requests.hidden_states`), ``session_params`` runs one prompt as a turn of a session
        (`open_session`). SGLang's other arguments
        (``image_data``, ``custom_logit_processor``...) are taken unset and refused set
        (`radixrt.requests.sglang_fields`).

        Runs `async_generate`'s coroutines on the engine's loop thread; any
        number of threads may call it at once."""
        specs, batch, turn = self._prepare(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            cache_salt,
            stream,
            rid,
            priority,
            return_cache_info,
            lora_path,
            token_ids_logprob,
            sglang_fields,
        )
        loop = self._loop()
        if stream:
            return loop.iterate(loop.run(self._start_stream(specs, batch, turn)))
        return loop.run(self._generate(specs, batch, turn))

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        return_logprob: Any = False,
        logprob_start_len: Any = None,
        top_logprobs_num: Any = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        cache_salt: Optional[str] = None,
        rid: Any = None,
        priority: Any = None,
        return_cache_info: Union[bool, str] = False,
        lora_path: Any = None,
        token_ids_logprob: Any = None,
        **sglang_fields: Any,
    ) -> Union[dict, list[dict], AsyncIterator[dict]]:
        """`generate` in the caller's event loop (``stream`` returns an async iterator)."""
        specs, batch, turn = self._prepare(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            cache_salt,
            stream,
            rid,
            priority,
            return_cache_info,
            lora_path,
            token_ids_logprob,
            sglang_fields,
        )
        if stream:
            return await self._start_stream(specs, batch, turn)
        return await self._generate(specs, batch, turn)

    def score(
        self,
        query: Any = None,
        items: Any = None,
        label_token_ids: Any = None,
        apply_softmax: Any = False,
        item_first: Any = False,
    ) -> list[list[float]]:
        """SGLang's Engine.score: each item's label probabilities, as ``POST /v1/score`` (requests/scoring.py)."""
        args = (query, items, label_token_ids, apply_softmax, item_first)
        return score_with(self.generate, self.tokenizer.encode, self.limits, *args)

    def abort_request(self, rid: str = "") -> None:
        """Abort the request of rid ``rid`` (its ``meta_info.id``) with its
        samples, or the one sample of that rid ("" aborts all); their KV slots
        are released. Rids match exactly; an unknown one is ignored."""
        self.router.abort_rid(rid)

    def _control_call(self, msg: Any) -> ControlReply:
        """The scheduler's reply to ``msg``; RuntimeError once its thread has stopped (a
        control call never waits on a dead scheduler)."""
        kind = REPLY_KINDS[type(msg)]
        with self._control_locks[kind]:
            self._check_alive()
            self._inbox.put(msg)
            while True:
                try:
                    return self._control[kind].get(timeout=_IDLE_POLL_S)
                except queue.Empty:
                    self._check_alive()

    def _check_alive(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the engine's scheduler has stopped ({self._error or 'shut down'})")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until the scheduler has no work and waits for input (tests use
        this before inspecting scheduler state from another thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._idle.clear()
            if self._idle.wait(timeout=1.0) and self._inbox.empty() and not self.scheduler.has_work():
                return
        raise TimeoutError("engine did not become idle")

    def shutdown(self) -> None:
        """Stop the scheduler. Requests still running end for their callers, who would
        otherwise wait forever, with an abort finish reason (as when the scheduler thread
        dies); then the sync API's loop stops. Later calls raise RuntimeError."""
        self._stopping.set()
        self._thread.join(timeout=10)
        self.router.finish_all(FinishReason.abort("the engine was shut down while this request ran"))
        self.scheduler.close()
        with self._sync_loop_lock:
            if self._sync_loop is not None:
                self._sync_loop.close()
                self._sync_loop = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
