"""SGLang's ``return_hidden_states``: a request's final hidden states (the model's last layer,
after its final norm: what the LM head reads), in ``meta_info.hidden_states``.

Shape, as SGLang's: one entry per output token. The first is the prompt's block, one row per
prompt token (the last of them produced the first output token); each next entry is the row
of the output token before it (the row whose logits produced it). A request that outputs
``n`` tokens therefore has ``n`` entries; one of ``max_new_tokens`` 0 has the block only.

The prompt block always covers the whole prompt, so a request that asks computes its prompt
itself rather than take it from the radix cache (a cached prefix has no hidden states kept):
the answer never depends on what the cache held. The server must be started with
``--enable-return-hidden-states`` (as SGLang's), since the rows cost memory on the scheduler
(``hidden_size`` floats per token) until the request ends; they travel once, with the last
result, packed (`pack_rows` / `unpack_rows`).
"""

from __future__ import annotations

from array import array
from typing import Any

from radixrt.requests.errors import RequestError

FLAG = "--enable-return-hidden-states"
# Most values one call's rows may hold (prompt and new tokens, times n, over its prompts, times the
# model's width): 8,192 rows of a 576-wide model, about 11 bytes of JSON a value, so a call's answer
# stays within about 50 MB whatever the model (a 4,096-wide one: 1,152 rows)
MAX_CALL_VALUES = 8192 * 576

# A finished request's rows as they travel to the front: (prompt rows, hidden size, float32 bytes).
PackedHidden = tuple[int, int, bytes]


def check_hidden_states(asked: bool, enabled: bool, beam_width: int) -> None:
    """RequestError unless a request asking for hidden states (``asked``) may have them."""
    if not asked:
        return
    if not enabled:
        raise RequestError(
            f"'return_hidden_states' needs a server (or Engine) started with {FLAG} (enable_return_hidden_states=True)",
            "return_hidden_states",
        )
    if beam_width > 1:
        raise RequestError("'return_hidden_states' does not combine with beam search", "return_hidden_states")


def check_call_rows(rows: int, hidden_size: int) -> None:
    """RequestError when one call asks for more than `MAX_CALL_VALUES` hidden-state values
    (``rows`` of ``hidden_size`` floats; an unknown width counts as 576)."""
    most = MAX_CALL_VALUES // max(hidden_size or 576, 1)
    if rows > most:
        raise RequestError(
            f"'return_hidden_states' asks for {rows} rows (prompt tokens and max_new_tokens, times n, over "
            f"the call's prompts); at most {most} per call for this model's width: split the call or shorten it",
            "return_hidden_states",
        )


def unpack_rows(packed: PackedHidden) -> list[Any]:
    """SGLang's ``meta_info.hidden_states`` list from a `PackedHidden`: the prompt's block (a
    list of rows), then one row per further output token."""
    prompt_rows, size, data = packed
    if size == 0:  # it ended before any row was computed (aborted or timed out while waiting)
        return []
    values = array("f")
    values.frombytes(data)
    rows = [values[i : i + size].tolist() for i in range(0, len(values), size)]
    return [rows[:prompt_rows], *rows[prompt_rows:]]


def last_row(hidden_states: list[Any]) -> list[float]:
    """The hidden state that produced a request's last output token, from its
    ``meta_info.hidden_states`` list (what SGLang's OpenAI routes answer with
    ``return_hidden_states``); empty when no row was computed."""
    if len(hidden_states) > 1:
        return hidden_states[-1]
    prompt_block = hidden_states[0] if hidden_states else []
    return prompt_block[-1] if prompt_block else []
