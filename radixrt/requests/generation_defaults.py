"""A model's preferred sampling settings: the ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty`` its ``generation_config.json`` holds (Qwen3's, say: 0.6, 0.95, 20).

SGLang (``--sampling-defaults model``, its default) and vLLM (``--generation-config auto``) apply
them to OpenAI-route requests that leave the field unset, and so does ``radixrt serve``
(`radixrt.server.openai_checks.sampling_of`); ``--sampling-defaults openai`` keeps OpenAI's
defaults (temperature 1, no top-k) instead. ``/generate`` and the Engine take SGLang's native
defaults, as SGLang's do."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from radixrt.sampling.params import SamplingParams

KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling settings ``model_dir/generation_config.json`` holds ({} without the file);
    ValueError naming the file where they are not valid sampling parameters."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    found = {k: config[k] for k in KEYS if isinstance(config, dict) and config.get(k) is not None}
    if found.get("top_k") == 0:  # transformers' and vLLM's "no top-k"
        del found["top_k"]
    try:
        SamplingParams.from_dict(dict(found))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{path} holds sampling settings that are not valid ({e}); serve with "
            "--sampling-defaults openai to leave them out"
        ) from None
    return found


def fill_unset(asked: dict, defaults: Optional[dict]) -> dict:
    """``asked`` (a request's sampling parameters) with ``defaults`` filling the fields it leaves
    out; a field it gives wins whatever its value, as SGLang merges them. A beam search
    (``beam_width`` above 1) takes none: it samples nothing."""
    if not defaults or (asked.get("beam_width") or 1) > 1:
        return asked
    return {**defaults, **asked}


def parse_preferred(text: Optional[str]) -> Optional[dict]:
    """SGLang's ``--preferred-sampling-params``: a JSON object of sampling parameters (None: unset);
    ValueError naming the flag where it is not one, or holds a field or value a request could not give."""
    if text is None:
        return None
    try:
        preferred = json.loads(text)
    except ValueError as e:
        raise ValueError(f"preferred_sampling_params is not JSON: {e}") from None
    if not isinstance(preferred, dict):
        raise ValueError("preferred_sampling_params must be a JSON object of sampling parameters")
    try:
        SamplingParams.from_dict(dict(preferred))
    except (TypeError, ValueError) as e:
        raise ValueError(f"preferred_sampling_params: {e}") from None
    return preferred
