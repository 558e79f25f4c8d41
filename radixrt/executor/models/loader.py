"""Build a model and fill it from a Hugging Face folder's safetensors files."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from glob import glob
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from radixrt.config.weight_format import WeightQuantization
from radixrt.executor.models.config import ModelConfig
from radixrt.executor.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# HF name suffix -> (our name suffix, shard index) for the fused projections.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$")


def resolve_dtype(dtype: Union[str, torch.dtype, None], device: Union[str, torch.device]) -> torch.dtype:
    """A torch dtype from a dtype or a name; "auto"/None: float32 on CPU, bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise FileNotFoundError(f"{path}: shards named in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors weights found (radixrt loads safetensors only; "
            "convert .bin checkpoints with transformers' save_pretrained)"
        )
    return files


def _shard_bounds(cfg: ModelConfig, fused: str) -> list[tuple[int, int]]:
    if ".qkv_proj." in fused:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    i = cfg.intermediate_size
    return [(0, i), (i, 2 * i)]


def _our_name(hf_name: str) -> tuple[str, Optional[int]]:
    """The model's parameter holding a checkpoint tensor, and its shard in a fused one (or None)."""
    m = _LAYER_RE.match(hf_name)
    if not m:
        return hf_name, None
    fused, shard = _FUSED[m.group(2)]
    return f"{m.group(1)}{fused}.{m.group(3)}", shard


def _parameter(model: LlamaForCausalLM, name: str) -> torch.nn.Parameter:
    """``model``'s parameter ``name`` (radixrt's name; a LoRA-wrapped layer's base weight).
    KeyError when it has none, saying so for a quantized layer."""
    owner_path, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        raise KeyError(f"the model has no weight {name!r}") from None
    owner = getattr(owner, "base", owner)  # a LoRA wrapper (lora/batch.py) around the model's layer
    param = getattr(owner, leaf, None)
    if not isinstance(param, torch.nn.Parameter):
        if getattr(owner, "packed", None) is not None:  # a QuantizedLinear
            raise KeyError(f"{name!r} is quantized: its float weights are not kept")
        raise KeyError(f"the model has no weight {name!r}")
    return param


def checkpoint_tensor(model: LlamaForCausalLM, hf_name: str) -> torch.Tensor:
    """The values ``model`` holds for the checkpoint tensor ``hf_name`` (Hugging Face's name: its
    q/k/v or gate/up rows of a fused parameter; the embedding for a tied ``lm_head.weight``; the
    base layer's under a LoRA wrapper), a view of the parameter. KeyError naming what the model
    lacks: a name not in the checkpoint's layout, or a quantized layer's float weights."""
    if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
        hf_name = "model.embed_tokens.weight"
    name, shard = _our_name(hf_name)
    try:
        param = _parameter(model, name).detach()
    except KeyError as e:  # named as asked, not as fused
        raise KeyError(e.args[0].replace(repr(name), repr(hf_name))) from None
    if shard is None:
        return param
    lo, hi = _shard_bounds(model.config, name)[shard]
    return param[lo:hi]


def with_tensors(base: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> LlamaForCausalLM:
    """A new model (eval mode, ``base``'s dtype and device) holding ``base``'s weights with
    ``named_tensors`` in their place: checkpoint (Hugging Face) names, q/k/v and gate/up written
    into their fused rows. ``base`` is only read. ValueError naming a tensor the model has no
    place for (or a quantized one), or one whose shape differs."""
    first = next(base.parameters())
    model = empty_model(base.config, first.dtype, first.device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            try:
                param.copy_(_parameter(base, name))
            except KeyError as e:
                raise ValueError(e.args[0]) from None
        for hf_name, tensor in named_tensors:
            try:
                target = checkpoint_tensor(model, hf_name)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{hf_name!r} has shape {tuple(tensor.shape)}; the model's is {tuple(target.shape)}")
            target.copy_(tensor)
    return model


def load_weights(model: LlamaForCausalLM, path: str) -> None:
    """Copy every tensor of the folder's safetensors into ``model`` (fusing q/k/v and gate/up).

    Raises ValueError listing unexpected names, shape mismatches or parameters left unfilled.
    """
    from safetensors import safe_open

    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    # expected pieces: (our param name, shard index or None)
    needed: set[tuple[str, Optional[int]]] = set()
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            needed.update((name, i) for i in range(3))
        elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
            needed.update((name, i) for i in range(2))
        else:
            needed.add((name, None))

    unexpected: list[str] = []
    bad_shape: list[str] = []
    found: set[tuple[str, Optional[int]]] = set()  # in the checkpoint (loaded, or of a wrong shape)
    with torch.no_grad():
        for file in _safetensors_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    if hf_name.endswith("rotary_emb.inv_freq"):
                        continue
                    if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # tied: the embedding is the head
                    name, shard = _our_name(hf_name)
                    param = params.get(name)
                    if param is None or (name, shard) not in needed:
                        unexpected.append(hf_name)
                        continue
                    tensor = f.get_tensor(hf_name)
                    target = param.data
                    if shard is not None:
                        lo, hi = _shard_bounds(cfg, name)[shard]
                        target = target[lo:hi]
                    if tuple(tensor.shape) != tuple(target.shape):
                        bad_shape.append(f"{hf_name}: file {tuple(tensor.shape)} vs model {tuple(target.shape)}")
                        found.add((name, shard))  # reported as a mismatch, not as missing too
                        continue
                    target.copy_(tensor.to(dtype=target.dtype))
                    found.add((name, shard))
    missing = sorted({n for n, _ in needed - found})
    problems = []
    if unexpected:
        problems.append(f"unexpected weights in the checkpoint: {sorted(unexpected)}")
    if bad_shape:
        problems.append(f"shape mismatches: {bad_shape}")
    if missing:
        problems.append(f"weights missing from the checkpoint: {missing}")
    if problems:
        raise ValueError(f"cannot load {path} as {cfg.architecture}: " + "; ".join(problems))


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Build modules without initialising their weights (the checkpoint's
    replace them): ``torch.nn.init``'s functions do nothing inside. On the meta
    device they would still run torch's reference ops, whose first use imports
    ``torch._dynamo`` (about 1.5 s of start-up). The functions are swapped
    process-wide for the construction: nothing else may build modules meanwhile
    (start-up builds one model at a time)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "zeros_", "ones_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: Union[str, torch.device]) -> LlamaForCausalLM:
    """The model of ``cfg`` in eval mode, its weights allocated but not set (`load_weights` or a
    tensor-parallel leader's broadcast fills them)."""
    with torch.device("meta"), _no_weight_init():
        model = LlamaForCausalLM(cfg)
    # Module.to_empty, but with torch.empty: empty_like of a meta tensor runs torch's reference
    # op, whose first use imports sympy (about 0.7 s of every start-up).
    model = model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if cfg.tie_word_embeddings:  # to_empty keeps the sharing, but make it explicit
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    model.requires_grad_(False)
    return model


DUMMY_RANGE = 1e-3  # SGLang's dummy weights are uniform in [-1e-3, 1e-3]
DUMMY_SEED = 1234


def dummy_weights(model: LlamaForCausalLM) -> None:
    """``load_format="dummy"``: every weight uniform in ``[-DUMMY_RANGE, DUMMY_RANGE]``, drawn on the
    host from a fixed seed (every tensor-parallel rank draws the same, then keeps its shard)."""
    gen = torch.Generator().manual_seed(DUMMY_SEED)
    with torch.no_grad():
        for param in model.parameters():  # a tied head is the embedding: drawn once
            values = torch.empty(param.shape, dtype=torch.float32).uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
            param.copy_(values.to(param.dtype))


def load_model(
    path: str,
    dtype: Union[str, torch.dtype, None] = "auto",
    device: Union[str, torch.device] = "cpu",
    quantization: Optional[WeightQuantization] = None,
    dummy: bool = False,
    overrides: Optional[dict[str, Any]] = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for the folder ``path`` ("default" = the embedded model), its config.json's
    fields replaced by ``overrides``, and load its weights (``dummy``: `dummy_weights`, reading no
    weight file).

    Returns ``(model, config)``; the model is in eval mode on ``device`` in ``dtype``, its
    linear layers quantized as ``quantization`` says (`quantized_linear.quantize_model`).
    """
    from radixrt.executor.model_store import resolve_model_path

    path = resolve_model_path(path)
    cfg = ModelConfig.from_pretrained(path, overrides)
    model = empty_model(cfg, resolve_dtype(dtype, device), device)
    if dummy:
        dummy_weights(model)
    else:
        load_weights(model, path)
    if quantization is not None:
        from radixrt.executor.models.quantized_linear import quantize_model

        nbytes = quantize_model(model, quantization)
        logger.info("quantized the linear layers to %s: %.1f MB", quantization, nbytes / 1e6)
    return model, cfg
