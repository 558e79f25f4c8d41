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


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def pool(model: str):
    from radixrt.executor.lora.pool import LoRAPool

    def make(targets: list[str] | None) -> LoRAPool:
        made.append(LoRAPool(_sizes(model), torch.float32, "cpu", None, 64, targets, num_layers=LAYERS))
        return made[-1]

    made: list = []
    yield make
    for p in made:
        p.close()


def test_all_linear_adapters_pass_target_modules_that_cover_them(make_tiny, pool, tmp_path: Path) -> None:
    import json

    # PEFT saves target_modules="all-linear" as full module names (model.layers.0.mlp.down_proj, ...)
    # where they are few (under 20: 2 layers)
    small = make_tiny("llama", tokenizer=False)
    every = make_adapter(small, tmp_path / "all", 4, seed=2, targets="all-linear")
    assert (
        "model.layers.0.mlp.down_proj"
        in json.loads((Path(every) / "adapter_config.json").read_text())["target_modules"]
    )
    assert pool(ALL).register("all", every).rank == 4
    with pytest.raises(ValueError, match=r"adapts \['down_proj', 'gate_proj', 'up_proj'\], outside"):
        pool(ALL[:4]).register("all", every)


def test_one_folder_under_two_names_is_held_once(make_tiny, pool, tmp_path: Path) -> None:
    """300 names for one 36 KB adapter grew the scheduler by 13 MB: adapters with the same
    digest share their weights, whichever way they were loaded."""
    folder = make_adapter(make_tiny("llama", tokenizer=False), tmp_path / "a", 4, seed=5, targets=ALL)
    p = pool(ALL)
    p.register("first", folder)
    p.load("first").result()
    first = p.finish_load("first", set())
    p.install(*p.read("second", folder).result(), set())
    second = p.get("second")
    assert second is not None and second.name == "second" and second.layers is first.layers
    assert p.registered["second"].digest == p.registered["first"].digest


def test_target_modules_bound_the_weights_whatever_the_config_says(make_tiny, pool, tmp_path: Path) -> None:
    """A config that lists fewer modules than its weights adapt, and a regex target_modules."""
    import json

    q_and_v = make_adapter(
        make_tiny("llama", tokenizer=False), tmp_path / "qv", 4, seed=3, targets=["q_proj", "v_proj"]
    )
    config = json.loads((Path(q_and_v) / "adapter_config.json").read_text())
    for targets in (["q_proj"], r".*\.q_proj"):
        (Path(q_and_v) / "adapter_config.json").write_text(json.dumps({**config, "target_modules": targets}))
        with pytest.raises(ValueError, match=r"adapts \['v_proj'\], outside --lora-target-modules"):
            pool(["q_proj", "k_proj"]).register("qv", q_and_v)
        assert pool(["q_proj", "v_proj"]).register("qv", q_and_v).rank == 4


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_weights_of_modules_radixrt_does_not_adapt_are_refused_by_name(
    model: str, pool, tmp_path: Path, module
) -> None:
    folder = make_adapter(model, tmp_path / module, 4, seed=4, targets=["q_proj", module])
    with pytest.raises(ValueError, match=rf"has weights for \['{module}'\]: radixrt adapts only q_proj"):
        pool(None).register(module, folder)


def test_target_modules_take_sglang_s_names() -> None:
    from radixrt.config.lora import ADAPTABLE_MODULES, LoRASettings, target_modules

    assert tuple(PARTS) == ADAPTABLE_MODULES
    assert target_modules(None) is None and target_modules(["q_proj", "all"]) is None  # all: any module
    assert target_modules(["qkv_proj", "down_proj"]) == {"q_proj", "k_proj", "v_proj", "down_proj"}
    assert target_modules(["gate_up_proj"]) == {"gate_proj", "up_proj"}
    for bad in ("lm_head", "embed_tokens", "qkv"):
        with pytest.raises(ValueError, match=f"'{bad}' is not a module radixrt adapts"):
            LoRASettings(lora_target_modules=[bad])
