"""radixrt quickstart: a structured program on the embedded default model.

    python examples/quickstart.py

Runs on CPU in well under a minute (most of it loading the model): a
multi-turn chat in the model's own chat template, a choice scored by the
model, a fork whose branches share the conversation's cached prefix, and
the same paragraph greedy and sampled.

A note on sampling settings: the embedded model is small (135M parameters)
and, decoding greedily (``temperature=0``), it tends to repeat itself once an
answer runs past a sentence or two, going round the same phrase until
``max_tokens``. Greedy is right for short, checkable answers (the chat and
the choice below); for longer free text, sample with some temperature and a
frequency penalty, e.g. ``temperature=0.7, frequency_penalty=0.5``, as the
last program shows.
"""

import time

import radixrt as rt


@rt.function
def capitals_chat(s, country_1, country_2):
    s += rt.system("You are a helpful assistant. Answer in one short sentence.")
    s += rt.user(f"What is the capital of {country_1}?")
    s += rt.assistant(rt.gen("answer_1", max_tokens=24))
    s += rt.user(f"And what is the capital of {country_2}?")
    s += rt.assistant(rt.gen("answer_2", max_tokens=24))


SKY_COLORS = [" blue", " green", " red"]


@rt.function
def sky(s):
    s += "Q: What color is the sky on a clear day?\nA:"
    s += rt.select("color", choices=SKY_COLORS)


@rt.function
def three_facts(s, topic):
    s += rt.system("You are a helpful assistant.")
    s += rt.user(f"Tell me one short fact about {topic}.")
    forks = s.fork(3)  # three branches share the prefix above; their requests batch together
    for f in forks:
        f += rt.assistant(rt.gen("fact", max_tokens=24, temperature=0.8, top_p=0.95))
    forks.join()  # s["fact"] is now the list of the three facts


@rt.function
def paragraph(s, topic):
    s += rt.user(f"Write a short paragraph about {topic}.")
    s += rt.assistant(rt.gen("text", max_tokens=72))


def main() -> None:
    t0 = time.time()
    engine = rt.Engine()  # the embedded SmolLM2-135M-Instruct, converted on first use
    rt.set_default_backend(engine)
    print(f"engine ready in {time.time() - t0:.1f}s\n")

    t = time.time()
    state = capitals_chat.run(country_1="France", country_2="Italy", temperature=0)
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")
    meta = state.get_meta_info("answer_2")
    print(
        f"  (second turn: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens came from the radix cache)\n"
    )

    state = sky.run()
    scores = state.get_meta_info("color")["normalized_prompt_logprobs"]
    print(f"select: the sky is{state['color']}  (mean logprob per token of each choice)")
    for choice, score in zip(SKY_COLORS, scores):
        print(f"  {choice.strip():>6}: {score:6.2f}{'  <- picked' if choice == state['color'] else ''}")
    print()

    state = three_facts.run(topic="the ocean")
    for i, (fact, meta) in enumerate(zip(state["fact"], state.get_meta_info("fact"))):
        print(f"fork {i}: {fact.strip()!r}  [cached {meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens]")

    # Greedy decoding makes this small model loop on a phrase; sampling with a
    # frequency penalty keeps the paragraph moving (and varies run to run).
    for label, options in (
        ("greedy (temperature=0)", dict(temperature=0)),
        ("sampled (temperature=0.7, frequency_penalty=0.5)", dict(temperature=0.7, frequency_penalty=0.5)),
    ):
        print(f"\n{label}:\n  {paragraph.run(topic='cats', **options)['text'].strip()!r}")
    print(f"\nprograms ran in {time.time() - t:.1f}s")
    engine.shutdown()


if __name__ == "__main__":
    main()
