"""Constrained decoding with xgrammar: grammar keys, validation, compilation,
per-request matchers and verified jump-forward drafts.

Pieces and who uses them:

* ``grammar_key(sampling)`` names a request's constraint as a hashable
  ``(kind, source)`` pair (kind ``"regex"``, ``"json_schema"``, ``"ebnf"``
  or ``"structural_tag"``); ``None`` for an unconstrained request. A
  structural tag (xgrammar's JSON format: free text with triggered tags,
  tags with separators, JSON-schema contents...) is how tool calls are
  constrained (radixrt/server/tools/grammar.py builds them).
* ``check_grammar(key)`` parses the constraint without a tokenizer and raises
  ``ValueError`` with xgrammar's message when it is bad. It is cheap
  (microseconds, memoized) and runs at submission in the caller's thread (the
  Engine) or in the HTTP process (the server), so a bad grammar is a
  ValueError / 400 and never reaches the scheduler loop.
* ``GrammarBackend`` (one per scheduler) compiles grammars against the
  model's vocabulary on a background thread. ``compile_async(key)`` returns a
  ``Future``; futures are kept in an LRU keyed by the grammar, so each
  distinct grammar is compiled once and concurrent requests for the same
  grammar share one compilation. The tokenizer info and xgrammar compiler are
  built lazily on that thread, so an engine that never sees a grammar pays
  nothing.
* ``GrammarState`` (one per constrained request) wraps an xgrammar matcher:
  it fills the request's row of the batch's token bitmask, accepts sampled
  tokens, and proposes jump-forward drafts.

Bitmask layout (xgrammar's): int32 ``[rows, ceil(V / 32)]``; bit ``j % 32``
of word ``j // 32`` set means token ``j`` is allowed. ``apply_token_bitmask``
turns rows of it into ``-inf`` logits with plain torch ops, on any device.

With other sampling parameters: the grammar's stop tokens are the model's
eos ids, allowed only where the grammar is complete; a request ends (finish
reason ``stop``) when its matcher accepts one, ``ignore_eos`` or not.
``stop_token_ids`` outside the grammar can never be sampled; ``stop`` strings
and ``max_new_tokens`` still end a request early (its output is then a
prefix of a grammar string). Where ``min_new_tokens`` or ``logit_bias`` would
remove every token the grammar allows, the grammar wins (see the sampler).

JSON schemas compile with xgrammar's fixed separators (``", "`` and
``": "``, no free whitespace): a small model cannot wander into endless
whitespace, and the punctuation between values becomes forced text that
jump-forward appends without decode steps.

Jump-forward (verified). Where the grammar admits a single continuation
(``find_jump_forward_string``), ``GrammarState.propose_draft`` tokenizes it
and returns the tokens as a *draft*; the scheduler appends the draft to the
sequence, and the next step computes the draft's KV as one extend. Token
boundaries:

* Start: the draft begins exactly where the last sampled token ends. Tokens
  already sampled are never re-tokenized or replaced (SGLang's compressed FSM
  re-tokenizes the last tokens together with the forced string; that changes
  the model's own token choices and so can change everything after them).
* End and inside: the draft's tokenization (the tokenizer's encoding of the
  forced text on its own) need not be the one the model would pick, e.g. its
  last token may be a prefix of a longer token the model prefers. So the
  draft is *verified*: the extend step yields logits at every draft
  position, each position is sampled exactly as a decode step would sample it
  (same masks, penalties and per-position random draw), and the draft is kept
  up to the first position where the sampled token differs; that sampled
  token replaces the rest, whose KV is dropped and whose matcher steps are
  rolled back. Token-by-token constrained decoding would have produced the
  same tokens at those positions, so the output (tokens and logprobs) equals
  decoding without jump-forward, by construction, whenever the model's
  logits for a position do not depend on whether it was computed in a decode
  or in an extend step (bit-level float differences between the two can, as
  everywhere in the runtime, move a token that sits on an exact tie).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from radixrt.sampling.compile_canary import CompileCanary
from radixrt.sampling.grammar_bounds import GrammarLimits, GrammarTooCostly, check_grammar_bounds
from radixrt.sampling.json_schema_grammar import json_schema_grammar, with_json_string_chars
from radixrt.sampling.schema_support import check_enforceable, check_tag_schemas

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind, source); kind in GRAMMAR_KINDS
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")

# Characters of forced text tokenized per draft token allowed (tokens average ~4 characters; a
# longer token cut at the end only shortens the draft, which verification keeps correct).
MAX_DRAFT_CHARS_PER_TOKEN = 16
# grammars of at most this many characters compile in a lane of their own (GrammarBackend)
SMALL_GRAMMAR_CHARS = 4096


def grammar_key(sampling: Any) -> Optional[GrammarKey]:
    """The constraint of a request's SamplingParams as ``(kind, source)``, or None.
    At most one of ``regex``, ``json_schema``, ``ebnf``, ``structural_tag`` is
    set (SamplingParams validates that)."""
    for kind in GRAMMAR_KINDS:
        source = getattr(sampling, kind, None)
        if source is not None:
            return (kind, source)
    return None


_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: ")


def _clean_error(e: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    msg = str(e).strip()
    msg = _XGR_PREFIX.sub("", msg)
    msg = _CHECK_FAILED.sub("", msg)
    return msg.strip() or type(e).__name__


def _parse(key: GrammarKey, limits: GrammarLimits) -> Any:
    """The xgrammar ``Grammar`` of ``key`` (raises on a bad grammar, or one
    beyond ``limits``: see radixrt/sampling/grammar_bounds.py)."""
    import xgrammar as xgr

    kind, source = key
    if len(source) > limits.max_source_chars:
        raise GrammarTooCostly(
            f"it has {len(source)} characters, more than the limit of {limits.max_source_chars} "
            "(--grammar-max-source-chars)"
        )
    if kind == "regex":
        grammar = xgr.Grammar.from_regex(source)
    elif kind == "json_schema":
        json.loads(source)  # a clearer message for malformed JSON than xgrammar's
        grammar = json_schema_grammar(source)
    elif kind == "ebnf":
        grammar = xgr.Grammar.from_ebnf(source)
    elif kind == "structural_tag":
        grammar = with_json_string_chars(_structural_tag(json.loads(source), source))
    else:
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
    check_grammar_bounds(grammar, limits)
    return grammar


def _structural_tag(tag: Any, source: str) -> Any:
    """xgrammar's structural tag (``{"type": "structural_tag", "format": ...}``), or the
    earlier form SGLang still takes, ``{"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}`` (xgrammar's deprecated call, which it converts)."""
    import xgrammar as xgr

    if not (isinstance(tag, dict) and "structures" in tag and "format" not in tag):
        return xgr.Grammar.from_structural_tag(source)
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not all(
        isinstance(st, dict)
        and isinstance(st.get("begin"), str)
        and isinstance(st.get("end"), str)
        and isinstance(st.get("schema"), (dict, bool))
        for st in structures
    ):
        raise ValueError('\'structures\' must be a list of {"begin": str, "schema": JSON schema, "end": str}')
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("'triggers' must be a list of non-empty strings")
    items = [
        xgr.StructuralTagItem(begin=st["begin"], schema=json.dumps(st["schema"]), end=st["end"]) for st in structures
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return xgr.Grammar.from_structural_tag(items, triggers)


@functools.lru_cache(maxsize=1024)
def _check_cached(key: GrammarKey, limits: GrammarLimits, enforce_all: bool = True) -> bool:
    _parse(key, limits)  # exceptions are not cached: a bad grammar is parsed again each time
    if enforce_all and key[0] == "json_schema":
        check_enforceable(json.loads(key[1]))
    elif enforce_all and key[0] == "structural_tag":
        check_tag_schemas(json.loads(key[1]))
    return True


def check_grammar(key: Optional[GrammarKey], limits: Optional[GrammarLimits] = None, enforce_all: bool = True) -> None:
    """Raise ValueError naming the sampling parameter when ``key``'s grammar is
    malformed, has no finite instance, or exceeds ``limits`` (the defaults when
    None), or, with ``enforce_all``, when its JSON schemas hold a keyword the grammar
    would not enforce (schema_support.py). Needs no tokenizer; thread-safe; good
    grammars are memoized."""
    if key is None:
        return
    try:
        _check_cached(key, limits or GrammarLimits(), enforce_all)
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling parameter '{key[0]}' is not valid JSON: {e}") from None
    except GrammarTooCostly as e:
        raise ValueError(f"sampling parameter '{key[0]}' is refused: {e}") from None
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every parse error
        raise ValueError(f"sampling parameter '{key[0]}' is invalid: {_clean_error(e)}") from None


def warm_grammar_checker() -> None:
    """Import xgrammar (and the torch it loads) and parse one grammar, so that
    the first request with a grammar does not pay for it: the import loads
    shared libraries while holding the GIL, which stalls an HTTP process's
    event loop for hundreds of milliseconds even from a worker thread.
    Servers call it while starting, before they accept requests."""
    check_grammar(("regex", "[a-z]+"))


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> Any:
    """An int32 CPU bitmask ``[rows, ceil(V/32)]`` with every token allowed."""
    import torch

    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


_BIT_SHIFTS: dict[Any, Any] = {}


def apply_token_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Set ``logits[rows[i], t] = -inf`` (in place) for every token ``t`` that
    row ``i`` of ``bitmask`` disallows. ``logits`` is float ``[B, V']``
    (V' <= 32 * bitmask width) on any device; ``bitmask`` int32 ``[len(rows), W]``."""
    import torch

    if not rows:
        return
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    V = logits.shape[1]
    bm = bitmask.to(device, non_blocking=True)
    allowed = ((bm.unsqueeze(-1) >> shifts) & 1).view(bm.shape[0], -1)[:, :V].bool()
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


class GrammarBackend:
    """Compiles grammars for one model's vocabulary, off the caller's thread.

    ``compile_async`` is thread-safe and never blocks on a compilation. The
    xgrammar ``TokenizerInfo`` and ``GrammarCompiler`` are built by the first
    task on the worker thread (``threads`` workers; compilation itself is C++
    and may use a few more threads inside xgrammar).

    Two lanes, each with its own compiler: grammars of at most `SMALL_GRAMMAR_CHARS`
    characters compile on a thread of their own, so that one client's large grammars
    never queue a small one behind them; a large one compiles once it compiled within
    ``limits.max_compile_s`` in a child process (`CompileCanary`), so it holds its lane
    for at most that long before it is refused.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = 128,
        threads: int = 1,
        limits: Optional[GrammarLimits] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = max(int(cache_size), 1)
        self._pool = ThreadPoolExecutor(max_workers=max(int(threads), 1), thread_name_prefix="radixrt-grammar")
        self._small_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixrt-grammar-small")
        self._cache: "OrderedDict[GrammarKey, Future]" = OrderedDict()
        self._lock = threading.Lock()
        self._info: Any = None
        self._compilers: dict[bool, Any] = {}  # per lane (small or not)
        self._compiler_lock = threading.Lock()
        self._canary: Optional[CompileCanary] = None  # the large lane's trial compilations
        self.compilations = 0  # grammars compiled (cache misses)

    def _get_compiler(self, small: bool) -> Any:
        with self._compiler_lock:
            if small not in self._compilers:
                import xgrammar as xgr

                if self._info is None:
                    self._info = xgr.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                    )
                inner = max(1, min(4, (os.cpu_count() or 2) // 2))
                # Our LRU of futures is the cache; xgrammar's own would hold a second copy.
                self._compilers[small] = xgr.GrammarCompiler(self._info, max_threads=inner, cache_enabled=False)
            return self._compilers[small]

    def _compile(self, key: GrammarKey, small: bool) -> Any:
        grammar = _parse(key, self.limits)  # checked again: nothing unbounded is compiled here
        compiler = self._get_compiler(small)
        if not small:
            self._canary_of().check(grammar)
        compiled = compiler.compile_grammar(grammar)
        self.compilations += 1
        return compiled

    def _canary_of(self) -> CompileCanary:
        """The large lane's trials (`CompileCanary`), made on first use (after a compiler: it needs
        the vocabulary's ``TokenizerInfo``)."""
        with self._compiler_lock:
            if self._canary is None:
                self._canary = CompileCanary(self._info, self.limits.max_compile_s)
            return self._canary

    def compile_async(self, key: GrammarKey) -> Future:
        """The future of ``key``'s CompiledGrammar (an existing one when cached or
        in progress). A failed compilation's future holds the exception."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            small = len(key[1]) <= SMALL_GRAMMAR_CHARS
            fut = (self._small_pool if small else self._pool).submit(self._compile, key, small)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # holders of an evicted future keep it alive
            return fut

    def new_state(self, compiled: Any) -> "GrammarState":
        """A fresh matcher for one request."""
        return GrammarState(compiled, self.vocab_size, self._encode)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def shutdown(self) -> None:
        for pool in (self._pool, self._small_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        if self._canary is not None:
            self._canary.close()


class GrammarState:
    """One request's position in its grammar, plus its pending draft.

    The matcher has accepted every token of the request's verified output and,
    while a draft is pending, the draft's tokens too (``draft_len`` of them).
    ``draft_masks[j]`` is the bitmask row for the position of draft token
    ``j`` (the state before accepting it); the row after the whole draft is
    filled at sampling time by ``fill_mask``. Used from the scheduler thread only.
    """

    def __init__(self, compiled: Any, vocab_size: int, encode: Callable[[str], list[int]]) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._encode = encode
        self.draft_len = 0
        self.draft_masks: Any = None

    def fork(self) -> "GrammarState":
        """An independent copy at the same position (a beam search's new branch);
        it holds no draft."""
        assert self.draft_len == 0, "a state with a pending draft is not forked"
        twin = GrammarState.__new__(GrammarState)
        twin.matcher = self.matcher.fork()
        twin.vocab_size = self.vocab_size
        twin._encode = self._encode
        twin.draft_len = 0
        twin.draft_masks = None
        return twin

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens of the current state into ``bitmask[row]``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False when the grammar rejects it."""
        return self.matcher.accept_token(int(token))

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self.matcher.is_terminated()

    def propose_draft(self, max_tokens: int) -> list[int]:
        """Tokens of the continuation the grammar forces from here, at most
        ``max_tokens`` (empty when the next token is the model's choice).

        The matcher accepts them (``draft_len`` steps) and ``draft_masks`` holds
        one bitmask row per draft position. The forced text is tokenized by the
        tokenizer on its own (the encoding the model is used to); when the
        tokenizer's first token does not fit (e.g. a SentencePiece tokenizer
        prepending a space), xgrammar's vocabulary-greedy tokenization is used."""
        assert self.draft_len == 0, "a draft is already pending"
        if max_tokens <= 0 or self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        # A forced string is bounded (grammar_bounds.py) but may still be far longer than the
        # draft: tokenize only what max_tokens can hold.
        draft = self.take_draft(self._encode(text[: max_tokens * MAX_DRAFT_CHARS_PER_TOKEN])[:max_tokens])
        if not draft:
            draft = self.take_draft(self.matcher.find_jump_forward_tokens()[:max_tokens])
        return draft

    def take_draft(self, tokens: list[int]) -> list[int]:
        """Accept the longest prefix of ``tokens`` the grammar allows as the
        pending draft, recording each position's mask; returns that prefix (a
        speculative draft pruned by the grammar, or a jump-forward one)."""
        assert self.draft_len == 0, "a draft is already pending"
        if not tokens:
            return []
        masks = new_bitmask(len(tokens), self.vocab_size)
        taken: list[int] = []
        for j, t in enumerate(tokens):
            self.matcher.fill_next_token_bitmask(masks, j)
            if not (0 <= t < self.vocab_size) or not self.matcher.accept_token(int(t)):
                break
            taken.append(int(t))
        self.draft_len = len(taken)
        self.draft_masks = masks[: len(taken)] if taken else None
        return taken

    def settle_draft(self, kept: int) -> None:
        """Keep the first ``kept`` draft tokens (they join the output) and roll the
        matcher back over the rest. Ends the pending draft."""
        assert 0 <= kept <= self.draft_len
        if kept < self.draft_len:
            self.matcher.rollback(self.draft_len - kept)
        self.draft_len = 0
        self.draft_masks = None
