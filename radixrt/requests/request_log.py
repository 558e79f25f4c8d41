"""SGLang's ``--log-requests``: one INFO line when a request is received and one when each of
its samples ends, on the ``radixrt.request_log`` logger (shown at any ``--log-level``).

``level`` (``--log-requests-level``, SGLang's meanings): 0, the metadata (the client's rid, token
counts, the finish reason, the latency); 1, also the sampling parameters the request set; 2 (the
default), also the prompt and the output, each cut to its first `PARTIAL_CHARS` characters; 3,
the whole texts. Texts, rids and parameters are written as JSON strings, so a newline or an
escape sequence sent by a client cannot forge a line of the log.

The lines name the client's rid (``rid`` of the request, or the one assigned), as the answers do:
an operator can find a client's complaint in the log; a received line also gives the request's
internal id, which the scheduler's warnings name. Decoding is bounded: level 2 decodes at
most `PARTIAL_CHARS` tokens of a prompt (none shorter than a character)."""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from radixrt.requests.intake import RequestSpec
from radixrt.requests.no_tokenizer import has_text
from radixrt.requests.rids import RidEntry
from radixrt.requests.router import ReqState, ResultObserver
from radixrt.sampling.params import SamplingParams

logger = logging.getLogger("radixrt.request_log")  # not radixrt.requests: its INFO level would reach every module's

DEFAULT_LEVEL = 2
PARTIAL_CHARS = 2048  # level 2 cuts each text to this many characters
_DEFAULTS: Optional[dict[str, Any]] = None


def set_sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The sampling parameters that differ from their defaults (what the request set)."""
    global _DEFAULTS
    if _DEFAULTS is None:
        _DEFAULTS = SamplingParams().to_dict()
    return {k: v for k, v in sampling.to_dict().items() if v != _DEFAULTS.get(k)}


class RequestLog(ResultObserver):
    """Logs each request as it is received and each sample as it ends (see the module docstring)."""

    def __init__(self, tokenizer: Any, level: int = DEFAULT_LEVEL) -> None:
        """``level``: 0 to 3 (checked by the config). Its lines show at any log level: the
        ``radixrt.request_log`` logger is set to INFO."""
        self.tokenizer = tokenizer
        self.level = level
        logger.setLevel(logging.INFO)

    def _quoted(self, text: str) -> str:
        """``text`` as a JSON string, cut at level 2 (a cut text ends in "...(N more characters)")."""
        if self.level < 3 and len(text) > PARTIAL_CHARS:
            return json.dumps(text[:PARTIAL_CHARS]) + f"...({len(text) - PARTIAL_CHARS} more characters)"
        return json.dumps(text)

    def _prompt_text(self, ids: list[int]) -> str:
        shown = ids if self.level >= 3 else ids[:PARTIAL_CHARS]
        return self.tokenizer.decode(shown, skip_special_tokens=False)

    def _texts(self, name: str, text: str, ids: list[int]) -> str:
        """``name=<text>``, or without a tokenizer (``--skip-tokenizer-init``) ``name_ids=<ids>``."""
        if has_text(self.tokenizer):
            return f"{name}={self._quoted(text)}"
        return f"{name}_ids={self._quoted(json.dumps(ids))}"

    def on_submit(self, spec: RequestSpec, entry: RidEntry) -> None:
        # the internal id is the one the scheduler's own warnings name
        parts = [f"rid={json.dumps(entry.rid)}", f"id={entry.iid}", f"prompt_tokens={len(spec.input_ids)}"]
        if entry.n > 1:
            parts.append(f"n={entry.n}")
        if spec.lora is not None:
            parts.append(f"lora={json.dumps(spec.lora)}")
        if self.level >= 1:
            parts.append(f"sampling={self._quoted(json.dumps(set_sampling_fields(spec.sampling), default=str))}")
        if self.level >= 2:
            parts.append(self._texts("prompt", self._prompt_text(spec.input_ids), spec.input_ids))
        logger.info("Receive: %s", " ".join(parts))

    def on_finish(self, st: ReqState, now: float, inflight: int) -> None:
        acc = st.acc
        fr = acc.finish_reason
        finish = fr.type if fr is not None else ("error" if st.error else "abort")
        parts = [
            f"rid={json.dumps(acc.rid)}",
            f"finish={finish}",
            f"prompt_tokens={acc.prompt_tokens}",
            f"completion_tokens={acc.completion_tokens}",
            f"cached_tokens={acc.cached_tokens}",
            f"e2e_latency={now - st.t_start:.3f}s",
        ]
        if fr is not None and fr.message:
            parts.append(f"message={json.dumps(fr.message)}")
        if self.level >= 2:
            parts.append(self._texts("output", acc.text, acc.output_ids))
        logger.info("Finish: %s", " ".join(parts))
