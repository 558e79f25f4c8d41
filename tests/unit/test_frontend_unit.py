"""Fast tests of the frontend language that need no model.

The interpreter is exercised through a small deterministic backend (a real
``BaseBackend`` subclass, not a mock of anything users call): it completes a
prompt with a scripted function and records every request it receives.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import threading
import time

import pytest

import radixrt.frontend as rt
from radixrt.frontend.backend import BaseBackend
from radixrt.frontend.choices import ChoicesDecision
from radixrt.frontend.errors import BackendError, UnsupportedModalityError
from radixrt.frontend.sampling_params import SglSamplingParams, default_sampling_params
from radixrt.requests.chat_roles import (
    PLAIN_ROLE_MARKERS,
    chat_template_info,
    derive_default_system_prompt,
    derive_role_markers,
    render_messages,
)
from tests.support.frontend_helpers import assert_request_failure_surfaces, multi_turn_question

CHATML = {
    "system": ("<|im_start|>system\n", "<|im_end|>\n"),
    "user": ("<|im_start|>user\n", "<|im_end|>\n"),
    "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
}


class ScriptedBackend(BaseBackend):
    """Completes with ``reply(prompt, sampling)``; ``select`` picks the choice
    ``pick(prompt, choices)``. Requests are logged; ``delay`` makes calls slow
    so that concurrency is observable."""

    def __init__(self, reply=None, pick=None, markers=None, default_system=None, delay=0.0, fail_on=None):
        self.reply = reply or (lambda prompt, sp: f"<{len(prompt)}>")
        self.pick = pick or (lambda prompt, choices: choices[-1])
        self.markers = markers or dict(PLAIN_ROLE_MARKERS)
        self.default_system = default_system
        self.delay = delay
        self.fail_on = fail_on
        self.requests = []
        self.prefills = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def get_role_markers(self):
        return dict(self.markers)

    def get_default_system_prompt(self):
        return self.default_system

    def _enter(self):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def _exit(self):
        with self._lock:
            self.active -= 1

    def generate(self, s, sp):
        self._enter()
        try:
            if self.delay:
                time.sleep(self.delay)
            prompt = s.text_
            self.requests.append((prompt, sp))
            if self.fail_on and self.fail_on in prompt:
                raise BackendError("scripted failure")
            if sp.n and sp.n > 1:
                return [f"{self.reply(prompt, sp)}#{i}" for i in range(sp.n)], [{"i": i} for i in range(sp.n)]
            return self.reply(prompt, sp), {"prompt_tokens": len(prompt), "cached_tokens": 0}
        finally:
            self._exit()

    def generate_stream(self, s, sp):
        text, meta = self.generate(s, sp)
        for i in range(1, len(text) + 1):
            yield text[:i], meta

    def select(self, s, choices, temperature, choices_method):
        self.requests.append((s.text_, "select"))
        return ChoicesDecision(self.pick(s.text_, choices), {"scored": list(choices)})

    def cache_prefix(self, prefix):
        self.prefills.append(prefix)


# --------------------------------------------------------------------------- IR


def test_expressions_concatenate_and_flatten():
    e = "a" + rt.gen("x") + "b" + rt.user("hi")
    kinds = [type(x).__name__ for x in e.flatten()]
    assert kinds == ["SglConstantText", "SglGen", "SglConstantText", "SglRoleBegin", "SglConstantText", "SglRoleEnd"]


def test_gen_parameters_map_to_sglang_sampling_params():
    g = rt.gen(
        "x",
        max_tokens=7,
        min_tokens=2,
        stop="\n",
        temperature=0,
        top_k=5,
        regex=r"\d+",
        return_logprob=True,
        logprob_start_len=3,
        top_logprobs_num=2,
    )
    sp = g.sampling.merged_over(rt.gen("y").sampling.merged_over(default_sampling_params()))
    assert isinstance(sp, SglSamplingParams)
    wire = sp.to_wire()
    assert wire["max_new_tokens"] == 7 and wire["min_new_tokens"] == 2
    assert wire["stop"] == ["\n"] and wire["temperature"] == 0 and wire["top_k"] == 5
    assert wire["regex"] == r"\d+" and "n" not in wire
    assert sp.logprob_kwargs() == {"return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2}
    wire_int = rt.gen_int("n").sampling.to_wire()  # SGLang's: the number, ended by a space or a newline
    assert re.fullmatch(wire_int["regex"], "-42") and wire_int["stop"] == [" ", "\n"]
    assert rt.gen("f", dtype=float, stop="|").sampling.to_wire()["stop"] == ["|", " ", "\n"]
    assert '"' in rt.gen_string("s").sampling.to_wire()["regex"]
    js = rt.gen("j", json_schema={"type": "object"}).sampling.to_wire()["json_schema"]
    assert js == '{"type": "object"}'


def test_gen_with_choices_is_select_and_bad_regex_rejected():
    s = rt.gen("c", choices=["a", "b"])
    assert type(s).__name__ == "SglSelect" and s.choices == ["a", "b"]
    with pytest.raises(ValueError):
        rt.gen("x", regex="(")
    with pytest.raises(ValueError):
        rt.select("x", choices=[])
    with pytest.raises(ValueError, match="list of strings"):  # not picked from character by character
        rt.select("x", choices="abc")
    with pytest.raises(ValueError, match="choices or regex"):  # the regex would have been ignored
        rt.gen("x", choices=["apple", "pear"], regex="[0-9]+")


def test_fork_sizes_are_whole_numbers():
    @rt.function
    def p(s, size):
        s += "x"
        s.fork(size)

    for bad in (2.5, "3", True, -1):
        with pytest.raises(ValueError, match="fork size must be an integer"):
            p.run(size=bad, backend=ScriptedBackend(reply=lambda p, sp: "y"))
    assert p.run(size=0, backend=ScriptedBackend(reply=lambda p, sp: "y")).error() is None  # SGLang's empty group


def test_messages_hold_each_turn_left_stripped_as_sglang_records_them():
    @rt.function
    def chat(s):
        s += rt.user("  hi there ") + rt.assistant(" " + rt.gen("a"))

    st = chat.run(backend=ScriptedBackend(reply=lambda p, sp: "ok"))
    assert [m["content"] for m in st.messages()] == ["hi there ", "ok"]
    assert "  hi there " in st.text()  # the text keeps what was appended


def test_join_gathers_the_branches_new_variables_as_sglang_does():
    """Only names the parent does not have, from the branches that set them (no None for the
    others); the parent's own variables stay, even where a branch set them again; ``with
    s.copy() as c:`` joins ``c`` at the block's end."""

    @rt.function
    def p(s):
        s += "P" + rt.gen("pre", max_tokens=2)
        forks = s.fork(2)
        forks[0] += rt.gen("v", max_tokens=2)
        forks[1] += rt.gen("w", max_tokens=2) + rt.gen("pre", max_tokens=2)
        forks.join()
        with s.copy() as c:
            c += rt.gen("q", max_tokens=2)

    st = p.run(backend=ScriptedBackend(reply=lambda p, sp: "y"))
    assert st.error() is None, st.error()
    assert st["v"] == ["y"] and st["w"] == ["y"] and st["pre"] == "y" and st["q"] == ["y"]


def test_function_decorator_forms_and_argument_binding():
    @rt.function
    def a(s, x, y=2):
        s += f"{x}-{y}"

    @rt.function(num_api_spec_tokens=64)
    def b(s, x):
        s += x

    assert a.arg_names == ["x", "y"] and b.num_api_spec_tokens == 64
    be = ScriptedBackend()
    assert a.run(1, backend=be).text() == "1-2"
    assert a.run(x=1, y=5, backend=be).text() == "1-5"
    assert a.bind(y=9).run(x=0, backend=be).text() == "0-9"
    with pytest.raises(TypeError):
        a.run(backend=be)  # missing x
    with pytest.raises(TypeError):
        a.run(1, z=3, backend=be)


def test_no_backend_is_a_clear_error():
    @rt.function
    def p(s):
        s += "x"

    old = rt.global_config.default_backend
    rt.global_config.default_backend = None
    try:
        with pytest.raises(rt.NoBackendError, match="set_default_backend"):
            p.run()
    finally:
        rt.global_config.default_backend = old


# ------------------------------------------------------------------- interpreter


def test_gen_prompt_is_text_so_far_and_run_defaults_apply():
    be = ScriptedBackend(reply=lambda p, sp: f"[{sp.max_new_tokens},{sp.temperature}]")

    @rt.function
    def p(s, q):
        s += "Q: " + q + "\nA:"
        s += rt.gen("a")
        s += "\nB:" + rt.gen("b", max_tokens=3)

    st = p.run(q="hi", max_new_tokens=11, temperature=0.5, backend=be)
    assert st["a"] == "[11,0.5]" and st["b"] == "[3,0.5]"
    assert be.requests[0][0] == "Q: hi\nA:"
    assert be.requests[1][0] == "Q: hi\nA:[11,0.5]\nB:"
    assert st.text() == "Q: hi\nA:[11,0.5]\nB:[3,0.5]"


def test_roles_render_with_markers_and_default_system_prompt():
    be = ScriptedBackend(reply=lambda p, sp: "ok", markers=CHATML, default_system="Be nice.")

    @rt.function
    def chat(s):
        s += rt.user("hello")
        s += rt.assistant(rt.gen("r1"))
        with s.user():
            s += "again"
        s += rt.assistant_begin() + rt.gen("r2") + rt.assistant_end()

    st = chat.run(backend=be)
    msgs = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
    ]
    assert st.text() == render_messages(msgs, CHATML, "Be nice.")
    assert st.messages() == [{"role": "system", "content": "Be nice."}] + msgs
    # generation prompt = the chat template's generation prompt
    assert be.requests[0][0] == render_messages(msgs[:1], CHATML, "Be nice.", add_generation_prompt=True)

    @rt.function
    def with_system(s):
        s += rt.system("Custom.") + rt.user("x")

    assert with_system.run(backend=be).messages()[0] == {"role": "system", "content": "Custom."}


def test_nested_roles_are_an_error():
    @rt.function
    def bad(s):
        s += rt.user_begin() + rt.assistant_begin()

    st = bad.run(backend=ScriptedBackend())
    assert "nest" in str(st.error())


def test_var_scope_copy_and_set_var():
    be = ScriptedBackend(reply=lambda p, sp: "G")

    @rt.function
    def p(s):
        with s.var_scope("span"):
            s += "abc" + rt.gen("g")
        with s.copy() as c:
            c += "zzz"
            assert c.text().endswith("abcGzzz")
        s["manual"] = 42

    st = p.run(backend=be)
    assert st["span"] == "abcG" and st.text() == "abcG" and st["manual"] == 42


def test_fork_runs_branches_concurrently_and_join_gathers():
    be = ScriptedBackend(reply=lambda p, sp: p[-1], delay=0.5)

    @rt.function
    def p(s):
        s += "shared prefix. "
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += str(i) + rt.gen("x")
        forks.join()
        s += "done"

    st = p.run(backend=be)
    assert st["x"] == ["0", "1", "2", "3"]
    assert be.max_active == 4, "fork branches did not run concurrently"
    assert be.prefills == ["shared prefix. "], "the prefix is prefilled once before the branches"
    assert st.text() == "shared prefix. done"
    assert len(st.get_meta_info("x")) == 4


def test_fork_group_iadd_forms_and_concat_join():
    be = ScriptedBackend(reply=lambda p, sp: "!")

    @rt.function
    def p(s):
        s += "P:"
        forks = s.fork(3)
        forks += lambda i: f"[{i}]"
        forks += ["a", "b", "c"]
        forks += rt.gen("g")
        forks.join("concate_and_append")

    st = p.run(backend=be)
    assert st.text() == "P:[0]a![1]b![2]c!"


def test_fork_indexing_like_sglang_docs():
    be = ScriptedBackend(reply=lambda p, sp: f"tip{p[-2]}")

    @rt.function
    def tips(s):
        s += "Two tips: "
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"expand {i + 1}:"
            f += rt.gen("detail", max_tokens=8)
        s += "1:" + forks[0]["detail"] + " 2:" + forks[1]["detail"]

    assert tips.run(backend=be).text() == "Two tips: 1:tip1 2:tip2"


def test_select_and_dtype_int_fallback():
    be = ScriptedBackend(reply=lambda p, sp: " 42 apples and more", pick=lambda p, c: c[1])

    @rt.function
    def p(s):
        s += "Pick: " + rt.select("c", choices=["x", "y", "z"])
        s += " count=" + rt.gen_int("n")
        s += ";" + rt.gen("raw")

    st = p.run(backend=be)
    assert st["c"] == "y" and st["n"] == "42"
    assert st.text() == "Pick: y count= 42; 42 apples and more"
    assert be.requests[1][1].regex is None and be.requests[1][1].effective_regex() is not None


def test_regex_fallback_trims_to_longest_matching_prefix():
    be = ScriptedBackend(reply=lambda p, sp: "8.8.8.8\nB: more")

    @rt.function
    def p(s):
        s += "IP: " + rt.gen("ip", regex=r"(\d{1,3}\.){3}\d{1,3}") + "!"

    st = p.run(backend=be)
    assert st["ip"] == "8.8.8.8" and st.text() == "IP: 8.8.8.8!"
    assert st.get_meta_info("ip")["constraint_fallback"] == "trimmed"
    assert be.requests[0][1].to_wire()["regex"] == r"(\d{1,3}\.){3}\d{1,3}"


def test_constraint_fallback_cases():
    from radixrt.frontend.constraints import fit_to_constraint

    def fit(out, **kw):
        f = fit_to_constraint(SglSamplingParams(**kw), out)
        return f.text, f.value, f.flags

    assert fit("abc", regex=r"\d+") == ("abc", "abc", {"constraint_violated": True})
    assert fit("12ab", regex=r"\d+") == ("12", "12", {"constraint_fallback": "trimmed"})
    assert fit("12", regex=r"\d+", dtype=int) == ("12", "12", {})  # regex wins over dtype
    assert fit("x", regex="(") == ("x", "x", {})  # an invalid pattern is left alone
    assert fit(" -3.25 kg", dtype=float) == (" -3.25", "-3.25", {})
    assert fit(" none", dtype="int") == (" none", "none", {"dtype_mismatch": True})
    assert fit(" anything", dtype=str) == (" anything", " anything", {})


def test_n_samples_store_a_list():
    be = ScriptedBackend(reply=lambda p, sp: "s")

    @rt.function
    def p(s):
        s += "x" + rt.gen("v", n=3)

    st = p.run(backend=be)
    assert st["v"] == ["s#0", "s#1", "s#2"] and st.text() == "xs#0"


def test_errors_surface_on_read_and_in_error():
    be = ScriptedBackend(reply=lambda p, sp: "fine", fail_on="BOOM")

    @rt.function
    def p(s):
        s += "ok " + rt.gen("a")
        s += " BOOM " + rt.gen("b")
        s += " after " + rt.gen("c")

    st = p.run(backend=be)
    assert st["a"] == "fine"
    assert_request_failure_surfaces(st, "b", later="c")
    assert len(be.requests) == 2, "nothing runs after a failed request"


def test_program_body_exception_propagates_from_run_and_is_kept_by_run_batch():
    @rt.function
    def p(s, x):
        s += "x"
        if x == 1:
            raise ValueError("bad input")

    with pytest.raises(ValueError):
        p.run(1, backend=ScriptedBackend())
    states = p.run_batch([{"x": 0}, {"x": 1}], backend=ScriptedBackend())
    assert states[0].error() is None and isinstance(states[1].error(), ValueError)


def test_image_and_video_are_clear_errors():
    @rt.function
    def p(s):
        s += rt.user(rt.image("cat.png") + "What is this?")

    with pytest.raises(UnsupportedModalityError, match="not supported by this model"):
        p.run(backend=ScriptedBackend())

    @rt.function
    def v(s):
        s += rt.video("clip.mp4", 4)

    with pytest.raises(UnsupportedModalityError):
        v.run(backend=ScriptedBackend())


def test_variable_reassigned_in_loop_reads_latest():
    counter = iter(range(100))
    be = ScriptedBackend(reply=lambda p, sp: str(next(counter)), delay=0.02)

    @rt.function
    def p(s):
        seen = []
        for _ in range(4):
            s += rt.gen("step") + ","
            seen.append(s["step"])
        return seen

    st = p.run(backend=be)
    assert st.ret_value == ["0", "1", "2", "3"]


def test_streaming_text_iter_and_async_iter():
    be = ScriptedBackend(reply=lambda p, sp: "hello", delay=0.01)

    @rt.function
    def p(s):
        s += "A:" + rt.gen("a") + " B:" + rt.gen("b")

    st = p.run(stream=True, backend=be)
    chunks = list(st.text_iter("a"))
    assert len(chunks) == 5 and "".join(chunks) == "hello"
    assert "".join(st.text_iter()) == "A:hello B:hello"

    st2 = p.run(stream=True, backend=be)

    async def consume():
        out = []
        async for chunk, _meta in st2.text_async_iter("b", return_meta_data=True):
            out.append(chunk)
        return out

    assert "".join(asyncio.run(consume())) == "hello"

    st3 = p.run(backend=be)  # not streaming: one item
    assert list(st3.text_iter("a")) == ["hello"]


def test_run_batch_prefills_shared_prefix_and_keeps_order():
    be = ScriptedBackend(reply=lambda p, sp: p.split("Q: ")[-1].split("\n")[0].upper())
    examples = "Q: a\nA: A\n" * 3

    @rt.function
    def fs(s, q):
        s += rt.system("Answer in capitals.")
        s += examples
        s += "Q: " + q + "\nA: " + rt.gen("a")

    qs = [f"{chr(97 + i)}item" for i in range(20)]
    states = fs.run_batch([{"q": q} for q in qs], backend=be, num_threads=4, progress_bar=True)
    assert [st["a"] for st in states] == [q.upper() for q in qs]
    assert len(be.prefills) == 1
    prefix = be.prefills[0]
    assert prefix.endswith("Q: a\nA: A\n" * 3 + "Q: ") and "item" not in prefix
    gen_style = list(fs.run_batch([{"q": "x"}, {"q": "y"}], backend=be, generator_style=True))
    assert [st["a"] for st in gen_style] == ["X", "Y"]


def test_trace_records_nodes_and_constant_prefix():
    @rt.function
    def p(s, topic):
        s += rt.system("Sys.")
        s += "About " + topic + ": " + rt.gen("x", max_tokens=4)
        s += " then " + rt.select("y", choices=["a", "b"]) + s["x"]

    tr = p.trace()
    names = [type(n).__name__ for n in tr.nodes]
    assert "SglArgument" in names and "SglGen" in names and "SglSelect" in names and "SglVariable" in names
    assert tr.constant_prefix == "System: Sys.\nAbout "
    tr2 = p.trace(topic="cats")
    assert tr2.constant_prefix == "System: Sys.\nAbout cats: "


def test_subprogram_call_inline():
    @rt.function
    def greet(s, name):
        s += f"Hello {name}. "

    @rt.function
    def main(s):
        greet(s, "Ann")
        greet(s, name="Bob")

    assert main.run(backend=ScriptedBackend()).text() == "Hello Ann. Hello Bob. "


def test_sglang_style_import_alias_program_runs_unchanged():
    sgl = rt  # `import radixrt as sgl` exposes the same names
    program = multi_turn_question(sgl, max_tokens=256)

    st = program.run(question_1="a", question_2="b", backend=ScriptedBackend(reply=lambda p, sp: "r"))
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]


def test_import_frontend_does_not_import_torch():
    code = (
        "import sys, radixrt, radixrt.frontend as f; f.gen; f.function; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
        "f.RuntimeEndpoint; assert 'torch' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------- choices


def _entries(lps):
    return [[v, i, None] for i, v in enumerate(lps)]


def test_choice_methods():
    choices = ["a", "bb", "ccc"]
    toks = [_entries([-1.0]), _entries([-0.5, -0.5]), _entries([-0.1, -3.0, -3.0])]
    norm = [sum(e[0] for e in t) / len(t) for t in toks]
    d = rt.token_length_normalized(choices=choices, normalized_prompt_logprobs=norm, input_token_logprobs=toks)
    assert d.decision == "bb"
    d = rt.greedy_token_selection(choices=choices, normalized_prompt_logprobs=norm, input_token_logprobs=toks)
    assert d.decision == "ccc"  # best first token
    uncond = [_entries([-5.0]), _entries([-0.1, -0.1]), _entries([-0.1, -3.0, -3.0])]
    d = rt.unconditional_likelihood_normalized(
        choices=choices, normalized_prompt_logprobs=norm, input_token_logprobs=toks, unconditional_token_logprobs=uncond
    )
    assert d.decision == "a"  # the prompt raised "a" the most above its baseline
    # ties on the first token fall through to the next one
    toks2 = [_entries([-1.0, -2.0]), _entries([-1.0, -0.5])]
    d = rt.greedy_token_selection(choices=["p", "q"], normalized_prompt_logprobs=[0, 0], input_token_logprobs=toks2)
    assert d.decision == "q"
    assert math.isinf(
        rt.token_length_normalized(
            choices=["x"], normalized_prompt_logprobs=[-math.inf], input_token_logprobs=[[]]
        ).meta_info["normalized_prompt_logprobs"][0]
    )


# ------------------------------------------------------------------- chat roles


class _TemplateTokenizer:
    """Just enough of a HF tokenizer to render a jinja chat template."""

    def __init__(self, template, bos_token=None, add_bos=False, **special):
        import jinja2

        self.chat_template = template
        self.bos_token = bos_token
        self.bos_token_id = 1 if bos_token else None
        self._add_bos = add_bos
        self._special = special
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        self._tpl = env.from_string(template)

    def encode(self, text):
        return ([1] if self._add_bos else []) + [5]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return self._tpl.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            **self._special,
        )


SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

NO_SYSTEM_TEMPLATE = (  # Gemma-like: rejects the system role
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _conv(markers, default_system=None):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    return msgs, render_messages(msgs, markers, default_system, add_generation_prompt=True)


def test_chat_roles_smollm2_chatml_with_default_system_prompt():
    tok = _TemplateTokenizer(SMOL_TEMPLATE)
    info = chat_template_info(tok)
    assert info["chat_role_markers"] == CHATML
    assert info["chat_default_system_prompt"].startswith("You are a helpful AI assistant named SmolLM")
    msgs, text = _conv(info["chat_role_markers"], info["chat_default_system_prompt"])
    assert text == tok.apply_chat_template(msgs, add_generation_prompt=True)
    sys_msgs = [{"role": "system", "content": "S"}] + msgs
    assert render_messages(sys_msgs, CHATML, info["chat_default_system_prompt"], True) == tok.apply_chat_template(
        sys_msgs, add_generation_prompt=True
    )


def test_chat_roles_llama3_strips_auto_bos():
    tok = _TemplateTokenizer(LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", add_bos=True)
    markers = derive_role_markers(tok)
    assert markers["user"] == ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert markers["assistant"][0] == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert derive_default_system_prompt(tok) is None
    msgs, text = _conv(markers)
    assert "<|begin_of_text|>" + text == tok.apply_chat_template(msgs, add_generation_prompt=True)


def test_chat_roles_template_without_system_role_and_no_template():
    tok = _TemplateTokenizer(NO_SYSTEM_TEMPLATE, bos_token="<bos>", add_bos=True)
    markers = derive_role_markers(tok)
    assert markers["user"] == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert markers["assistant"] == ("<start_of_turn>model\n", "<end_of_turn>\n")
    assert markers["system"] == PLAIN_ROLE_MARKERS["system"]

    class NoTemplate:
        chat_template = None

    assert derive_role_markers(NoTemplate()) == PLAIN_ROLE_MARKERS
    assert derive_role_markers(None) == PLAIN_ROLE_MARKERS


# ------------------------------------------------------------------- Runtime (local server) log

_FAKE_SERVER = '''#!{python}
"""Stands in for `python -m radixrt.cli serve ... --port N`: answers /health and /get_model_info."""
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"model_path": "fake"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _executable(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def test_runtime_deletes_its_server_log_on_shutdown(tmp_path):
    from radixrt.frontend.runtime_endpoint import Runtime

    fake = _executable(tmp_path / "fake-python", _FAKE_SERVER.format(python=sys.executable))
    r = Runtime(python=fake, startup_timeout=60)
    try:
        assert r.endpoint.model_info == {"model_path": "fake"}
        assert "fake server up" in open(r.log_path).read()
    finally:
        r.shutdown()
    assert r.process is None
    assert not os.path.exists(r.log_path)
    r.shutdown()  # idempotent (atexit calls it again)


def test_runtime_keeps_the_log_of_a_server_that_failed_to_start(tmp_path):
    from radixrt.frontend.runtime_endpoint import Runtime

    failing = _executable(tmp_path / "failing-python", "#!/bin/sh\necho 'model not found: nope'\nexit 3\n")
    with pytest.raises(RuntimeError, match="exited with code 3") as ei:
        Runtime(model_path="nope", python=failing, startup_timeout=60)
    message = str(ei.value)
    assert "model not found: nope" in message
    log_path = re.search(r"full log kept at (\S+):", message).group(1)
    try:
        assert os.path.basename(log_path).startswith("radixrt-serve-")
        assert "model not found: nope" in open(log_path).read()
    finally:
        os.unlink(log_path)


def test_sglang_run_forms_tuple_entries_n_and_typed_gens():
    """As SGLang: run_batch entries may be tuples of the arguments in order; run takes n=1 (its own
    client fails for more); a dtype's constraint wins over a regex beside it (with a warning);
    gen_int's max_tokens is the program's, as gen(dtype=int)'s."""
    from frontend.sampling_params import REGEX_INT, SglSamplingParams

    @rt.function
    def prog(s, q, r="R"):
        s += q + r

    assert prog._batch_entry(("Yo", "Z")) == {"q": "Yo", "r": "Z"} and prog._batch_entry(["Hi"]) == {"q": "Hi"}
    with pytest.raises(ValueError, match="n=1 only"):
        prog.run("x", n=2)
    with pytest.raises(ValueError, match="n=1 only"):
        prog.run_batch([("x",)], n=3)
    with pytest.warns(UserWarning, match="dtype"):
        assert SglSamplingParams(dtype=int, regex="[a-z]+").effective_regex() == REGEX_INT
    assert SglSamplingParams(regex="[a-z]+").effective_regex() == "[a-z]+"
    assert rt.gen_int("x").sampling.max_new_tokens is None
