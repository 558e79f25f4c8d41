"""SGLang's launch flags that need nothing of radixrt, or ask for what it always does, taken so
that an SGLang command line (``python -m sglang.launch_server ...``) or ``sglang.Engine(**kwargs)``
works unchanged. Each says why it changes nothing here; a value radixrt cannot honour is refused.
SGLang's flags that do change something are fields of the sections they belong to
(``--model-path``, ``--tokenizer-path``, ``--chat-template``, ``--mem-fraction-static``...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import check_choice, setting

GRAMMAR_BACKENDS = ("xgrammar",)


@dataclass(frozen=True)
class SGLangFlagSettings:
    """SGLang's flags accepted for its command lines (each says why it changes nothing here)."""

    trust_remote_code: bool = setting(
        False, "SGLang's: accepted; radixrt runs Llama-family folders with its own code, never a folder's"
    )
    enable_metrics: bool = setting(False, "SGLang's: accepted; /metrics is always served")
    enable_cache_report: bool = setting(
        False, "SGLang's: accepted; usage.prompt_tokens_details.cached_tokens is always reported"
    )
    enable_mixed_chunk: bool = setting(
        False, "SGLang's: accepted; a step always runs prompt chunks beside the decoding requests"
    )
    max_prefill_tokens: Optional[int] = setting(
        None, "SGLang's: accepted; the prompt tokens of a step are bounded by --chunked-prefill-size"
    )
    grammar_backend: Optional[str] = setting(
        None, "SGLang's: the constrained-decoding backend; xgrammar is the only one; unset: xgrammar"
    )
    skip_server_warmup: bool = setting(
        False,
        "SGLang's: start without warming up; here a server's front skips parsing one grammar at start-up "
        "(loading xgrammar and torch, about 1.4 s of CPU), so the first request with a grammar pays for it",
    )

    def __post_init__(self) -> None:
        if self.grammar_backend is not None:
            check_choice("grammar_backend", self.grammar_backend, GRAMMAR_BACKENDS)
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
