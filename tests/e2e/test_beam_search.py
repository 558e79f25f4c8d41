"""Beam search on the embedded model, through `Engine.generate`: the best beam
equals transformers' ``generate(num_beams=W, do_sample=False)`` token for token
for 16 prompts at W = 2, 4 and 8 (fp32), with the same ``length_penalty`` and
``early_stopping``; with pages of 16 tokens, so that forks copy partly filled
pages; and the DSL's ``gen(beam_width=...)`` gives the same best hypothesis."""

from __future__ import annotations

import pytest

import radixrt

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The best way to learn Python is",
    "Water boils at",
    "A haiku about the sea:",
    "import numpy as np\n",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "My favourite breakfast is",
    "In 1969, the first person to walk on the Moon",
    "SELECT name FROM users WHERE",
    "The quick brown fox",
    "Dear hiring manager,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
]
MAX_NEW = 12
SETTINGS = {
    2: {"length_penalty": 1.0, "early_stopping": False},
    4: {"length_penalty": 0.6, "early_stopping": True},
    8: {"length_penalty": 1.0, "early_stopping": "never"},
}


@pytest.fixture(scope="module")
def engine(default_model_path):
    eng = radixrt.Engine(default_model_path, max_total_tokens=16384, page_size=16, debug_check_invariants=True)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("width", [2, 4, 8])
def test_best_beam_equals_transformers(engine, hf_model, tokenizer, width):
    """transformers runs the 16 prompts as one left-padded batch (its masked positions weigh exactly
    nothing; one call per width keeps the test short)."""
    kw = SETTINGS[width]
    ours = engine.generate(PROMPTS, {"max_new_tokens": MAX_NEW, "beam_width": width, **kw})
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # the session's tokenizer: put back
    try:
        enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    g = hf_model.generate(
        **enc,
        num_beams=width,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )
    pad = hf_model.generation_config.pad_token_id
    for i, (prompt, out) in enumerate(zip(PROMPTS, ours)):
        want = g.sequences[i, enc["input_ids"].shape[1] :].tolist()
        got = out["output_ids"]
        assert got + [pad] * (len(want) - len(got)) == want, prompt  # transformers pads an early finisher
        assert out["meta_info"]["beam"]["score"] == pytest.approx(g.sequences_scores[i].item(), abs=1e-4)
    info = engine.get_server_info()["stats"]
    assert info["beam_forks"] > 0 and info["beam_copied_slots"] > 0


def test_gen_beam_width_in_a_program(engine):
    @radixrt.function
    def complete(s, prompt):
        s += prompt + radixrt.gen("best", max_tokens=MAX_NEW, beam_width=4)
        s += radixrt.gen("two", max_tokens=MAX_NEW, beam_width=4, n=2)

    state = complete.run(prompt=PROMPTS[0], backend=engine)
    direct = engine.generate(PROMPTS[0], {"max_new_tokens": MAX_NEW, "beam_width": 4})
    assert state["best"] == direct["text"]
    assert isinstance(state["two"], list) and len(state["two"]) == 2
