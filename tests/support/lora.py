"""Small LoRA adapters made with `peft` over a model folder, for the LoRA tests."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from radixrt.executor.lora.adapter import LoRAAdapter, Part, ProjectionDelta
from radixrt.executor.lora.batch import LoRABatch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the fused projections of the synthetic adapters: each one's output slices and input width
SLICES = {"qkv": [48, 16, 16], "o": [48], "gate_up": [96, 96], "down": [48]}
IN = {"qkv": 48, "o": 48, "gate_up": 48, "down": 96}


def make_adapter(
    base: str,
    out: Path,
    rank: int,
    seed: int,
    *,
    bias: bool = False,
    invocation: Optional[list[int]] = None,
    scale: float = 0.05,
    targets: Optional[list[str]] = None,
    **config: object,
) -> str:
    """A PEFT folder of a rank-``rank`` adapter of every projection of ``base`` (or of
    ``targets``: PEFT's ``target_modules``) with random (not zero) ``lora_B``, so that it
    changes the model's output; ``config``: more `LoraConfig` fields."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=TARGETS if targets is None else targets,
        lora_bias=bias,
        init_lora_weights=False,
        **({"alora_invocation_tokens": invocation} if invocation else {}),
        **config,  # type: ignore[arg-type]
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(scale / max(p.abs().max().item(), 1e-6))
    peft_model.save_pretrained(str(out))
    return str(out)


def peft_reference(base: str, adapter: Optional[str]):
    """transformers' model of ``base`` with ``adapter`` applied by PEFT (merged into
    the weights where PEFT can merge it, as served models are)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is None:
        return model.eval()
    peft_model = PeftModel.from_pretrained(model, adapter)
    cfg = peft_model.peft_config["default"]
    if cfg.lora_bias or getattr(cfg, "alora_invocation_tokens", None):  # what PEFT cannot merge: run unmerged
        return peft_model.eval()
    return peft_model.merge_and_unload().eval()


def synthetic_adapter(name: str, rank: int, bias: bool, dtype: torch.dtype, seed: int, layers: int = 2) -> LoRAAdapter:
    """An adapter of random weights (no PEFT folder) of rank ``rank`` for every part of the
    projections `SLICES` names, in ``layers`` layers, except layer 1's ``o``, which it leaves alone."""
    gen = torch.Generator().manual_seed(seed)
    w = lambda *s: (torch.randn(*s, generator=gen) * 0.3).to(dtype)  # noqa: E731
    adapter = LoRAAdapter(name, "/nowhere", f"{name}-{seed}-{rank}-{bias}-{dtype}", rank, ("q_proj",))
    for layer in range(layers):
        for projection, slices in SLICES.items():
            if projection == "o" and layer == 1:
                continue
            parts, offset = [], 0
            for i, width in enumerate(slices):
                parts.append(Part(offset, (i * rank, (i + 1) * rank), w(rank, width), w(width) if bias else None))
                offset += width
            adapter.layers[(layer, projection)] = ProjectionDelta(w(IN[projection], rank * len(slices)), parts)
    return adapter


def every_delta(batch: LoRABatch, x: dict[str, torch.Tensor], outs: dict[str, torch.Tensor]) -> dict:
    """Each (layer, projection)'s output (a copy of ``outs[projection]``) with ``batch``'s deltas added."""
    result = {}
    for layer in range(2):
        for projection in SLICES:
            out = outs[projection].clone()
            batch.add_delta(layer, projection, x[projection], out)
            result[(layer, projection)] = out
    return result
