"""Tiny random-weight model folders for tests (they live in the package, where
the step-time benchmark uses them too)."""
from radixrt.bench.tiny_model import ARCHS, VOCAB_SIZE, copy_default_tokenizer, make_tiny_model, tiny_config

__all__ = ["ARCHS", "VOCAB_SIZE", "copy_default_tokenizer", "make_tiny_model", "tiny_config"]
