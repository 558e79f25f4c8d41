"""Tool-call parsing, streaming assembly, tool checks (definitions, limits,
the tool turns of a conversation), generic rendering and reasoning
separation: strings only, no model."""

from __future__ import annotations

import json
import time

import pytest

from radixrt.requests.reasoning import reasoning_mode, reasoning_token_count, split_reasoning
from radixrt.sampling.grammar import check_grammar
from radixrt.server.tools import ChoiceOutput, ToolError, check_tools, get_parser
from radixrt.server.tools.conversation import check_tool_turns
from radixrt.server.tools.grammar import tool_call_structural_tag
from radixrt.server.tools.parsers import detect_parser
from radixrt.server.tools.render import render_messages
from radixrt.server.tools.spec import is_tool_name

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}

OUTPUTS = {
    "qwen": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    ),
    "generic": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]',
}


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
def test_parsers_read_their_format(fmt):
    p = get_parser(fmt, None)
    res = p.parse(OUTPUTS[fmt])
    calls = [(c.name, json.loads(c.args)) for c in res.named_calls()]
    assert calls[0] == ("get_weather", {"city": "Paris"})
    if fmt != "generic":
        assert calls[1] == ("add", {"a": 1, "b": 2})
    assert res.content.rstrip() == ("Sure." if fmt == "qwen" else "")


@pytest.mark.parametrize("fmt", ["qwen", "llama3", "mistral"])
def test_render_calls_reads_back(fmt):
    p = get_parser(fmt, None)
    text = p.render_calls([("f", '{"x": [1, "}"]}'), ("g", "{}")])
    assert [(c.name, c.args) for c in p.parse(text).named_calls()] == [("f", '{"x": [1, "}"]}'), ("g", "{}")]


def test_plain_text_and_broken_calls_are_content():
    p = get_parser("qwen", None)
    assert p.parse("Paris is sunny.").content == "Paris is sunny."
    broken = "<tool_call>\nnot json\n</tool_call>"
    out = ChoiceOutput(p, False)
    msg, calls = out.message(broken)
    assert not calls and msg["content"] == broken and "tool_calls" not in msg


def _assemble(out: ChoiceOutput, text: str, step: int) -> dict:
    """Feed ``text`` in slices of ``step`` characters; join the deltas as a client would."""
    content, reasoning, calls = "", "", {}
    for k in list(range(step, len(text), step)) + [len(text)]:
        for d in out.deltas(text[:k], k == len(text)):
            content += d.get("content", "")
            reasoning += d.get("reasoning_content", "")
            for tc in d.get("tool_calls", []):
                c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.get("id") or c["id"]
                c["name"] = tc.get("function", {}).get("name") or c["name"]
                c["arguments"] += tc.get("function", {}).get("arguments", "")
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 17])
def test_stream_deltas_add_up_to_the_message(fmt, step):
    out = ChoiceOutput(get_parser(fmt, None), False)
    text = OUTPUTS[fmt]
    got = _assemble(out, text, step)
    msg, _ = out.message(text)
    assert got["content"] == (msg["content"] or "")
    assert [(c["id"], c["name"], c["arguments"]) for c in got["calls"]] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in msg["tool_calls"]
    ]


DEEP = '{"x": ' + "[" * 5000 + "]" * 5000 + "}"


@pytest.mark.parametrize(
    "call,named",
    [
        ('{"name": "f", "arguments": ' + DEEP + "}", True),  # arguments nested past what json.loads takes
        ('{"name": "f\\ud800", "arguments": {}}', False),  # a lone surrogate: not a tool name
        ('{"name": "get weather", "arguments": {}}', False),  # not a tool name
        ('{"name": "f", "arguments": "{\\"x\\": \\"\\ud800\\"}"}', True),  # arguments no response can encode
        ('{"name": "f", "arguments": {"x": [1, 2', True),  # cut off by the token limit
        ('{"name": "f", "arguments": [1]}', True),  # not an object
        ('{"name": "f", 5: 1}', True),  # malformed after the name
        ('{"na', False),
    ],
)
@pytest.mark.parametrize("step", [1, 7, 401])
def test_a_stream_adds_up_to_its_message_whatever_the_model_writes(call, named, step):
    """Calls a client can make the model write (logit_bias, its own regex): the message
    encodes, and the stream sends exactly it: a named call in both, or the text in both."""
    text = "Sure.\n<tool_call>\n" + call + "\n</tool_call>"
    out = ChoiceOutput(get_parser("qwen", None), "")
    msg, calls = out.message(text)
    json.dumps(msg, ensure_ascii=False).encode("utf-8")
    assert calls == named
    assert msg["content"] == ("Sure." if named else text)
    got = _assemble(out, text, step)
    assert got["content"] == (msg["content"] or "")
    assert [(c["id"], c["name"], c["arguments"]) for c in got["calls"]] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls", [])
    ]


def test_a_long_streamed_call_is_scanned_once_not_once_per_chunk():
    """The API server parses every chunk on its event loop: a call whose arguments grow to
    200,000 characters, streamed 100 at a time, costs its length once (a scan that started
    over each chunk took minutes here)."""
    text = '<tool_call>\n{"name": "f", "arguments": {"x": "' + "#" * 200_000 + '"}}\n</tool_call>'
    out = ChoiceOutput(get_parser("qwen", None), "")
    start = time.perf_counter()
    got = _assemble(out, text, 100)
    elapsed = time.perf_counter() - start
    assert got["calls"][0]["arguments"] == '{"x": "' + "#" * 200_000 + '"}'
    assert elapsed < 5.0, elapsed


@pytest.mark.parametrize(
    "mode,text,split",
    [
        ("qwen3", "I am thinking here</think>The answer is 4", ("", "I am thinking here</think>The answer is 4")),
        ("deepseek-r1", "I am thinking here</think>The answer is 4", ("I am thinking here", "The answer is 4")),
        ("deepseek-r1", "<think>a</think>\nb", ("a", "b")),
        ("qwen3", "<think>a</think>\nb", ("a", "b")),
        ("deepseek-r1", "still thinking", ("still thinking", "")),
        ("qwen3", "no thinking", ("", "no thinking")),
    ],
)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_reasoning_streams_as_its_whole_split(mode, text, split, step):
    """SGLang's two rules: qwen3's model opens the block itself; deepseek-r1's prompt opened
    it. The stream never sends content that the whole answer calls reasoning."""
    out = ChoiceOutput(None, mode)
    msg, _ = out.message(text)
    assert (msg["reasoning_content"] or "", msg["content"] or "") == split
    got = _assemble(out, text, step)
    assert (got["reasoning"], got["content"]) == split


def test_reasoning_mode():
    assert reasoning_mode(None, None) == "" and reasoning_mode(False, "qwen3") == ""
    assert reasoning_mode(True, None) == "qwen3" and reasoning_mode(None, "deepseek-r1") == "deepseek-r1"


def test_reasoning_split_whole_and_streamed():
    text = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny."
    assert split_reasoning(text) == ("The user wants Paris.", "It is sunny.")
    assert split_reasoning("<think>still going") == ("still going", "")
    assert split_reasoning("no thinking here") == ("", "no thinking here")
    out = ChoiceOutput(None, True)
    got = _assemble(out, text, 2)
    msg, _ = out.message(text)
    assert (got["reasoning"], got["content"]) == (msg["reasoning_content"], msg["content"])
    both = ChoiceOutput(get_parser("qwen", None), True)
    msg, calls = both.message("<think>call it</think>\n" + OUTPUTS["generic"])
    assert calls and msg["reasoning_content"] == "call it" and msg["content"] is None


@pytest.mark.parametrize(
    "tools,choice,needle",
    [
        ([{"type": "function", "function": {}}], "auto", "name is missing"),
        ([WEATHER, WEATHER], "auto", "more than once"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], "sometimes", "'tool_choice'"),
        (None, "required", "needs 'tools'"),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}},
                    },
                }
            ],
            "auto",
            "not a usable JSON schema",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "auto",
            "describe an object",
        ),
        ([{"type": "retrieval"}], "auto", "only 'function' tools"),
    ],
)
def test_bad_tools_are_refused(tools, choice, needle):
    with pytest.raises(ToolError, match=needle):
        check_tools(tools, choice, None)


def test_tool_names_and_limits():
    assert is_tool_name("get_weather") and is_tool_name("a.b-c_1") and is_tool_name("x" * 64)
    for bad in ("get_weather\n", "", "x" * 65, "a b", "f()", None, 3):
        assert not is_tool_name(bad), bad
    with pytest.raises(ToolError, match="--max-tools"):
        check_tools([WEATHER, ADD], "auto", None, max_tools=1)
    with pytest.raises(ToolError, match="--max-tools-chars"):
        check_tools([WEATHER, ADD], "auto", None, max_chars=len(json.dumps(WEATHER, separators=(",", ":"))) + 10)
    assert len(check_tools([WEATHER, ADD], "auto", None, max_tools=2, max_chars=10_000).tools) == 2


def _turns(*calls, answers=()):
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": list(calls)},
        *answers,
    ]


def _c(cid, name="get_weather", args='{"city": "Paris"}'):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _t(cid, content="ok"):
    return {"role": "tool", "tool_call_id": cid, "content": content}


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "user", "content": "hi"}, _t("c1")], "messages[1].role"),
        (_turns(_c("c1"), answers=[_t("c2")]), "messages[2].tool_call_id"),
        (_turns(_c("c1"), answers=[_t("c1", None)]), "messages[2].content"),
        (_turns(_c("c1"), answers=[{"role": "tool", "content": "x"}]), "messages[2].tool_call_id"),
        (_turns(_c("c1"), answers=[{"role": "user", "content": "?"}, _t("c1")]), "messages[3].role"),
        (_turns(_c("c1", "get_weather\n")), "messages[1].tool_calls[0].function.name"),
        (_turns(_c("c1", args='{"city": ')), "messages[1].tool_calls[0].function.arguments"),
        (_turns(_c("c1", args="42")), "messages[1].tool_calls[0].function.arguments"),
        (_turns(_c("c1", args=DEEP)), "messages[1].tool_calls[0].function.arguments"),
        (_turns(_c("c1", args='{"x": "\\ud800"}')), "messages[1].tool_calls[0].function.arguments"),
        (_turns(_c("c1", args=["x"])), "messages[1].tool_calls[0].function.arguments"),
        (_turns({"id": "c1", "function": "get_weather"}), "messages[1].tool_calls[0].function"),
        (_turns({"id": 7, "function": {"name": "f", "arguments": "{}"}}), "messages[1].tool_calls[0].id"),
        ([{"role": "assistant", "content": None, "tool_calls": []}, _t("c1")], "messages[1].role"),
    ],
)
def test_bad_tool_turns_name_the_field(messages, param):
    with pytest.raises(ToolError) as e:
        check_tool_turns(messages)
    assert e.value.param == param and param in str(e.value), (e.value.param, str(e.value))


def test_good_tool_turns_pass():
    check_tool_turns(_turns(_c("a"), _c("b", "add", '{"a": 1, "b": 2}'), answers=[_t("b"), _t("a")]))
    check_tool_turns(_turns(_c("a", "not_a_defined_tool", ""), answers=[_t("a", "")]))  # names are not matched
    check_tool_turns(_turns(_c("a", args={"city": "Paris"}), answers=[_t("a", [{"type": "text", "text": "ok"}])]))
    check_tool_turns(_turns(_c("a")))  # a call nobody answered yet


@pytest.mark.parametrize("fmt", ["generic", "llama3", "mistral"])
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}])
def test_structural_tags_parse(fmt, choice):
    tr = check_tools([WEATHER, ADD], choice, True)
    tag = tool_call_structural_tag(get_parser(fmt, None), tr)
    check_grammar(("structural_tag", tag))
    check_grammar(("structural_tag", tool_call_structural_tag(get_parser(fmt, None), tr, reasoning=True)))
    assert tool_call_structural_tag(get_parser(fmt, None), check_tools([WEATHER], "none", None)) is None


@pytest.mark.parametrize("fmt", ["generic", "qwen", "llama3", "mistral"])
@pytest.mark.parametrize("parallel", [True, False])
def test_enforced_calls_may_end_after_a_newline(fmt, parallel):
    """A model that writes the separator's newline after its last call may then stop: under
    "required" the grammar used to allow only another call there, so it wrote calls until the
    token limit. A separator that is not whitespace is not allowed at the end, nor a newline
    after the one call of ``parallel_tool_calls: false`` (which would cost the turn's cache hit)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    p = get_parser(fmt, None)
    grammar = xgr.Grammar.from_structural_tag(tool_call_structural_tag(p, check_tools([WEATHER], "required", parallel)))
    call = p.render_call("get_weather", '{"city": "Paris"}')
    one, two = p.block_begin + call + p.block_end, p.block_begin + call + p.separator + call + p.block_end
    assert accepts(grammar, one) and accepts(grammar, two) == parallel
    assert accepts(grammar, one + p.separator) == (parallel and not p.separator.strip())
    assert not accepts(grammar, one + p.separator + "<")


def test_generic_rendering_is_stable_and_round_trips():
    p = get_parser("generic", None)
    tr = check_tools([WEATHER], "auto", None)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    convo = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    short, _ = render_messages(convo[:1], tr, p, native=False)
    long, tools_arg = render_messages(convo, tr, p, native=False)
    assert tools_arg is None and long[: len(short)] == short
    assert long[0]["role"] == "system" and '"name": "get_weather"' in long[0]["content"]
    assert long[2]["content"] == OUTPUTS["generic"]  # what the model generated, byte for byte
    assert long[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, tools_arg = render_messages(convo, tr, get_parser("qwen", None), native=True)
    assert tools_arg == [WEATHER] and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_parser_detection():
    assert detect_parser(None) == "generic"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "qwen"
    assert detect_parser("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_parser("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("nope", None)


QWEN_LIKE_TEMPLATE = """
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}

# Tools
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and tools %}
{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{%- for tc in m.tool_calls %}{% if not loop.first %}{{ "\\n" }}{% endif %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_native_template_renders_calls_as_generated(tiny_llama):
    """With a template that renders tools (Qwen's layout), the parser is detected
    from it, and a call the model generated (the parser's format, the grammar's
    separators) comes back in the next prompt byte for byte."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = QWEN_LIKE_TEMPLATE
    parser = get_parser("auto", tok.chat_template)
    assert parser.name == "qwen"
    tr = check_tools([WEATHER, ADD], "required", None)
    generated = parser.render_calls([("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')])
    call = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate([("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')])
    ]
    convo = [
        {"role": "user", "content": "Weather? Sum?"},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    msgs, tools_arg = render_messages(convo[:1], tr, parser, native=True)
    step1 = tok.apply_chat_template(msgs, tools=tools_arg, tokenize=False, add_generation_prompt=True)
    msgs, tools_arg = render_messages(convo, tr, parser, native=True)
    step2 = tok.apply_chat_template(msgs, tools=tools_arg, tokenize=False, add_generation_prompt=True)
    assert '{"type": "function", "function": {"name": "get_weather"' in step1
    assert step2.startswith(step1 + generated + "<|im_end|>")


def test_generated_turns_keep_their_tokens():
    """A remembered assistant turn is spliced back as the tokens that generated it;
    a template that does not keep the placeholder falls back to plain tokens."""
    from radixrt.server.tools.turns import TurnTokens, mark_turns, split_encode

    vocab = {1: "<tool", 2: "_call>", 3: "{", 4: '"', 5: "}", 6: "\n", 9: "<eos>"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    turns = TurnTokens(capacity=2)
    turns.remember('<tool_call>{"}', [1, 2, 3, 4, 5, 9], decode)  # the stop token is dropped
    turns.remember("never produced", [1, 2], decode)  # ids that do not decode to the text: not kept
    assert turns.get('<tool_call>{"}') == (1, 2, 3, 4, 5) and turns.get("never produced") is None
    turns.remember('<tool_call>"\n', [1, 2, 4, 6, 9], decode)  # a newline after the last call: kept without it too
    assert turns.get('<tool_call>"\n') == (1, 2, 4, 6) and turns.get('<tool_call>"') == (1, 2, 4)
    turns.remember('<tool_call>{"}', [1, 2, 3, 4, 5, 9], decode)  # (the most recent again)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '<tool_call>{"}'}]
    marked, spliced = mark_turns(msgs, turns)
    assert marked[0] == msgs[0] and marked[1]["content"] != msgs[1]["content"] and spliced == [(1, 2, 3, 4, 5)]

    def enc(text):
        return [ord(ch) for ch in text]

    prompt = f"U:hi|A:{marked[1]['content']}|U:"
    assert split_encode(prompt, spliced, enc, enc) == enc("U:hi|A:") + [1, 2, 3, 4, 5] + enc("|U:")
    assert split_encode("U:hi|A:rewritten|U:", spliced, enc, enc) is None
    for k in range(3):  # least recently used out
        turns.remember(f"t{k}", [3] * (k + 1), lambda ids: f"t{len(ids) - 1}")
    assert turns.get('<tool_call>{"}') is None and turns.get("t2") == (3, 3, 3)


def test_a_remembered_turn_that_spells_a_special_token_is_not_reused(tiny_llama):
    """Generated turns are remembered for every client: a turn whose ids hold a real special token
    (a model can write one) must not make another client's same text read as that token."""
    from transformers import AutoTokenizer

    from radixrt.server.special_text import special_text
    from radixrt.server.tools.turns import TurnTokens, mark_turns

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    turns = TurnTokens()
    text = "<|im_start|>system"
    ids = [start, *tok.encode("system", add_special_tokens=False)]
    turns.remember(text, ids, lambda x: tok.decode(x, skip_special_tokens=False))
    assert turns.get(text) == tuple(ids)  # remembered as generated
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]
    _, spliced = mark_turns(msgs, turns, special_text(tok))
    assert spliced and all(start not in piece for piece in spliced)  # its spelling spliced as text


def test_reasoning_token_count_follows_the_split_rules():
    """The tokens up to the one that completes ``</think>``; all while it is open; none without a block."""
    pieces = ["<th", "ink>", "a", "b", "</", "think", ">", "x", "</think>"]

    class Pieces:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(pieces[i] for i in ids)

    tok, ids = Pieces(), list(range(len(pieces)))
    assert reasoning_token_count(ids, tok, "qwen3") == 7
    assert reasoning_token_count(ids[:5], tok, "qwen3") == 5  # still thinking (or cut off)
    assert reasoning_token_count(ids, tok, "") == 0  # no split asked
    assert reasoning_token_count([7, 8], tok, "qwen3") == 0  # qwen3: opened no block
    assert reasoning_token_count([2, 4, 5, 6, 7], tok, "deepseek-r1") == 4  # the prompt opened it
    assert reasoning_token_count([], tok, "qwen3") == 0


def test_the_generic_prompt_shows_the_parsers_own_call_format_and_mistral_ids_fit_its_templates():
    """Where the template renders no tools, the system message's example call is written in the
    format the grammar enforces and the parser reads (it said <tool_call> for every parser); a
    Mistral call's id is 9 letters and digits, as Mistral's templates require."""
    from radixrt.server.tools.output import ChoiceOutput
    from radixrt.server.tools.parsers import get_parser
    from radixrt.server.tools.render import generic_tools_text
    from radixrt.server.tools.spec import check_tools

    tr = check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "auto", None)
    for name, call in (("llama3", '{"name": "<function name>", "parameters": '), ("mistral", "[TOOL_CALLS][{")):
        text = generic_tools_text(tr, get_parser(name, None))
        assert call in text and "<tool_call>" not in text, text
    assert "<tool_call>\n{" in generic_tools_text(tr, get_parser("qwen", None))
    out = ChoiceOutput(get_parser("mistral", None), "")
    msg, _ = out.message('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    (call_id,) = [c["id"] for c in msg["tool_calls"]]
    assert len(call_id) == 9 and call_id.isalnum(), call_id
    qwen_msg, _ = ChoiceOutput(get_parser("qwen", None), "").message(
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    assert qwen_msg["tool_calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_an_enforced_call_follows_the_thinking_block(choice):
    """Under deepseek-r1 the prompt opens the block: the grammar forced the call inside it (the
    answer came back as reasoning, no tool_calls); it must think up to </think> first."""
    import xgrammar as xgr
    from xgrammar import testing

    parser = get_parser("generic", None)
    tr = check_tools([ADD], choice, True)
    call = parser.call_begin("add") + '{"a": 1, "b": 2}' + parser.call_end
    for rule, accepted, refused in (
        ("deepseek-r1", ["thinking</think>\n\n" + call, "</think>" + call], [call, "<think>x" + call]),
        ("qwen3", [call, "<think>thinking</think>\n" + call], ["thinking</think>" + call]),
    ):
        grammar = xgr.Grammar.from_structural_tag(tool_call_structural_tag(parser, tr, rule))
        for text in accepted:
            assert testing._is_grammar_accept_string(grammar, text), (rule, text)
        for text in refused:
            assert not testing._is_grammar_accept_string(grammar, text), (rule, text)
