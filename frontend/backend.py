"""The backend interface the interpreter talks to.

A backend turns a program state's text (or messages) plus sampling
parameters into completions, scores choices for ``select``, and optionally
prefills a prefix into its cache. The interpreter only calls the methods
below; everything model-specific lives behind them.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from .choices import ChoicesDecision
from .sampling_params import SglSamplingParams

# Role markers when the model has no chat template (kept in step with radixrt/requests/chat_roles.py).
PLAIN_ROLE_MARKERS: dict[str, tuple[str, str]] = {
    "system": ("System: ", "\n"),
    "user": ("User: ", "\n"),
    "assistant": ("Assistant: ", "\n"),
}


def normalize_markers(raw: Any) -> Optional[dict[str, tuple[str, str]]]:
    """Accept ``{role: (prefix, suffix)}`` or ``{role: [prefix, suffix]}`` (JSON)."""
    if not isinstance(raw, dict):
        return None
    out = {}
    for role in ("system", "user", "assistant"):
        v = raw.get(role)
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            return None
        out[role] = (str(v[0]), str(v[1]))
    return out


class BaseBackend:
    """Interface of frontend backends."""

    #: True when the backend consumes chat messages rather than raw text.
    is_chat_model: bool = False
    #: True when image/video expressions can be sent.
    supports_images: bool = False

    # --- chat template --------------------------------------------------------
    def get_role_markers(self) -> dict[str, tuple[str, str]]:
        return dict(PLAIN_ROLE_MARKERS)

    def get_default_system_prompt(self) -> Optional[str]:
        return None

    # --- requests ---------------------------------------------------------------
    def generate(self, s: Any, sampling: SglSamplingParams) -> tuple[Any, Any]:
        """Complete ``s.text_``. Returns ``(text, meta_info)``; with ``n > 1``,
        ``(list_of_texts, list_of_meta_infos)``."""
        raise NotImplementedError

    def generate_stream(self, s: Any, sampling: SglSamplingParams) -> Iterator[tuple[str, dict]]:
        """Yield ``(cumulative_text, meta_info_so_far)`` while generating."""
        text, meta = self.generate(s, sampling)
        yield text, meta

    def select(
        self, s: Any, choices: list[str], temperature: float, choices_method: Any, lora: Optional[str] = None
    ) -> ChoicesDecision:
        """The choice ``choices_method`` picks from the scores of ``choices`` after the program's text;
        ``lora``: the LoRA adapter that scores them (a backend without adapters refuses one)."""
        raise NotImplementedError

    def cache_prefix(self, prefix: str) -> None:
        """Prefill ``prefix`` so that later requests starting with it hit the cache."""

    # --- admin --------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass
