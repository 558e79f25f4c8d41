import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from radixrt.executor.model_store import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers' reference model on the embedded weights (fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)
