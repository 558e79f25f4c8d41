"""The server's asyncio side: tokenizes and validates requests, and is the
ZMQ transport of the result router (`radixrt.requests.router`), which tracks
every request's state and hands results (or streamed chunks) back.

Specs come from the front door (`radixrt.requests.intake`), and `submit`
validates them there against this runtime's limits before anything reaches
the scheduler, so bad input becomes a 400 here, never an error inside the
scheduler process.

Request ids (intake's "Request ids"): the scheduler and the detokenizer know
a request by a random internal id (``ReqState.rid``/``parent``); the client's
rid (or a random one) is only a label, in ``meta_info.id``, mapped to the
internal id by the router's rid table.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

from radixrt.requests.detokenizer import PROMPT_TAIL_TOKENS
from radixrt.requests.intake import RequestSpec, validate_call
from radixrt.requests.messages import (
    AbortReq,
    ControlReply,
    FlushCacheReq,
    LoRAControlReq,
    RadixSnapshotReq,
    StatsReq,
    TokenOutput,
)
from radixrt.requests.rids import RidEntry
from radixrt.requests.router import ReqGroup, ReqState, ResultObserver, ResultRouter
from radixrt.requests.runtime_info import RuntimeInfo
from radixrt.server.errors import ServerError, as_bad_request, bad_request
from radixrt.server.ipc import DetokBatch, DetokRegister, IpcAddrs, make_socket
from radixrt.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Prompt size bound (see `TokenizerManager.max_prompt_chars`): a token covers
# at most the longest vocabulary entry's characters; this factor leaves room
# for normalizers that merge characters (NFC/NFKC composition merges at most
# three into one).
CHARS_PER_TOKEN_MARGIN = 4
TOKENIZE_THREADS = 2  # worker threads that tokenize (the tokenizers library releases the GIL)


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for: its longest
    vocabulary entry (byte-level vocabularies spell a byte as one character,
    SentencePiece's byte tokens spell one as six), at least 1."""
    try:
        return max(1, max(map(len, tokenizer.get_vocab()), default=1))
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: a generous guess
        logger.warning("cannot read the tokenizer's vocabulary; assuming tokens of at most 256 characters")
        return 256


__all__ = ["ServerError", "TokenizerManager"]


class _Metrics(ResultObserver):
    """The router's observer on the server: TTFT, inter-token latency and finishes (of the
    requests with ``log_metrics``: not /health_generate's probes, as in SGLang)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def on_output(self, st: ReqState, out: TokenOutput, now: float) -> None:
        n = len(out.new_token_ids)
        if not n or not st.log_metrics:
            return
        if st.t_first is None:
            st.t_first = now
            self.metrics.observe_ttft(now - st.t_start)
            if n > 1:
                self.metrics.observe_itl(0.0, n - 1)
        else:
            self.metrics.observe_itl((now - (st.t_last or now)) / n, n)
        st.t_last = now

    def on_finish(self, st: ReqState, now: float, inflight: int) -> None:
        self.metrics.set_inflight(inflight)
        if not st.log_metrics:
            return
        fr = st.acc.finish_reason
        self.metrics.observe_finish(
            fr.type if fr else "error",
            st.acc.prompt_tokens,
            st.acc.completion_tokens,
            st.acc.cached_tokens,
            now - st.t_start,
        )


class TokenizerManager:
    def __init__(
        self,
        tokenizer: Any,
        addrs: IpcAddrs,
        info: RuntimeInfo,
        metrics: ServerMetrics,
        observers: Sequence[ResultObserver] = (),
        tokenize_threads: Optional[int] = None,
    ) -> None:
        """``observers``: hear of every request besides the metrics (`RequestLog` under --log-requests,
        `CrashDump` under --crash-dump-folder). ``tokenize_threads``: the threads
        `run_tokenize` runs on (SGLang's --tokenizer-worker-num; None: TOKENIZE_THREADS)."""
        self.tokenize_threads = tokenize_threads or TOKENIZE_THREADS
        self.tokenizer = tokenizer
        self.addrs = addrs
        self.info = info
        # what OpenAI-route requests leave unset: --preferred-sampling-params over the model's own
        # (radixrt/requests/generation_defaults.py)
        self.sampling_defaults: dict[str, Any] = {}
        self.metrics = metrics
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size
        self.kv_total_slots = info.kv_total_slots
        self.limits = info.limits
        self.router = ResultRouter(tokenizer, self, [_Metrics(metrics), *observers])  # this manager is its transport
        self.control_waiters: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.dead_reason: Optional[str] = None
        self._recv_task: Optional[asyncio.Task] = None
        self._ctx = self._actx = None
        self.last_stats: dict = {}
        # Longer prompts cannot fit the context whatever they say: refused by
        # size before tokenizing (see `encode`).
        self.max_prompt_chars = self.context_length * CHARS_PER_TOKEN_MARGIN * max_token_chars(tokenizer)
        self._tokenize_pool: Optional[ThreadPoolExecutor] = None

    # ------------------------------------------------------------------ sockets
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.Context()
        self._to_scheduler = make_socket(self._ctx, zmq.PUSH, self.addrs.scheduler_in, bind=False)
        self._to_detokenizer = make_socket(self._ctx, zmq.PUSH, self.addrs.detokenizer_in, bind=False)
        self._actx = zmq.asyncio.Context()
        self._from_detokenizer = make_socket(self._actx, zmq.PULL, self.addrs.tokenizer_in, bind=True)
        self._recv_task = asyncio.create_task(self._recv_loop(), name="radixrt-tm-recv")

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self._tokenize_pool is not None:
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.destroy(linger=0)

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = await self._from_detokenizer.recv_pyobj()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving; a bad message must not stop the loop
                logger.exception("bad message from the detokenizer")
                continue
            try:
                if isinstance(msg, DetokBatch):
                    self._on_batch(msg)
                elif isinstance(msg, ControlReply):
                    # the scheduler answers each call of a kind once, in order: the reply is the
                    # oldest waiter's, even one that stopped waiting (a timeout), never the next one's
                    waiters = self.control_waiters[msg.kind]
                    if waiters:
                        fut = waiters.popleft()
                        if not fut.done():
                            fut.set_result(msg)
                else:
                    logger.warning("unexpected message %s", type(msg).__name__)
            except Exception:
                logger.exception("failed to handle %s", type(msg).__name__)

    def _on_batch(self, batch: DetokBatch) -> None:
        self.router.deliver([item.out for item in batch.items], [item.text for item in batch.items])

    @property
    def states(self) -> Mapping[str, ReqState]:
        """The samples being generated, by internal id."""
        return self.router.states

    # ------------------------------------------------------------------ requests
    def encode(
        self, text: str, add_special_tokens: bool = True, field: Optional[str] = None, fit: bool = True
    ) -> list[int]:
        """``text``'s token ids; ServerError 400 (naming ``field``, the request field
        the text came from) when the text cannot fit the context: longer than
        ``max_prompt_chars`` (refused before tokenizing) or ``context_length``
        tokens or more (refused at once, before the other prompts of a batch are
        tokenized); or when it holds a lone surrogate. ``fit`` False: the caller cuts
        the ids to the context itself (vLLM's ``truncate_prompt_tokens``), so no length
        is refused (the request's size bounds the work); nor under ``--allow-auto-truncate``, where
        the front door cuts it (`validate_spec`). Blocking: routes call it from `run_tokenize`."""
        fit = fit and not self.limits.auto_truncate
        n = len(text)
        if fit and n > self.max_prompt_chars:
            raise bad_request(
                f"the prompt is {n} characters long; this model's context length is {self.context_length} "
                f"tokens, which cannot hold more than {self.max_prompt_chars} characters",
                field,
            )
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(
                    f"the prompt holds a lone surrogate ({text[e.start : e.end]!a}), which is not a Unicode character",
                    field,
                ) from None
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if fit and len(ids) >= self.context_length:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; this model's context length is "
                f"{self.context_length}, so at most {self.context_length - 1} prompt tokens fit",
                field,
            )
        return ids

    async def run_tokenize(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, which tokenizes (through `encode`), in a worker
        thread: a long prompt takes the event loop no time (the tokenizers
        library releases the GIL while it encodes)."""
        if self._tokenize_pool is None:
            self._tokenize_pool = ThreadPoolExecutor(self.tokenize_threads, thread_name_prefix="radixrt-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, functools.partial(fn, *args))

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ServerError(503, f"the server is shutting down: {self.dead_reason}")

    def validate_specs(self, specs: list[RequestSpec]) -> None:
        """`validate_call` of the specs against this runtime's limits
        (ServerError 400 on the call's size or the first bad one). Blocking and O(size): it reads
        every prompt id and parses grammars, so routes call it from
        `run_tokenize` and then `submit(..., validated=True)`."""
        with as_bad_request():
            validate_call(specs, self.limits)

    def submit(
        self,
        specs: list[RequestSpec],
        validated: bool = False,
        on_done: Optional[Callable[[ReqGroup], None]] = None,
    ) -> ReqGroup:
        """Validate every prompt (ServerError 400 on the first bad one; skipped
        when ``validated``: the caller ran `validate_specs` off the event
        loop), then queue them all: nothing is queued if one is bad. A spec
        without a rid gets a random one; a rid already running (as a
        request's or a sample's rid) is refused. ``on_done``: the group's
        hook (`ResultRouter.submit`)."""
        self.check_alive()
        if not validated:
            self.validate_specs(specs)
        with as_bad_request():
            group = self.router.submit(specs, on_done=on_done)
        self.metrics.set_inflight(self.router.inflight)
        return group

    # ------------------------------------------------------------------ the router's transport
    def send_request(self, spec: RequestSpec, entry: RidEntry) -> None:
        """Send ``spec`` on under its internal ids (the detokenizer hears of it before the scheduler)."""
        sp = spec.sampling
        self._to_detokenizer.send_pyobj(
            DetokRegister(
                rids=entry.sample_iids,
                skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
                stop=list(sp.stop or []),
                no_stop_trim=sp.no_stop_trim,
                parent=entry.iid,
                stop_regex=list(sp.stop_regex or []),
                prompt_tail=list(spec.input_ids[-PROMPT_TAIL_TOKENS:]),
            )
        )
        self._to_scheduler.send_pyobj(spec.to_generate_req(entry.iid, stream=True))

    def send_abort(self, iids: Sequence[str]) -> None:
        self._to_scheduler.send_pyobj(AbortReq(tuple(iids)))

    # ------------------------------------------------------------------ aborts
    def abort_group(self, group: ReqGroup, reason: str = "aborted: the client disconnected") -> None:
        """Stop every unfinished sample of ``group``; the scheduler frees their KV."""
        self.router.abort_group(group, reason)

    def abort_rid(self, rid: str) -> None:
        """Abort the request of the client's rid ``rid`` with its samples, or
        the one sample of that rid ("" aborts every request). Rids match
        exactly; an unknown one is ignored."""
        self.router.abort_rid(rid)

    def fail_all(self, reason: str) -> None:
        """A child process died: end every request with an error."""
        self.dead_reason = reason
        self.router.fail_all(reason)
        for waiters in self.control_waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(ServerError(503, reason))

    async def control(self, msg: Any, kind: str, timeout: float = 10.0) -> ControlReply:
        self.check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._to_scheduler.send_pyobj(msg)
        self.control_waiters[kind].append(fut)  # only once sent: one waiter per call the scheduler answers
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            fut.cancel()
            raise ServerError(503, f"the scheduler did not answer {kind} within {timeout:.0f} s") from None

    async def flush_cache(self) -> bool:
        return (await self.control(FlushCacheReq(), "flush_cache")).ok

    async def lora_control(self, name: str, path: Optional[str]) -> ControlReply:
        """Load (``path``) or unload a LoRA adapter in the scheduler (it reads the adapter)."""
        return await self.control(LoRAControlReq(name, path), "lora", timeout=120.0)

    async def radix_view(self, req: RadixSnapshotReq, timeout: float = 10.0) -> dict:
        """The scheduler's debug view of its tree and requests (scheduler/debug_view.py)."""
        return (await self.control(req, "radix", timeout)).payload

    async def get_stats(self, timeout: float = 10.0) -> dict:
        stats = (await self.control(StatsReq(), "stats", timeout)).payload
        self.last_stats = stats
        self.metrics.update_from_stats(stats)
        return stats
