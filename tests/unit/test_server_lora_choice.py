"""Which LoRA adapter an OpenAI request names (`ServerContext.lora_of`): ``model``
(the adapter's name as vLLM takes it, or ``"<model>:<adapter>"`` as SGLang does) or SGLang's
``lora_path``; both, naming different adapters,
is a 400 rather than one of them silently."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from radixrt.server.context import ServerContext
from radixrt.server.errors import ServerError


def _ctx() -> ServerContext:
    none: Any = None  # lora_of reads neither the tokenizer manager nor the metrics
    return ServerContext(
        tm=none,
        metrics=none,
        model_path="m",
        resolved_model_path="/m",
        served_model_name="base",
        model_aliases={"base", "both"},
        lora_adapters={"t8", "t64b", "both"},
    )


@pytest.mark.parametrize(
    "model,lora_path,adapter",
    [
        ("base:t8", None, "t8"),
        ("t8", None, "t8"),
        ("t8", "t8", "t8"),
        ("both", None, None),  # a name the model answers to is the model
        ("base:both", None, "both"),
        ("base:t8", "", "t8"),
        ("base:t8", "t8", "t8"),
        ("base", "t64b", "t64b"),
        ("base", None, None),
    ],
)
def test_model_or_lora_path_names_the_adapter(model: str, lora_path: Optional[str], adapter: Optional[str]) -> None:
    assert _ctx().lora_of(model, lora_path) == adapter


def test_model_and_lora_path_naming_different_adapters_is_a_400() -> None:
    for model in ("base:t8", "t8"):
        with pytest.raises(ServerError) as e:
            _ctx().lora_of(model, "t64b")
        assert e.value.status == 400 and e.value.param == "lora_path"
        assert "'t8'" in str(e.value) and "'t64b'" in str(e.value)
