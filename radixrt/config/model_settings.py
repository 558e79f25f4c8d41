"""`ModelSettings`: which model, in which dtype, with which tokenizer, how long a sequence may be
(a section of the runtime's configuration: radixrt/config/sections.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.config.fields import check_choice, setting
from radixrt.config.weight_format import (
    DEFAULT_GROUP_SIZE,
    WeightQuantization,
    check_group_size,
    normalize_method,
)
from radixrt.requests.named_chat_templates import NAMED_CHAT_TEMPLATES
from radixrt.requests.tokenizer_utils import is_inline_template

# SGLang's (and transformers') other names of the dtypes
DTYPE_SPELLINGS = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # SGLang's names for what radixrt's loader does


@dataclass(frozen=True)
class ModelSettings:
    """Which model (its weights' format, its tokenizer or none), in which dtype, how long a sequence may be."""

    model_path: str = setting(
        "default",
        "'default' (the embedded SmolLM2-135M-Instruct) or a local Hugging Face "
        "model folder (config.json + safetensors)",
        flag="--model",
        aliases=("--model-path",),
    )
    tokenizer_path: Optional[str] = setting(None, "the tokenizer's folder (SGLang's flag); unset: the model's")
    load_format: str = setting(
        "auto",
        "auto or safetensors: read the folder's safetensors weights; dummy (SGLang's, which RL trainers use): "
        "small random weights of the folder's config, read nothing (the trainer then sends its weights with "
        "update_weights_from_tensor / _distributed / _disk)",
    )
    skip_tokenizer_init: bool = setting(
        False,
        "load no tokenizer (SGLang's flag): prompts come as token ids (input_ids), outputs carry output_ids and "
        "no text; text prompts, chat, stop strings and grammars are refused",
    )
    chat_template: Optional[str] = setting(
        None,
        "a Jinja chat template for chat requests in place of the tokenizer's: a file holding it (.jinja), "
        "a JSON file with a 'chat_template' key (SGLang's flag takes such a file too), the template itself "
        "(as vLLM's), or a name: chatml, llama-3-instruct, llama-2 (llama-2-chat), vicuna_v1.1 (as SGLang's); "
        "unset: the tokenizer's",
    )
    json_model_override_args: Optional[str] = setting(
        None,
        "SGLang's: a JSON object of config.json fields that replace the folder's, e.g. "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\' '
        "(rope_scaling replaces the rope_parameters of a newer config, keeping its rope_theta)",
    )
    dtype: str = setting(
        "auto",
        "auto (bfloat16 on CUDA; on a CPU bfloat16 only where it has avx512_bf16 or amx_bf16 and a start-up "
        "measurement finds it faster, else float32), float32, bfloat16 or float16",
    )
    context_length: Optional[int] = setting(
        None, "longest prompt + output in tokens (unset: the model's; longer needs RADIXRT_ALLOW_LONGER_CONTEXT=1)"
    )
    quantization: Optional[str] = setting(
        None,
        "quantization of the linear layers' weights at load time (steps under 256 rows also quantize "
        "activations to int8 per run of 32, as llama.cpp), CPU only: int8 (per output channel) or "
        "int4 (groups of --quantization-group-size inputs with a scale and a minimum); also accepted: int8wo, "
        "int4wo, int4wo-<group size>, w8a16, w4a16; unset: the weights stay in --dtype",
    )
    quantization_group_size: int = setting(
        DEFAULT_GROUP_SIZE, "int4: consecutive inputs sharing a scale and a minimum (32, 64, 128 or 256)"
    )
    quantize_lm_head: bool = setting(
        False, "with --quantization: quantize the LM head too (embeddings stay in --dtype; a tied head is copied)"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_SPELLINGS.get(self.dtype, self.dtype))
        check_choice("dtype", self.dtype, MODEL_DTYPES)  # before the model loads (it was a child's traceback)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        for name in ("tokenizer_path", "chat_template"):  # refused before the model loads
            path = getattr(self, name)
            inline = (
                name == "chat_template"
                and path is not None
                and (is_inline_template(path) or path in NAMED_CHAT_TEMPLATES)
            )
            if path is not None and not os.path.exists(path) and not inline:
                raise ValueError(f"{name} {path!r} does not exist")
        method, group = normalize_method(self.quantization)
        object.__setattr__(self, "quantization", method)
        if group is not None:
            if self.quantization_group_size not in (DEFAULT_GROUP_SIZE, group):
                raise ValueError(
                    f"quantization int4wo-{group} and quantization_group_size={self.quantization_group_size} "
                    "disagree: give the group size once"
                )
            object.__setattr__(self, "quantization_group_size", group)
        check_group_size(self.quantization_group_size)
        self.config_overrides()  # refused before the model loads

    def config_overrides(self) -> dict[str, Any]:
        """``json_model_override_args`` as a dict ({} unset); ValueError unless it is a JSON object."""
        if self.json_model_override_args is None:
            return {}
        try:
            overrides = json.loads(self.json_model_override_args)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_model_override_args is not JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise ValueError("json_model_override_args must be a JSON object of config.json fields")
        return overrides

    def tokenizer_source(self, model_folder: str) -> Optional[str]:
        """The folder the tokenizer loads from (``model_folder``: the resolved model's); None under
        ``skip_tokenizer_init`` (`load_tokenizer` then gives a `NoTokenizer`)."""
        return None if self.skip_tokenizer_init else self.tokenizer_path or model_folder

    @property
    def weight_quantization(self) -> Optional[WeightQuantization]:
        """The quantized weight format asked for, or None (float weights)."""
        if self.quantization is None:
            return None
        return WeightQuantization(self.quantization, self.quantization_group_size, self.quantize_lm_head)
