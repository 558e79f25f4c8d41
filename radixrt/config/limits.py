"""`LimitSettings`: what one request may ask for (the checks themselves:
radixrt/requests/intake.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import setting
from radixrt.requests.generation_defaults import parse_preferred
from radixrt.requests.intake import (
    DEFAULT_MAX_CLIENT_PRIORITY,
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_SEQUENCES,
    DEFAULT_MAX_TOP_LOGPROBS_NUM,
    Limits,
)
from radixrt.sampling.grammar_bounds import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_COMPILE_S,
    DEFAULT_MAX_REPEAT,
    DEFAULT_MAX_SOURCE_CHARS,
    GrammarLimits,
)


@dataclass(frozen=True)
class LimitSettings:
    """What one request may ask for: beyond these it is refused (400) on every route and by the Engine."""

    max_n: int = setting(
        DEFAULT_MAX_N,
        "most samples of one prompt (sampling param n) a request may ask for, on "
        "every route (/generate, the OpenAI routes, the Engine); more is refused "
        "(400)",
    )
    max_top_logprobs_num: int = setting(
        DEFAULT_MAX_TOP_LOGPROBS_NUM,
        "most top logprobs per position a request may ask for (top_logprobs_num on "
        "/generate and the Engine, logprobs / top_logprobs on the OpenAI routes); "
        "more is refused (400)",
    )
    max_client_priority: int = setting(
        DEFAULT_MAX_CLIENT_PRIORITY,
        "largest 'priority' a request may give, in absolute value: a value outside "
        "[-N, N] is refused (400 naming 'priority'), except for a request presenting "
        "--admin-api-key (any 64-bit integer); the Engine's caller is held to it",
    )
    max_request_sequences: int = setting(
        DEFAULT_MAX_REQUEST_SEQUENCES,
        "most sequences one call may start: the sum over its prompts of n (or of the beam "
        "width, when larger), on every route and the Engine; more is refused (400) before "
        "the prompts are tokenized",
    )
    allow_auto_truncate: bool = setting(
        False,
        "SGLang's: a prompt longer than the context keeps its first tokens (one fewer than the context "
        "holds) and a max_new_tokens past the context is cut to what fits, instead of a 400; on every "
        "route and the Engine (vLLM's truncate_prompt_tokens keeps a prompt's last tokens instead)",
    )
    preferred_sampling_params: Optional[str] = setting(
        None,
        'SGLang\'s: a JSON object of sampling parameters (e.g. \'{"temperature": 0.6, "top_p": 0.95}\') that '
        "fill what a request's sampling parameters leave out, on every route and the Engine (a field the request "
        "gives wins; a beam search takes none); /get_model_info shows them. On the OpenAI routes they also win "
        "over the model's generation_config.json (--sampling-defaults model); unset: none",
    )
    enable_return_hidden_states: bool = setting(
        False,
        "let requests ask for their final hidden states (SGLang's return_hidden_states on "
        "/generate and the Engine: meta_info.hidden_states); such a request computes its whole "
        "prompt itself and its rows wait on the scheduler until it ends (default off: a 400)",
    )
    grammar_max_chars: int = setting(
        DEFAULT_MAX_CHARS,
        "refuse (400) a regex, JSON schema or grammar whose shortest instance, or any part's, "
        "is longer than this many characters, or that has no finite instance (a schema that "
        "requires itself): bounds jump-forward searches",
    )
    grammar_max_repeat: int = setting(
        DEFAULT_MAX_REPEAT,
        "refuse (400) a grammar with a counted repetition ({m,n}, minLength, maxItems, ...) "
        "above this: bounds grammar compilation",
    )
    grammar_max_source_chars: int = setting(
        DEFAULT_MAX_SOURCE_CHARS,
        "refuse (400) a regex, JSON schema, grammar or tool set's structural tag longer than "
        "this many characters: bounds parsing it (a few seconds a million characters)",
    )
    grammar_max_compile_s: float = setting(
        DEFAULT_MAX_COMPILE_S,
        "refuse (400) a grammar longer than 4,096 characters that does not compile within this "
        "many seconds: it is first compiled in a child process, killed at the deadline "
        "(compilation time follows a grammar's structure, e.g. a JSON schema's optional properties)",
    )

    def __post_init__(self) -> None:
        if self.max_n < 1 or self.max_request_sequences < 1:
            raise ValueError("max_n and max_request_sequences must be >= 1")
        if self.max_top_logprobs_num < 0:
            raise ValueError("max_top_logprobs_num must be >= 0")
        if not 0 <= self.max_client_priority < 2**62:
            raise ValueError("max_client_priority must be in [0, 2**62)")
        if min(self.grammar_max_chars, self.grammar_max_repeat, self.grammar_max_source_chars) < 1:
            raise ValueError("grammar_max_chars, grammar_max_repeat and grammar_max_source_chars must be >= 1")
        if not self.grammar_max_compile_s > 0:
            raise ValueError("grammar_max_compile_s must be > 0")
        parse_preferred(self.preferred_sampling_params)

    def for_runtime(
        self, context_length: int, kv_total_slots: int, vocab_size: int, hidden_size: int = 0, text: bool = True
    ) -> Limits:
        """The front door's `Limits` for a runtime of these sizes under these settings (``text``: it has a
        tokenizer)."""
        return Limits(
            context_length,
            kv_total_slots,
            vocab_size,
            text=text,
            auto_truncate=self.allow_auto_truncate,
            preferred_sampling=parse_preferred(self.preferred_sampling_params),
            max_n=self.max_n,
            max_request_sequences=self.max_request_sequences,
            max_top_logprobs_num=self.max_top_logprobs_num,
            max_client_priority=self.max_client_priority,
            return_hidden_states=self.enable_return_hidden_states,
            hidden_size=hidden_size,
            grammar=GrammarLimits(
                self.grammar_max_chars,
                self.grammar_max_repeat,
                self.grammar_max_source_chars,
                self.grammar_max_compile_s,
            ),
        )
