"""Small LoRA adapters made with `peft` over a model folder, for the LoRA tests."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
