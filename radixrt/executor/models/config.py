"""What the model code needs to know about a Hugging Face checkpoint."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

# either allows a context_length past the checkpoint's (ours, SGLang's)
LONGER_CONTEXT_ENV = ("RADIXRT_ALLOW_LONGER_CONTEXT", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")

# Architectures served by `radixrt.executor.models.llama.LlamaForCausalLM` (one class, config flags).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)
    o_proj_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Sliding-window attention of the checkpoint (Mistral; Qwen2/3 with use_sliding_window).
    # Not implemented by the attention backends: attention is full-causal, which equals the
    # sliding-window model only while sequences are no longer than the window (the context's cap).
    sliding_window: Optional[int] = None
    hf_config: Any = None

    def keys_per_dense_token(self) -> int:
        """Cached keys whose attention costs a token what its dense products do (multiply-adds
        of the layers' projections and MLP against those of attending one key), so a prompt
        token over ``c`` cached keys costs about ``1 + c / this`` tokens with none: 3,072 for
        SmolLM2-135M, about 26,600 for Llama-3-8B."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        dense = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
        return max(1, dense // (2 * q))

    def trained_context_length(self) -> int:
        """The longest sequence the checkpoint was made for: ``max_position_embeddings``, times the
        RoPE scaling factor where the config scales past it (SGLang's derived context length: not
        for ``llama3`` scaling or one that names its ``original_max_position_embeddings``, whose
        ``max_position_embeddings`` is already the scaled length)."""
        from radixrt.executor.models.rope import rope_parameters

        rope = rope_parameters(self.hf_config) if self.hf_config is not None else {}
        factor = rope.get("factor") or 1
        if "original_max_position_embeddings" in rope or rope.get("rope_type", rope.get("type")) == "llama3":
            factor = 1
        return int(self.max_position_embeddings * factor)

    def check_context_length(self, asked: Optional[int]) -> int:
        """The context length to serve: ``asked`` (default: `trained_context_length`, or the sliding
        window where the checkpoint has one: attention here is full-causal). Longer than that
        is a ValueError unless ``RADIXRT_ALLOW_LONGER_CONTEXT=1`` (or SGLang's
        ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``): positions it never saw give wrong outputs."""
        trained = self.trained_context_length()
        if self.sliding_window and self.sliding_window < trained:
            trained = self.sliding_window  # attention here is full-causal: the model's only up to its window
            if asked is None:
                logger.warning(
                    "the model attends through a sliding window of %d tokens, which radixrt does not implement: "
                    "the context is capped at the window (full attention equals it there)",
                    trained,
                )
        if asked is None or asked <= trained:
            return asked or trained
        if any(os.environ.get(v, "") in ("1", "true", "True") for v in LONGER_CONTEXT_ENV):
            return asked
        raise ValueError(
            f"context_length {asked} is longer than the model's {trained} (max_position_embeddings in its "
            "config.json, with its RoPE scaling, or its sliding attention window, which radixrt's full "
            "attention equals only within the window): past it outputs are wrong. Set "
            f"{LONGER_CONTEXT_ENV[0]}=1 to serve it anyway."
        )

    @classmethod
    def from_pretrained(cls, path: str, overrides: Optional[dict[str, Any]] = None) -> "ModelConfig":
        """Read ``path/config.json`` (and ``generation_config.json`` for extra eos ids), its top-level
        fields replaced by ``overrides`` (SGLang's ``--json-model-override-args``).
        A plain config (`PlainHFConfig.read`) is read as JSON; any other through
        transformers' ``AutoConfig`` (whose import costs about 2 s of start-up)."""
        path = str(path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path!r} is not a model folder: it has no config.json")
        hf_config: Any = PlainHFConfig.read(os.path.join(path, "config.json"), overrides)
        if hf_config is None:
            from transformers import AutoConfig

            if overrides:  # the merged dict (`with_overrides`): transformers' own merge drops rope_theta
                with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                    hf_config = AutoConfig.for_model(**with_overrides(json.load(f), overrides))
            else:
                hf_config = AutoConfig.from_pretrained(path)
        extra_eos: list[int] = []
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                extra_eos = _as_id_list(json.load(f).get("eos_token_id"))
        return cls.from_hf_config(hf_config, extra_eos_token_ids=extra_eos)

    @classmethod
    def from_hf_config(cls, hf_config: Any, extra_eos_token_ids: Optional[list[int]] = None) -> "ModelConfig":
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        model_type = getattr(hf_config, "model_type", None)
        if not archs:  # config.json without "architectures": go by model_type
            arch = _BY_MODEL_TYPE.get(model_type or "")
        if arch is None:
            found = ", ".join(archs) if archs else f"none listed (model_type {model_type!r})"
            raise ValueError(
                f"unsupported model architecture: {found}. radixrt supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        c = hf_config
        num_heads = int(c.num_attention_heads)
        num_kv_heads = int(getattr(c, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // num_heads)
        attention_bias = bool(getattr(c, "attention_bias", False))
        o_proj_bias = attention_bias  # Llama/Qwen3 put `attention_bias` on all four projections
        if arch == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False
        eos = _as_id_list(getattr(c, "eos_token_id", None))
        for e in extra_eos_token_ids or []:
            if e not in eos:
                eos.append(e)
        sliding_window = getattr(c, "sliding_window", None) if _slides(c, arch) else None
        return cls(
            architecture=arch,
            hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size),
            num_layers=int(c.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=int(c.vocab_size),
            rms_norm_eps=float(c.rms_norm_eps),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=int(c.max_position_embeddings),
            eos_token_ids=eos,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            hidden_act=str(getattr(c, "hidden_act", "silu")),
            sliding_window=int(sliding_window) if sliding_window else None,
            hf_config=hf_config,
        )


def architecture_differences(served: ModelConfig, other: ModelConfig) -> str:
    """What differs between two checkpoints' configs, beyond their weights ("" when
    nothing: the second can replace the first's weights in a running server): the
    `ModelConfig` fields and the rotary embedding's parameters."""
    from radixrt.executor.models.rope import rope_parameters

    def described(c: ModelConfig) -> dict[str, Any]:
        fields = {f: v for f, v in vars(c).items() if f != "hf_config"}
        given = rope_parameters(c.hf_config) if c.hf_config is not None else {}
        rope = {k: v for k, v in given.items() if v is not None}
        rope.setdefault("rope_type", rope.pop("type", "default"))  # JSON read plainly or by transformers alike
        rope.setdefault("partial_rotary_factor", getattr(c.hf_config, "partial_rotary_factor", None) or 1.0)
        return {**fields, "rope": rope}

    a, b = described(served), described(other)
    return ", ".join(f"{f} {b[f]!r} (served: {a[f]!r})" for f in a if a[f] != b[f])


def _slides(c: Any, arch: str) -> bool:
    """Whether some layer of the checkpoint attends through a sliding window (Mistral's every
    layer; Qwen2/3's from ``max_window_layers`` on, with ``use_sliding_window``)."""
    layer_types = getattr(c, "layer_types", None)
    if layer_types:
        return "sliding_attention" in layer_types
    if arch == "MistralForCausalLM":
        return True
    layers = int(getattr(c, "num_hidden_layers", 0))
    return bool(getattr(c, "use_sliding_window", False)) and int(getattr(c, "max_window_layers", 0)) < layers


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A config.json's fields ``raw`` with ``overrides``' top-level fields in their place. A
    ``rope_scaling`` override (the older key, which SGLang's examples use) on a config that holds
    ``rope_parameters`` replaces them, keeping the config's ``rope_theta`` unless it gives one."""
    out = {**raw, **overrides}
    params = raw.get("rope_parameters")
    if "rope_scaling" in overrides and "rope_parameters" not in overrides and isinstance(params, dict):
        scaling = overrides["rope_scaling"]
        out["rope_parameters"] = {
            "rope_theta": params.get("rope_theta"),
            **(scaling if isinstance(scaling, dict) else {}),
        }
        out.pop("rope_scaling")
    return out


class PlainHFConfig:
    """A checkpoint's ``config.json`` as attributes, for the configs that need
    nothing from transformers' config classes: a supported ``model_type``,
    every size given, and rotary embeddings of a type in `ROPE_KEYS` with every
    parameter of that type given (Llama 3.x checkpoints' ``llama3`` scaling
    included). Anything else (other RoPE scalings, missing fields that
    transformers would default) goes through ``AutoConfig``, so both give the
    model the same numbers. A scaled RoPE's parameters are kept in the
    standard form (``rope_parameters`` with ``rope_type`` and ``rope_theta``),
    which transformers' RoPE functions read."""

    # RoPE types read as JSON -> the parameters each needs besides rope_type and rope_theta
    ROPE_KEYS: dict[str, frozenset[str]] = {
        "default": frozenset(),
        "linear": frozenset({"factor"}),
        "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    }

    REQUIRED = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
    )

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = raw
        self.__dict__.update(raw)

    @classmethod
    def read(cls, config_json: str, overrides: Optional[dict[str, Any]] = None) -> Optional["PlainHFConfig"]:
        with open(config_json, encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or raw.get("model_type") not in _BY_MODEL_TYPE:
            return None
        raw = with_overrides(raw, overrides or {})
        if any(raw.get(k) is None for k in cls.REQUIRED) or "eos_token_id" not in raw:
            return None  # transformers' classes would fill in defaults (LlamaConfig's eos_token_id is 2)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            return None
        kind = rope.get("rope_type", rope.get("type", "default"))
        needed = cls.ROPE_KEYS.get(kind) if isinstance(kind, str) else None
        if needed is None or set(rope) - {"rope_type", "type", "rope_theta"} != needed:
            return None
        if kind != "default":
            theta = rope.get("rope_theta", raw.get("rope_theta"))
            if not isinstance(theta, (int, float)) or isinstance(theta, bool):
                return None
            params = {"rope_type": kind, **{k: rope[k] for k in sorted(needed)}, "rope_theta": theta}
            raw = {**raw, "rope_parameters": params}
            raw.pop("rope_scaling", None)
        return cls(raw)

    def standardize_rope_params(self) -> None:
        """transformers' RoPE functions call this on their config: `read` already did it."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self._raw)
