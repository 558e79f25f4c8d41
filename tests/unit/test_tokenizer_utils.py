"""The detokenizer process's decode without transformers equals transformers' decode."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from radixrt.requests.detokenizer import IncrementalDetokenizer
from radixrt.requests.tokenizer_utils import TextDecoder, load_decoder


@pytest.fixture
def folder(default_model_path) -> str:
    """The embedded model's tokenizer (the tiny test models copy it)."""
    return str(default_model_path)


def test_text_decoder_decodes_every_id_and_mixed_runs_as_transformers_does(folder):
    decoder, reference = load_decoder(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(decoder, TextDecoder)
    vocab = len(reference)
    special = sorted(reference.all_special_ids)
    assert special, "the check below must cover special tokens"
    for skip in (False, True):
        for tid in range(vocab):
            assert decoder.decode([tid], skip_special_tokens=skip) == reference.decode([tid], skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(200):
        ids = [
            rng.choice(special) if rng.random() < 0.15 else rng.randrange(vocab) for _ in range(rng.randrange(1, 64))
        ]
        for skip in (False, True):
            assert decoder.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_streamed_text_is_the_same_with_either_tokenizer(folder):
    reference = AutoTokenizer.from_pretrained(folder)
    ids = reference.encode("Grüße, 世界! <|im_end|> naïve café 🙂 end", add_special_tokens=False)
    texts = []
    for tok in (load_decoder(folder), reference):
        det = IncrementalDetokenizer(tok, stop=["end"])
        streamed = [det.push([tid]) for tid in ids[:-1]]
        texts.append((streamed, det.push(ids[-1:], {"type": "stop", "matched": "end"})))
    assert texts[0] == texts[1]
    assert texts[0][1].startswith("Grüße, 世界!") and not texts[0][1].endswith("end")


def test_a_matched_stop_token_leaves_the_text_unless_no_stop_trim(folder):
    """As SGLang's trim_matched_stop: the token that ended the request (a stop_token_ids id, or
    EOS kept by skip_special_tokens false) is not in the text; with no_stop_trim it is."""
    tok = load_decoder(folder)
    ref = AutoTokenizer.from_pretrained(folder)
    period, eos = ref.convert_tokens_to_ids("."), ref.convert_tokens_to_ids("<|im_end|>")
    paris = ref.encode(" Paris", add_special_tokens=False)
    for stop_id, skip in ((period, True), (eos, False)):
        for keep in (False, True):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip, no_stop_trim=keep)
            streamed = det.push(paris)
            final = det.push([stop_id], {"type": "stop", "matched": stop_id})
            assert streamed == " Paris" and final == " Paris" + (ref.decode([stop_id]) if keep else ""), final
    # a request that ended otherwise keeps its last token
    det = IncrementalDetokenizer(tok)
    assert det.push(paris + [period], {"type": "length", "length": 3}) == " Paris."


def test_an_output_that_completes_the_prompts_last_character_shows_it_whole(folder):
    """A prompt of ids may end inside a character (byte-level tokens of an emoji's first bytes, a
    continuation cut at max_tokens): the output's first bytes complete it. Decoded alone they were
    replacement characters ('\ufffd\ufffd🍕...'); with the prompt's tail as context the output's text
    starts with the whole character, streamed and final, also through a stop string; a prompt that
    ends on a whole character changes nothing."""
    from radixrt.requests.detokenizer import PROMPT_TAIL_TOKENS

    ref = AutoTokenizer.from_pretrained(folder)
    ids = ref.encode("Pizza: 🍕🍕 and 🍕 done", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if ref.decode(ids[:k]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]
    want = "🍕🍕 and 🍕 done"[: -len(" done")]
    for tok in (load_decoder(folder), ref):
        det = IncrementalDetokenizer(tok, stop=[" done"], prompt_tail=prompt[-PROMPT_TAIL_TOKENS:])
        streamed = [det.push([tid]) for tid in output[:-1]]
        final = det.push(output[-1:], {"type": "stop", "matched": " done"})
        assert final == want and all("\ufffd" not in t and want.startswith(t) for t in streamed), streamed
        whole = IncrementalDetokenizer(tok, prompt_tail=ref.encode("Pizza: 🍕", add_special_tokens=False))
        done = ref.encode(" done", add_special_tokens=False)
        assert whole.push(done, {"type": "length"}) == " done"
    assert ref.decode(output).startswith("\ufffd")  # what the output's text was


def test_a_tokenizer_whose_decode_cleans_up_spaces_keeps_transformers(tmp_path, tiny_llama):
    folder = shutil.copytree(tiny_llama, tmp_path / "model")
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    assert not isinstance(load_decoder(str(folder)), TextDecoder)


def test_the_decoder_loads_without_importing_transformers(default_model_path):
    code = (
        "import sys; from radixrt.requests.tokenizer_utils import load_decoder; "
        f"d = load_decoder({str(default_model_path)!r}); "
        "print(type(d).__name__, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["TextDecoder", "False"]


def test_a_folder_s_tokenizer_is_read_once_per_process_until_its_files_change(tmp_path, tiny_llama):
    """Engines started one after another in a process share one read of the folder's tokenizer
    (about 0.4 s each), each through a copy of its own: a chat template set on one stays there. A
    changed file is read again."""
    from radixrt.requests.tokenizer_utils import load_tokenizer

    folder = shutil.copytree(tiny_llama, tmp_path / "model")
    first, second = load_tokenizer(str(folder)), load_tokenizer(str(folder))
    assert first is not second and first.backend_tokenizer is second.backend_tokenizer
    own = load_tokenizer(str(folder), "{{ 'mine' }}")
    turns = [{"role": "user", "content": "hi"}]
    assert own.apply_chat_template(turns, tokenize=False) == "mine"
    assert first.chat_template == second.chat_template != own.chat_template
    assert load_tokenizer(str(folder)).chat_template == first.chat_template
    (folder / "chat_template.jinja").write_text("{{ 'changed' }}")
    changed = load_tokenizer(str(folder))
    assert changed.backend_tokenizer is not first.backend_tokenizer
    assert changed.apply_chat_template(turns, tokenize=False) == "changed"
    assert first.encode("hello world") == changed.encode("hello world")


@pytest.mark.slow
def test_a_chat_template_file_replaces_the_tokenizers(tmp_path, tiny_llama):
    """SGLang's --chat-template (and an Engine's chat_template): a Jinja file, or a JSON file holding
    one, replaces the tokenizer's template; a path that is no such file is refused by name."""
    from radixrt.config import EngineConfig
    from radixrt.requests.tokenizer_utils import load_tokenizer

    jinja = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(jinja)
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": jinja}))
    turns = [{"role": "user", "content": "hi"}]
    for name in ("t.jinja", "t.json"):
        tok = load_tokenizer(tiny_llama, str(tmp_path / name))
        assert tok.apply_chat_template(turns, tokenize=False) == "[user] hi\n"
    with pytest.raises(ValueError, match="holds no 'chat_template'"):
        (tmp_path / "bad.json").write_text("{}")
        load_tokenizer(tiny_llama, str(tmp_path / "bad.json"))
    (tmp_path / "broken.jinja").write_text("{{ message.content }<|im_end|>")  # refused at start, not per request
    with pytest.raises(ValueError, match="broken.jinja' does not compile: unexpected '}'"):
        load_tokenizer(tiny_llama, str(tmp_path / "broken.jinja"))
    (tmp_path / "tracked.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert load_tokenizer(tiny_llama, str(tmp_path / "tracked.jinja")).chat_template  # transformers' own tags
    for name in ("chat_template", "tokenizer_path"):
        with pytest.raises(ValueError, match=f"{name} '/no/such' does not exist"):
            EngineConfig(**{name: "/no/such"})
    # vLLM's --chat-template also takes the template itself
    assert load_tokenizer(tiny_llama, jinja).apply_chat_template(turns, tokenize=False) == "[user] hi\n"
    assert EngineConfig(chat_template=jinja).model.chat_template == jinja
    typed = "{% for m in messages %}[{{ m['role'] }}]\\n{{ m['content'] }}\\n{% endfor %}"  # as on a shell line
    assert load_tokenizer(tiny_llama, typed).apply_chat_template(turns, tokenize=False) == "[user]\nhi\n"
    with pytest.raises(ValueError, match="does not compile"):
        load_tokenizer(tiny_llama, "{{ unclosed")


def test_named_chat_templates_render_their_formats(tiny_llama):
    """SGLang's --chat-template also takes a name: each named template writes its format's reference
    text (ChatML, Meta's Llama 3 and Llama 2 templates, FastChat's Vicuna v1.1) with the tokenizer's
    bos and eos; a name that is neither a file nor a template is refused listing the names."""
    from radixrt.config import EngineConfig
    from radixrt.requests.tokenizer_utils import apply_chat_template, load_tokenizer

    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a color."},
    ]
    tok = load_tokenizer(tiny_llama)
    bos, eos = tok.bos_token or "", tok.eos_token
    want = {
        "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n",
        "llama-3-instruct": f"{bos}<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "Hello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "llama-2": f"{bos}[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! {eos}"
        f"{bos}[INST] Name a color. [/INST]",
        "vicuna_v1.1": f"Be brief. USER: Hi ASSISTANT: Hello!{eos}USER: Name a color. ASSISTANT:",
    }
    for name, text in want.items():
        assert apply_chat_template(load_tokenizer(tiny_llama, name), turns) == text, name
        assert EngineConfig(chat_template=name).model.chat_template == name
    assert apply_chat_template(tok, turns) == want["chatml"]  # SmolLM2's own template is ChatML's
    llama2 = load_tokenizer(tiny_llama, "llama-2-chat")  # SGLang's frontend spelling
    assert apply_chat_template(llama2, turns[1:2]) == f"{bos}[INST] Hi [/INST]"
    vicuna = apply_chat_template(load_tokenizer(tiny_llama, "vicuna_v1.1"), turns[1:2])
    assert vicuna.startswith("A chat between a curious user") and vicuna.endswith(" USER: Hi ASSISTANT:")
    with pytest.raises(ValueError, match="chatml, llama-3-instruct, llama-2, llama-2-chat, vicuna_v1.1"):
        load_tokenizer(tiny_llama, "chatml2")
    with pytest.raises(ValueError, match="chat_template 'chatml2' does not exist"):
        EngineConfig(chat_template="chatml2")


def test_reasoning_effort_reaches_the_chat_template(tiny_llama):
    """OpenAI's reasoning_effort was an unknown field, ignored: it is checked, and the template reads
    it (as vLLM and SGLang pass it; gpt-oss's template does), unless chat_template_kwargs sets it."""
    from types import SimpleNamespace

    from pydantic import ValidationError

    from radixrt.requests.tokenizer_utils import load_tokenizer
    from radixrt.server.openai_api import _chat_prompt_ids
    from radixrt.server.protocol import ChatCompletionRequest

    tok = load_tokenizer(tiny_llama, "effort={{ reasoning_effort | default('unset') }}")
    tm = SimpleNamespace(tokenizer=tok, encode=lambda text, special=True, field=None, fit=True: tok.encode(text))
    messages = [{"role": "user", "content": "hi"}]
    for body, said in (
        ({}, "effort=unset"),
        ({"reasoning_effort": "low"}, "effort=low"),
        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "effort=high"),
    ):
        req = ChatCompletionRequest.model_validate({"messages": messages, **body})
        assert tok.decode(_chat_prompt_ids(req, messages, tm)) == said
    with pytest.raises(ValidationError, match="reasoning_effort"):
        ChatCompletionRequest.model_validate({"messages": messages, "reasoning_effort": "maximal"})
