"""What the scheduler may do with a model whose positions are rotated by frequencies chosen from
the sequence's length (RoPE ``dynamic`` NTK and ``longrope``).

Such a model rotates a key by the frequencies of the sequence's length when the key is computed:
in transformers one forward of the whole prompt, then one token a step. KV computed for a shorter
sequence (a cached prefix another request left, an earlier chunk of the same prompt, a verified
draft or a jump-forward run of several tokens) is rotated otherwise, and the answer changes with
what happened to be cached (by up to 1 nat of logprob in a test). For these models the prefix
cache is off, a prompt is computed in one step, jump-forward is off, and speculative decoding is
refused: the answers are then transformers' whatever runs beside them.
"""

from __future__ import annotations

import logging
from typing import Any

from radixrt.config import EngineConfig
from radixrt.executor.models.rope import LENGTH_DEPENDENT

logger = logging.getLogger(__name__)


def rope_settings(rope_type: str) -> dict[str, Any]:
    """The flat settings a model of ``rope_type`` is served with whatever was configured (none
    for most), as ``/get_server_info`` reports them."""
    if rope_type not in LENGTH_DEPENDENT:
        return {}
    return {
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "long_prefill_token_threshold": 0,
        "enable_jump_forward": False,
    }


def fit_to_rope(config: EngineConfig, rope_type: str) -> EngineConfig:
    """``config`` as the scheduler may run a model of ``rope_type`` (unchanged for the others);
    ValueError where it asks for what cannot compose (speculative decoding)."""
    settings = rope_settings(rope_type)
    if not settings:
        return config
    if config.speculative.enabled:
        raise ValueError(
            f"speculative decoding cannot serve a model with {rope_type!r} RoPE scaling: its frequencies follow "
            "the sequence's length, so a draft verified in one step would be rotated otherwise than decoded"
        )
    logger.warning(
        "%r RoPE scaling rotates keys by the sequence's length when they are computed: the prefix cache, "
        "chunked prefill and jump-forward are off so that answers do not depend on what is cached",
        rope_type,
    )
    return EngineConfig(**{**config.to_flat(), **settings})
