"""Tiny random-weight Hugging Face model folders for fast tests and the step-time benchmark.

    path = make_tiny_model(tmp_path, arch="llama")             # with SmolLM2's tokenizer
    path = make_tiny_model(tmp_path, arch="qwen3", tokenizer=False, num_hidden_layers=3)

The vocabulary is SmolLM2's (49152 ids, eos ``<|im_end|>`` = 2), so a tiny model
can tokenize and chat-template text with the tokenizer files copied from the
embedded default model (converted once into ``$RADIXRT_HOME`` on first use).
Weights are random but unit-scale (not the near-zero init of transformers), so
logits and attention patterns are far from uniform.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
VOCAB_SIZE = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# Per architecture: config class name and what sets it apart.
_ARCH_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3 style rope scaling, untied head, GQA ratio 2
    "llama": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # q/k/v bias, tied embeddings, GQA ratio 4
    "qwen2": (
        "Qwen2Config",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # per-head q/k norm, head_dim != hidden / heads, yarn rope, tied embeddings
    "qwen3": (
        "Qwen3Config",
        dict(
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128
            ),
        ),
    ),
    # GQA ratio 3, linear rope scaling, untied
    "mistral": (
        "MistralConfig",
        dict(
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
    ),
}


def tiny_config(arch: str = "llama", **overrides: Any):
    """The transformers config of a tiny model of ``arch`` (llama, qwen2, qwen3, mistral)."""
    import transformers

    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    cls_name, extra = _ARCH_DEFAULTS[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:  # also the head when tied: keep logits O(1)
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:  # [out, in] projections: unit-scale outputs
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def copy_default_tokenizer(dest: str | os.PathLike, src: Optional[str | os.PathLike] = None) -> None:
    """Copy the embedded default model's tokenizer files from ``src`` (a folder
    holding them), else from the default model (converted once if needed)."""
    from radixrt.executor.model_store import resolve_model_path

    src = Path(src if src is not None else resolve_model_path("default"))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, Path(dest) / name)


def make_tiny_model(
    tmp_path: str | os.PathLike,
    arch: str = "llama",
    *,
    tokenizer: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """Save a tiny random-weight ``arch`` model (safetensors, fp32) under ``tmp_path``; return its folder.

    ``overrides`` are transformers config fields (e.g. ``num_hidden_layers=3``).
    With ``tokenizer=True`` the folder also gets SmolLM2's tokenizer and chat template.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    path = Path(tmp_path) / f"tiny-{arch}-{seed}"
    if (path / "config.json").is_file():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(str(path))
    if tokenizer:
        copy_default_tokenizer(path)
    return str(path)
