"""SGLang's API speculative execution, ``@function(num_api_spec_tokens=N)``, on a completion
model's backend (``OpenAI(..., is_chat_model=False)``, a paid API that caches nothing for us).

The first ``gen`` asks for N tokens (or its own ``max_tokens`` when larger) without its stop
strings; the text up to its first stop string is the ``gen``'s value, and the rest is kept as
the *speculated text*. Constant text the program appends next consumes the speculated text while
it matches (anything that does not match drops it), and the next ``gen`` takes its value from
what is left, up to its own stop, without a call. So a template of several ``gen``s with fixed
text between them costs one API call and one prompt instead of one per ``gen``, as in SGLang.
Where no stop string is found a ``gen`` takes at most ``max_tokens`` characters (SGLang's
rule). Chat models, ``n > 1``, constraints (``regex``, ``json_schema``, ``dtype``), streaming and
every other backend (which keep the program's prefix cached) run each ``gen`` as its own call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .sampling_params import SglSamplingParams


def speculates(ex: Any, sp: SglSamplingParams) -> bool:
    """Whether this ``gen`` is served from (or starts) the speculated text."""
    plain = not (sp.regex or sp.json_schema or sp.ebnf or sp.dtype or sp.return_logprob or sp.beam_width)
    completion_api = getattr(ex.backend, "is_chat_model", True) is False
    return bool(ex.num_api_spec_tokens) and completion_api and (sp.n or 1) == 1 and plain and not ex.stream


def speculative_gen(ex: Any, sp: SglSamplingParams) -> tuple[str, Any]:
    """The ``gen``'s value from the speculated text (asking for more first when none is left)."""
    meta: Any = {}
    if not ex.speculated_text:
        wide = dataclasses.replace(sp, max_new_tokens=max(sp.max_new_tokens or 0, ex.num_api_spec_tokens), stop=None)
        ex.speculated_text, meta = ex.backend.generate(ex, wide)
    text = ex.speculated_text
    stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
    found = [at for at in (text.find(s) for s in stops if s) if at != -1]
    end = min(found) if found else min(sp.max_new_tokens or len(text), len(text))
    ex.speculated_text = text[end:]
    return text[:end], meta


def consume(ex: Any, appended: str) -> None:
    """Constant text appended to the program: it consumes the speculated text it matches."""
    spec = ex.speculated_text
    ex.speculated_text = spec[len(appended) :] if spec.startswith(appended) else ""
