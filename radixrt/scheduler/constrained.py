"""Constrained decoding inside the step loop (grammars in radixrt/sampling/grammar.py).

A request with a regex, JSON schema or EBNF grammar waits in the queue until
its grammar is compiled (on the grammar backend's thread; other requests keep
running), then carries an xgrammar matcher that has accepted every output
token. Every step the constrained rows get their token bitmask. With
``enable_jump_forward`` the text the grammar forces next is appended as a
draft: the next step computes it in one extend and verifies it position by
position (results.py), so outputs equal token-by-token decoding.

Constrained requests need each sampled token on the host before their next
step's mask, so a batch holding one is never overlapped with the next.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Optional

import torch

from radixrt.requests.finish import FinishReason
from radixrt.sampling.grammar import GrammarBackend, grammar_key, new_bitmask
from radixrt.sampling.grammar_bounds import GrammarLimits
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.request import Req

MAX_DRAFT_TOKENS = 256  # longest jump-forward draft appended at once
GRAMMAR_WAIT_S = 0.01  # idle wait for a compiling grammar when nothing else can run


def drop_draft(req: Req) -> None:
    """Forget a request's draft (it has no KV yet); a grammar's matcher rolls back over it."""
    if req.draft_ids:
        assert len(req.slots) <= len(req.input_ids) + len(req.output_ids), "dropping a computed draft"
        if req.grammar is not None:
            req.grammar.settle_draft(0)
        if req.spec is not None:
            req.spec.cancel()
        req.draft_ids = []


class ConstrainedDecoding:
    """The grammar backend (created on first use) and the step loop's use of it:
    matchers for compiled grammars, jump-forward drafts, token bitmasks."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        limits: GrammarLimits,
        cache_size: int,
        enable_jump_forward: bool,
        context_length: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._limits = limits
        self._cache_size = cache_size
        self._grammars: Optional[GrammarBackend] = None
        self.enable_jump_forward = enable_jump_forward
        self.context_length = context_length
        self.vocab_size = vocab_size
        # draft tokens proposed by jump-forward, and kept after verification
        # (each kept token is a decode step saved)
        self.proposed = 0
        self.kept = 0

    @property
    def grammars(self) -> GrammarBackend:
        """The grammar compiler and cache, created on first use."""
        if self._grammars is None:
            self._grammars = GrammarBackend(
                self._tokenizer, self.vocab_size, self._eos_token_ids, cache_size=self._cache_size, limits=self._limits
            )
        return self._grammars

    def compile(self, sampling: SamplingParams) -> Optional[concurrent.futures.Future]:
        """The future of ``sampling``'s compiled grammar (compiling on the backend's
        thread), or None for an unconstrained request."""
        key = grammar_key(sampling)
        return self.grammars.compile_async(key) if key is not None else None

    def shutdown(self) -> None:
        """Stop the grammar compilation thread, if it was ever started."""
        if self._grammars is not None:
            self._grammars.shutdown()

    def resolve(self, waiting: list[Req]) -> list[tuple[Req, FinishReason]]:
        """Give waiting requests whose grammar finished compiling their matcher
        (and, with jump-forward, the draft forced at the start). Returns the
        requests whose grammar failed to compile, each with the error that ends
        it; they are left in ``waiting``."""
        failed = []
        done = [(r, f) for r in waiting if r.grammar is None and (f := r.grammar_future) is not None and f.done()]
        for req, future in done:
            try:
                compiled = future.result()
            except Exception as e:  # noqa: BLE001 - reported to the client, never raised here
                key = grammar_key(req.sampling)
                failed.append(
                    (
                        req,
                        FinishReason.abort(
                            f"the {key[0] if key else 'constrained'} grammar failed to compile: {e}", status_code=400
                        ),
                    )
                )
                continue
            req.grammar = self.grammars.new_state(compiled)
            if self.enable_jump_forward and not req.output_ids and req.beam is None:  # beams score every token
                self.propose_draft(req)
        return failed

    @staticmethod
    def wait(waiting: list[Req]) -> None:
        """Nothing can run: sleep until a compiling grammar is done (or briefly)."""
        compiling = [f for r in waiting if r.grammar is None and (f := r.grammar_future) is not None]
        if compiling:
            concurrent.futures.wait(compiling, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def propose_draft(self, req: Req) -> None:
        """Append the continuation the grammar forces as a draft (none when the
        next token is free), bounded by max_new_tokens and the context length."""
        limit = min(
            req.sampling.max_new_tokens - len(req.output_ids) - 1,  # the step's own token comes after it
            self.context_length - 1 - req.seq_len,
            MAX_DRAFT_TOKENS if req.draft_limit is None else req.draft_limit,
        )
        assert req.grammar is not None, "only a constrained request has a draft"
        req.draft_ids = req.grammar.propose_draft(limit)
        self.proposed += len(req.draft_ids)

    @staticmethod
    def next_draft_limit(req: Req, proposed: int, kept: int) -> None:
        """Adapt ``req``'s next draft to how the last one fared: a draft whose
        tokenization the model does not follow (forced text it would spell with
        other tokens) costs a long extend per step for one kept token, so a
        rejected draft shrinks the next one to what was kept (at least 1) and a
        draft kept whole doubles it, up to MAX_DRAFT_TOKENS. Outputs do not
        depend on it: drafts are verified."""
        if kept < proposed:
            req.draft_limit = max(1, kept)
        else:
            req.draft_limit = min(MAX_DRAFT_TOKENS, 2 * max(proposed, req.draft_limit or 0))

    def bitmask(self, masked: list[tuple[Req, int]]) -> Optional[torch.Tensor]:
        """Token bitmasks of the constrained rows, one per (request, draft position)."""
        if not masked:
            return None
        bitmask = new_bitmask(len(masked), self.vocab_size)
        for i, (req, j) in enumerate(masked):
            assert req.grammar is not None, "masked rows are constrained requests' rows"
            if j < len(req.draft_ids):
                bitmask[i] = req.grammar.draft_masks[j]
            else:
                req.grammar.fill_mask(bitmask, i)  # the matcher's current state: after the draft
        return bitmask
