"""The server's per-step messages keep every field through pickle (their compact rows)."""

import dataclasses
import pickle

from radixrt.requests.finish import FinishReason
from radixrt.requests.messages import TokenBatch, TokenOutput
from radixrt.server.ipc import DetokBatch, DetokItem


def _full_output(rid: str) -> TokenOutput:
    """A TokenOutput whose every field holds something other than its default."""
    return TokenOutput(
        rid,
        [7, 8],
        30,
        2,
        5,
        FinishReason.coerce({"type": "length", "length": 2}),
        [(-0.5, 7), (-0.25, 8)],
        [[(-0.5, 7), (-1.0, 9)], [(-0.25, 8)]],
        [(None, 1), (-2.0, 2)],
        [None, [(-1.0, 3)]],
        {"matched": 4},
        3,
        (12, 7),
        {"policy": "h2o", "peak_kv_tokens": 136},
        {"rank": 1, "score": -0.75},
        [[(-0.5, 7)], [(-3.0, 7)]],
        [None, [(-1.5, 7)]],
        (1, 2, b"\x00" * 16),  # hidden states: one prompt row, one more, of 2 floats
        "step-3",
        2,
        [None, 3],
    )


def test_token_batch_round_trips_every_field():
    full, plain = _full_output("a"), TokenOutput("b", [1], 3, 1, 0)
    defaults = {f.name: getattr(plain, f.name) for f in dataclasses.fields(TokenOutput)}
    # guards the test itself: a new field needs a non-default value above
    assert all(getattr(full, name) != value for name, value in defaults.items() if name != "prompt_tokens")
    batch = TokenBatch([full, plain])
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch and isinstance(back.outputs[0], TokenOutput)
    assert back.outputs[0].finish_reason == full.finish_reason and back.outputs[0].finished


def test_detok_batch_round_trips_text_and_output():
    batch = DetokBatch([DetokItem("a", "héllo", _full_output("a")), DetokItem("b", "", TokenOutput("b", [], 3, 0, 0))])
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch and back.items[0].out.output_top_logprobs == [[(-0.5, 7), (-1.0, 9)], [(-0.25, 8)]]
