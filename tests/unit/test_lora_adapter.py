"""Reading PEFT adapter folders (executor/lora/adapter.py, pool.py) against PEFT itself:
each module's delta weight, with ``alpha_pattern`` / ``rank_pattern`` keys matched as
PEFT matches them; and which folders ``--lora-target-modules`` and the pool refuse, by
the weights the file holds, with messages that name the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.executor.lora.adapter import PARTS, load_adapter
from tests.support.lora import make_adapter

LAYERS = 12  # layers 1 and 10, 11: a pattern for layers.1 must not match layers.1x


@pytest.fixture(scope="module")
def model(make_tiny) -> str:
    return make_tiny("llama", tokenizer=False, num_hidden_layers=LAYERS)


def _sizes(model: str) -> dict[str, list[int]]:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    head = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    return {"qkv": [q, kv, kv], "o": [c.hidden_size], "gate_up": [c.intermediate_size] * 2, "down": [c.hidden_size]}


def _peft_deltas(model: str, folder: str) -> dict[tuple[int, str], torch.Tensor]:
    """PEFT's delta weight ``[out, in]`` of every adapted module, by (layer, module)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), folder)
    deltas = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            parts = name.split(".")
            deltas[(int(parts[parts.index("layers") + 1]), parts[-1])] = module.get_delta_weight("default")
    return deltas


def test_pattern_keys_match_module_names_as_peft_matches_them(model: str, tmp_path: Path) -> None:
    folder = make_adapter(
        model,
        tmp_path / "patterns",
        8,
        seed=1,
        targets=["q_proj", "v_proj", "o_proj"],
        # keys as PEFT users write them: with the module's parents, and anchored at a component
        alpha_pattern={"self_attn.v_proj": 64, "layers.0.self_attn.q_proj": 2, "model.layers.1.self_attn.o_proj": 4},
        rank_pattern={"layers.1.self_attn.q_proj": 4, "o_proj": 2},
    )
    adapter = load_adapter("patterns", folder, _sizes(model), torch.float32, "cpu", 64, LAYERS)
    want = _peft_deltas(model, folder)
    assert len(want) == 3 * LAYERS
    for (layer, module), delta in want.items():
        projection, index = PARTS[module]
        d = adapter.layers[(layer, projection)]
        part = next(p for p in d.parts if p.offset == sum(_sizes(model)[projection][:index]))
        ours = (d.a_t[:, part.ranks[0] : part.ranks[1]] @ part.b_t).t()
        torch.testing.assert_close(ours, delta, atol=1e-6, rtol=1e-5, msg=f"layers.{layer}.{module}")
    # rank_pattern: layers.1's q_proj has rank 4, layers.11's the default 8
    assert adapter.layers[(1, "qkv")].parts[0].ranks == (0, 4) and adapter.layers[(11, "qkv")].parts[0].ranks == (0, 8)
