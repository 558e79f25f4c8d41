"""The Engine's user-facing API: batch, streaming, async, stop strings,
logprobs, chat templating, stats.

Each test runs on a tiny random Llama (fast) and on the embedded model
(slow); what only a real model can show (it knows the capital of France)
runs on the embedded model alone."""

import asyncio
import json
import math
import re
import time

import pytest

import radixrt
from radixrt.config import OutputSettings
from tests.support.partial_chars import completed_text, cut_inside_a_character


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    # overlap on (the CUDA default, off on the CPU otherwise), so both loops run these tests
    e = radixrt.Engine(tiny_llama, max_total_tokens=8192, disable_overlap_schedule=False)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def embedded_engine():
    e = radixrt.Engine(max_total_tokens=8192)
    yield e
    e.shutdown()


@pytest.fixture(scope="module", params=["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.apply_chat_template([{"role": "user", "content": "Name three fruits, one per line."}])


GREEDY = {"max_new_tokens": 20, "temperature": 0}


def test_batch_and_single_agree(engine, prompt):
    single = engine.generate(prompt, GREEDY)
    batch = engine.generate([prompt, "Once upon a time"], GREEDY)
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]
    assert batch[0]["text"] == single["text"]
    meta = single["meta_info"]
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode(prompt))
    assert meta["completion_tokens"] == len(single["output_ids"])


def test_streaming_is_cumulative_and_ends_with_the_full_text(engine, prompt):
    full = engine.generate(prompt, GREEDY)
    chunks = list(engine.generate(prompt, GREEDY, stream=True))
    texts = [c["text"] for c in chunks]
    assert len(chunks) > 1
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_a_batch_and_n_samples_stream_interleaved_with_their_index(engine, prompt):
    """As SGLang's Engine: each event of a batch (or of n > 1) names its sample's position
    in the whole answer; each sample's events end with its whole result."""
    whole = engine.generate([prompt, "Once upon a time"], {**GREEDY, "n": 2})
    last: dict[int, dict] = {}
    for chunk in engine.generate([prompt, "Once upon a time"], {**GREEDY, "n": 2}, stream=True):
        assert chunk["text"].startswith(last.get(chunk["index"], {"text": ""})["text"])
        last[chunk["index"]] = chunk
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["output_ids"] for i in range(4)] == [w["output_ids"] for w in whole]
    single = list(engine.generate(prompt, GREEDY, stream=True))
    assert "index" not in single[-1] and single[-1]["output_ids"] == whole[0]["output_ids"]


def test_seeded_samples_of_nearby_seeds_share_nothing(tiny_engine):
    """The first of ``n`` seeded samples is what the request alone gives; the others are not those of
    the next seeds (they ran on ``seed + i`` once, so seeds 42 and 43 shared a sample)."""
    sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    samples = [r["output_ids"] for r in tiny_engine.generate("Once upon a time", {**sp, "seed": 42, "n": 3})]
    alone = [tiny_engine.generate("Once upon a time", {**sp, "seed": s})["output_ids"] for s in (42, 43, 44)]
    assert samples[0] == alone[0]
    assert len({tuple(ids) for ids in samples + alone}) == 5, (samples, alone)
    assert [r["output_ids"] for r in tiny_engine.generate("Once upon a time", {**sp, "seed": 42, "n": 3})] == samples


def test_stream_interval_spaces_the_events(engine, prompt):
    """SGLang's stream_interval: the first token at once, then an event every 4 tokens (or more:
    a step may add several), the last at the finish; the same answer."""
    sp = {**GREEDY, "ignore_eos": True}
    counts = [
        c["meta_info"]["completion_tokens"] for c in engine.generate(prompt, {**sp, "stream_interval": 4}, stream=True)
    ]
    assert counts[0] == 1 and counts[-1] == 20, counts
    assert all(b - a >= 4 for a, b in zip(counts, counts[1:-1])) and len(counts) <= 7, counts
    with pytest.raises(ValueError, match="stream_interval"):
        engine.generate(prompt, {**sp, "stream_interval": 0})


def test_stream_logprobs_are_cumulative_with_their_count(engine, prompt):
    """As `/generate` streams them (SGLang's default): every event holds all output
    logprobs so far, and ``output_token_logprobs_length`` counts them."""
    full = engine.generate(prompt, GREEDY, return_logprob=True)
    chunks = list(engine.generate(prompt, GREEDY, return_logprob=True, stream=True))
    for c in chunks:
        m = c["meta_info"]
        assert (
            len(m["output_token_logprobs"])
            == m["output_token_logprobs_length"]
            == m["completion_tokens"]
            == len(c["output_ids"])
        )
    assert [t[1] for t in chunks[-1]["meta_info"]["output_token_logprobs"]] == full["output_ids"]
    assert full["meta_info"]["output_token_logprobs_length"] == len(full["output_ids"])


def test_incremental_streaming_output(tiny_engine, monkeypatch):
    """``incremental_streaming_output`` (SGLang's ``--incremental-streaming-output``):
    each event holds only what is new; the events add up to the whole result."""
    prompt = tiny_engine.apply_chat_template([{"role": "user", "content": "Name three fruits, one per line."}])
    full = tiny_engine.generate(prompt, GREEDY, return_logprob=True, top_logprobs_num=2)
    monkeypatch.setattr(tiny_engine.config, "output", OutputSettings(incremental_streaming_output=True))  # per stream
    chunks = list(tiny_engine.generate(prompt, GREEDY, return_logprob=True, top_logprobs_num=2, stream=True))
    assert len(chunks) > 1
    metas = [c["meta_info"] for c in chunks]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [i for c in chunks for i in c["output_ids"]] == full["output_ids"]
    counts = [m["completion_tokens"] for m in metas]
    assert counts == [m["output_token_logprobs_length"] for m in metas] and counts[-1] == len(full["output_ids"])
    assert [len(m["output_token_logprobs"]) for m in metas] == [len(c["output_ids"]) for c in chunks]
    assert [t[1] for m in metas for t in m["output_token_logprobs"]] == full["output_ids"]
    assert sum(len(m["output_top_logprobs"]) for m in metas) == len(full["output_ids"])


def test_a_stream_dropped_unread_aborts_its_request(tiny_engine):
    """generate(stream=True) sends the request at once; an iterator dropped before its first
    next() ran it to max_new_tokens for nobody (its finally never ran). Reading an async stream
    in another event loop than the one that started it waited forever: now a clear error."""
    import gc

    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    for make in (
        lambda: tiny_engine.generate("Tell me a story.", long, stream=True),
        lambda: asyncio.run(tiny_engine.async_generate("Tell me a story.", long, stream=True)),
    ):
        stream = make()
        del stream
        gc.collect()
        deadline = time.monotonic() + 2  # an abort takes a step; 2,000 tokens take several seconds
        while tiny_engine.router.inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tiny_engine.router.inflight == 0
    tiny_engine.wait_idle()
    assert tiny_engine.scheduler.kv_usage()["private_slots"] == 0

    async def start():
        return await tiny_engine.async_generate("Hi", {"max_new_tokens": 4}, stream=True)

    elsewhere = asyncio.run(start())

    async def read():
        return [event async for event in elsewhere]

    with pytest.raises(RuntimeError, match="event loop that started it"):
        asyncio.run(asyncio.wait_for(read(), 10))


def test_async_generate_many_concurrent(engine, prompt):
    async def main():
        outs = await asyncio.gather(*(engine.async_generate(prompt, GREEDY) for _ in range(4)))
        streamed = []
        async for chunk in await engine.async_generate(prompt, GREEDY, stream=True):
            streamed.append(chunk["text"])
        return outs, streamed

    outs, streamed = asyncio.run(main())
    assert len({tuple(o["output_ids"]) for o in outs}) == 1
    assert streamed[-1] == outs[0]["text"]


@pytest.mark.slow
def test_stop_string_is_excluded_from_text(embedded_engine):
    engine = embedded_engine
    p = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    free = engine.generate(p, {"max_new_tokens": 16, "temperature": 0})
    assert "Paris" in free["text"]
    stopped = engine.generate(p, {"max_new_tokens": 16, "temperature": 0, "stop": ["Paris"]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    assert "Paris" not in stopped["text"]
    assert free["text"].startswith(stopped["text"])


def test_stop_string_taken_from_the_free_output(engine, prompt):
    """Any model: a piece of the free greedy text, used as a stop string, ends the output just before it."""
    free = engine.generate(prompt, GREEDY)
    text = free["text"]
    head = engine.tokenizer.decode(free["output_ids"][:3], skip_special_tokens=True)
    stop = text[len(head) :].lstrip()[:4]
    assert len(head) > 0 and len(stop) == 4 and text.find(stop) >= len(head), (head, text)
    stopped = engine.generate(prompt, {**GREEDY, "stop": [stop]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == text[: text.find(stop)]


def test_a_stop_string_of_many_multibyte_characters_is_matched(engine, prompt):
    """A stop string spans at most its UTF-8 bytes in byte-level tokens, not its characters: an
    emoji can take four tokens, and a look-back sized in characters missed five of them."""
    for stop in ("\U0001f52c" * 5, "\u6708" * 6, "\u00f1" * 12):
        sp = {**GREEDY, "max_new_tokens": 150, "regex": f"x({stop[0]}){{30}}", "stop": [stop]}
        out = engine.generate(prompt, sp)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}, out
        assert out["text"] == "x"


def test_stop_token_ids_and_min_new_tokens(engine, prompt):
    ref = engine.generate(prompt, GREEDY)["output_ids"]
    third = ref[2]
    out = engine.generate(prompt, {**GREEDY, "stop_token_ids": [third]})
    assert out["output_ids"] == ref[:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    eos = engine.tokenizer.eos_token_id
    forced = engine.generate(prompt, {"max_new_tokens": 40, "min_new_tokens": 40, "temperature": 0})
    assert len(forced["output_ids"]) == 40 and eos not in forced["output_ids"]


def test_output_logprobs(engine, prompt):
    out = engine.generate(prompt, GREEDY, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    for (lp, tid, text), top in zip(lps, meta["output_top_logprobs"]):
        assert lp <= 0 and math.isfinite(lp)
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp)  # greedy picks the top token
        assert top[0][0] >= top[1][0]
        assert text == engine.tokenizer.decode([tid])


def test_ignore_eos_and_length_finish(engine):
    out = engine.generate("Hello", {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert len(out["output_ids"]) == 7


def test_stats_and_flush(engine, prompt):
    engine.generate(prompt, GREEDY)
    engine.generate(prompt, GREEDY)
    stats = engine.get_stats()
    assert stats["cache"]["hit_tokens"] > 0 and 0 < stats["cache"]["hit_rate"] <= 1
    assert stats["kv"]["total_slots"] == 8192
    assert engine.flush_cache()
    again = engine.generate(prompt, GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0
    info = engine.get_server_info()
    assert info["max_total_num_tokens"] == 8192 and info["context_length"] == 8192
    # SGLang's fields its tools read, as the server's /get_server_info has them
    state = info["internal_states"][0]
    assert state["memory_usage"]["token_capacity"] == 8192 and state["kv"]["total_slots"] == 8192
    assert info["version"] == radixrt.__version__
    model = engine.get_model_info()  # SGLang's Engine.get_model_info, as /get_model_info
    assert model["is_generation"] and model["context_length"] == 8192 and model["weight_version"] == "default"
    assert model["vocab_size"] == engine.info.vocab_size
    with pytest.raises(AttributeError, match=r"Engine.encode \(SGLang's\) is not supported by radixrt: .*generative"):
        engine.encode("hi")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_method'"):
        engine.no_such_method()


def test_score_equals_transformers_next_token_probabilities(engine):
    """SGLang's Engine.score: each item's label probabilities after the query joined to it, as
    transformers computes them on the same weights; with apply_softmax, among the labels alone;
    item_first and token ids as SGLang's."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    ref = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    labels = [tok.encode(w)[0] for w in (" the", " a", " Paris")]

    def hf(texts, softmax):
        out = []
        for text in texts:
            with torch.no_grad():
                lp = torch.log_softmax(ref(torch.tensor([tok.encode(text)])).logits[0, -1], -1)[labels]
            out.append((torch.softmax(lp, -1) if softmax else lp.exp()).tolist())
        return out

    query, items = "The capital of France is", [" Paris", " a city", ""]
    got = engine.score(query=query, items=items, label_token_ids=labels)
    want = hf([query + i for i in items], False)
    assert [p for row in got for p in row] == pytest.approx([p for row in want for p in row], abs=1e-5)
    got = engine.score(
        query=" is big.", items=["Tokyo", "Rome"], label_token_ids=labels, apply_softmax=True, item_first=True
    )
    assert [p for row in got for p in row] == pytest.approx(
        [p for row in hf(["Tokyo is big.", "Rome is big."], True) for p in row], abs=1e-5
    )
    assert all(sum(row) == pytest.approx(1.0) for row in got)
    ids = engine.score(query=tok.encode(query), items=[tok.encode(" Paris")], label_token_ids=labels)
    assert ids[0] == pytest.approx(hf([query + " Paris"], False)[0], abs=1e-5)
    with pytest.raises(ValueError, match="label_token_ids"):
        engine.score(query=query, items=items, label_token_ids=[10**9])
    for bad in ({"label_token_ids": []}, {"items": []}, {"query": 5}, {"items": [[1]]}, {"apply_softmax": "yes"}):
        with pytest.raises(ValueError):
            engine.score(**{"query": query, "items": items, "label_token_ids": labels, **bad})


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_log_requests_writes_each_request_and_answer_by_the_client_rid(tiny_llama, caplog, level):
    """SGLang's --log-requests: a line when a request is received and one per answer, naming the
    client's rid; texts (level 2 cut, 3 whole) and parameters (from level 1) as JSON strings, so
    a client's newline or escape sequence cannot forge a line."""
    forged = "hi\nERROR radixrt: \x1b[31mforged" + " pad" * 800  # 3,226 characters
    with radixrt.Engine(tiny_llama, max_total_tokens=8192, log_requests=True, log_requests_level=level) as e:
        with caplog.at_level("INFO", logger="radixrt.request_log"):
            out = e.generate(forged, {"max_new_tokens": 3, "temperature": 0, "stop": ["zzz"]}, rid="client-7")
    lines = [r.getMessage() for r in caplog.records if r.name == "radixrt.request_log"]
    assert [line.split(" ", 1)[0] for line in lines] == ["Receive:", "Finish:"], lines
    receive, finish = lines
    assert all("\n" not in line and "\x1b" not in line for line in lines)
    prompt_tokens = out["meta_info"]["prompt_tokens"]
    assert re.match(rf'Receive: rid="client-7" id=[0-9a-f]+ prompt_tokens={prompt_tokens}\b', receive), receive
    assert finish.startswith(
        f'Finish: rid="client-7" finish=length prompt_tokens={prompt_tokens} completion_tokens=3'
    ), finish
    assert ("sampling=" in receive) == (level >= 1) and ('\\"zzz\\"' in receive) == (level >= 1), receive
    assert ('prompt="hi\\nERROR radixrt: \\u001b[31mforged' in receive) == (level >= 2), receive
    assert ("more characters)" in receive) == (level == 2), receive
    assert (f"output={json.dumps(out['text'])}" in finish) == (level >= 2), finish


def test_allowed_token_ids_and_bad_words_ids(tiny_engine):
    """vLLM's allowed_token_ids (only those, no EOS unless listed) and transformers' bad_words_ids
    (a longer word's last token banned right after the rest), greedy and sampled, with the overlap
    scheduler on (the tiny engine runs it; these single requests pass with or without the launcher's
    guard that keeps a multi-token ban's request out of overlapped steps)."""
    e, prompt = tiny_engine, "Count: one two three four"
    base = e.generate(prompt, {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    allowed = sorted(set(base[:3]) | {5, 6})
    only = e.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "allowed_token_ids": allowed})["output_ids"]
    assert set(only) <= set(allowed) and len(only) == 8
    one = e.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "bad_words_ids": [[base[0]]]})["output_ids"]
    assert base[0] not in one
    sampled = {"max_new_tokens": 40, "temperature": 1.0, "seed": 3}
    free = e.generate(prompt, sampled)["output_ids"]
    at = next(i for i in range(1, 39) if free[i] not in (free[i - 1], free[i + 1]))  # a pair the stale tail misses
    for sampling, pairs in (
        ({"temperature": 0, "max_new_tokens": 40}, [base[:2], [base[0]] * 2]),
        (sampled, [free[at : at + 2]]),
    ):
        out = e.generate(prompt, {**sampling, "bad_words_ids": pairs})["output_ids"]
        assert not any([a, b] in pairs for a, b in zip(out, out[1:])), (pairs, out)
    assert out[: at + 1] == free[: at + 1] and out[at + 1] != free[at + 1]  # the same draws up to the ban


@pytest.mark.slow
def test_an_answer_completing_the_prompts_last_character_shows_it_whole(embedded_engine):
    """SmolLM2's greedy answer to a prompt cut inside an emoji starts with the emoji's last bytes: its
    text shows the character whole, streamed and final (decoded alone, it began with replacement
    characters)."""
    tok = embedded_engine.tokenizer
    prompt = cut_inside_a_character(tok)
    sp = {"max_new_tokens": 5, "temperature": 0}
    out = embedded_engine.generate(input_ids=prompt, sampling_params=sp)
    assert tok.decode(out["output_ids"]).startswith("\ufffd")  # the answer's own bytes complete the emoji
    assert out["text"] == completed_text(tok, prompt, out["output_ids"]) and out["text"][0] != "\ufffd"
    chunks = [c["text"] for c in embedded_engine.generate(input_ids=prompt, sampling_params=sp, stream=True)]
    assert chunks[-1] == out["text"] and not any("\ufffd" in c for c in chunks), chunks  # cumulative
