"""The workloads of ``radixrt bench``: the request patterns of the SGLang
paper and the seeds, as small token-level programs.

A workload is a list of *programs*. A program is a coroutine function that
sends requests through ``gen(input_ids, sampling_params, stage)`` and builds
its next prompts from the answers (a chat's next turn, a fork's branches, a
join), so the same workload runs on the in-process Engine and on the HTTP
server (Poisson arrivals of programs) and is replayed on the transformers
``generate`` loop wave by wave (``stage``: requests of one stage only depend
on earlier stages). Every prompt is a concatenation of token lists, so shared
prefixes are shared exactly at the token level; generation is greedy with
fixed lengths (``ignore_eos``) except where a grammar ends the output (JSON),
so every system does the same work.

    name              pattern                                    at scale 1
    shared-prefix     one long system prompt + unique question   32 req, 1024 + 32 -> 32 tokens
    few-shot          MMLU 5-shot: per-subject examples + Q      2 subjects x 16 Q, ~420 -> 1 token
    multi-turn        chat users; each turn re-sends history     8 users x 4 turns, -> 16 tokens
    agent-fanout      tool scaffold, plan, fork(4) calls, join   8 programs x 6 req, 16 tokens each
    agent-loop        shared system+tools, k parallel tool calls 4 agents x (4 steps x 3 calls + 1), 12 / 16
                      per step, tool results back, m steps       tokens (agent_loop.py)
    tree-of-thought   question, fork(4) x 2 levels, 16 answers   2 programs x 36 req, 16 / 8 tokens
    json-extraction   shared instructions + schema, unique doc   16 req, -> JSON (json_schema)
    no-sharing        unrelated prompts                          32 req, 256 -> 64 tokens

``scale`` multiplies the number of programs (requests, users, documents);
prompt shapes stay fixed, so hit rates mean the same thing at every scale.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Callable, Sequence

from radixrt.bench.agent_loop import agent_loop
from radixrt.bench.common import words
from radixrt.bench.workload_base import Gen, Program, Tokens, Workload, greedy

WORKLOADS = (
    "shared-prefix",
    "few-shot",
    "multi-turn",
    "agent-fanout",
    "agent-loop",
    "tree-of-thought",
    "json-extraction",
    "no-sharing",
)


def _count(n: int, scale: float, least: int = 1) -> int:
    return max(least, round(n * scale))


# ---------------------------------------------------------------------- single-request workloads
def _single(name: str, shape: str, prompts: list[list[int]], sp: dict, **kw: Any) -> Workload:
    def program(ids: list[int]) -> Program:
        async def run(gen: Gen) -> None:
            await gen(ids, sp, 0)

        return run

    return Workload(name, shape, [program(p) for p in prompts], len(prompts), **kw)


def shared_prefix(
    tok: Tokens,
    scale: float = 1.0,
    seed: int = 0,
    *,
    requests: int = 32,
    prefix: int = 1024,
    unique: int = 32,
    output: int = 32,
    groups: int = 1,
    scale_requests: bool = True,
) -> Workload:
    """``groups`` system prompts of ``prefix`` random tokens; each request is one of them
    plus ``unique`` tokens of its own (requests interleave the groups)."""
    rng = random.Random(seed)
    n = _count(requests, scale) if scale_requests else requests
    shared = [tok.random(rng, prefix) for _ in range(groups)]
    prompts = [shared[i % groups] + tok.random(rng, unique) for i in range(n)]
    return _single(
        "shared-prefix",
        f"{n} req, {groups} x {prefix}-token shared prefix + {unique} unique, {output} out",
        prompts,
        greedy(output),
        params=dict(requests=n, prefix=prefix, unique=unique, output=output, groups=groups),
    )


def no_sharing(
    tok: Tokens, scale: float = 1.0, seed: int = 0, *, requests: int = 32, length: int = 256, output: int = 64
) -> Workload:
    rng = random.Random(seed + 7)
    n = _count(requests, scale)
    prompts = [tok.random(rng, length) for _ in range(n)]
    return _single(
        "no-sharing",
        f"{n} unrelated {length}-token prompts, {output} out",
        prompts,
        greedy(output),
        params=dict(requests=n, length=length, output=output),
    )


def few_shot(
    tok: Tokens, scale: float = 1.0, seed: int = 0, *, subjects: int = 2, questions: int = 16, shots: int = 5
) -> Workload:
    """MMLU 5-shot shape: per subject a header and five worked multiple-choice
    questions; each request adds one question and reads a one-token answer."""
    rng = random.Random(seed + 1)
    per_subject = _count(questions, scale)

    def question() -> str:
        q = words(rng, 28).capitalize() + "?\n"
        return q + "".join(f"{c}. {words(rng, 5)}\n" for c in "ABCD") + "Answer:"

    prompts = []
    subject_ids = []
    for s in range(subjects):
        subject = words(rng, 2)
        head = f"The following are multiple choice questions (with answers) about {subject} (subject {s}).\n\n"
        head += "".join(question() + f" {rng.choice('ABCD')}\n\n" for _ in range(shots))
        subject_ids.append(tok.text(head))
    for i in range(per_subject * subjects):  # interleaved subjects, as a mixed eval queue arrives
        prompts.append(subject_ids[i % subjects] + tok.text(question()))
    shape = (
        f"{subjects} subjects x {per_subject} questions, {shots}-shot prefix ~{len(subject_ids[0])} tokens, "
        f"question ~{len(prompts[0]) - len(subject_ids[0])}, 1 out"
    )
    return _single(
        "few-shot", shape, prompts, greedy(1), params=dict(subjects=subjects, questions=per_subject, shots=shots)
    )


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "occupation"],
    "additionalProperties": False,
}
FIRST = "Ada Brook Chen Dara Eli Farah Goran Hana Ivo Jun Kemal Lena Mira Nils Omar Pia".split()
CITIES = "Lisbon Oslo Kyoto Lima Accra Quito Riga Porto Hanoi Perth Dakar Bern".split()
JOBS = "nurse pilot baker teacher plumber chemist farmer librarian welder architect".split()


def valid_person(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    props = PERSON_SCHEMA["properties"]
    return (
        isinstance(obj, dict)
        and set(obj) == set(props)
        and isinstance(obj["age"], int)
        and all(isinstance(obj[k], str) for k in ("name", "city", "occupation"))
    )


def json_extraction(
    tok: Tokens, scale: float = 1.0, seed: int = 0, *, documents: int = 16, output: int = 64
) -> Workload:
    """Shared instructions and JSON schema; a unique short document each; the
    answer is constrained with ``json_schema`` (ends when the object closes)."""
    rng = random.Random(seed + 2)
    n = _count(documents, scale)
    schema = json.dumps(PERSON_SCHEMA)
    head = tok.role(
        "system",
        "You extract facts from documents into JSON. Reply with one JSON object that "
        "matches this schema and nothing else.\nSchema: " + schema + "\nRules: copy names "
        "and places exactly as written; age is a whole number of years; if the "
        'occupation is not stated, write "unknown".',
    )
    prompts = []
    for _ in range(n):
        doc = (
            f"{rng.choice(FIRST)} {rng.choice(FIRST)}son is a {rng.randrange(19, 80)}-year-old "
            f"{rng.choice(JOBS)} from {rng.choice(CITIES)}. " + words(rng, 40).capitalize() + "."
        )
        prompts.append(head + tok.role("user", "Document: " + doc) + tok.role("assistant", close=False))
    sp = {"max_new_tokens": output, "temperature": 0, "json_schema": schema}
    return _single(
        "json-extraction",
        f"{n} documents, shared instructions+schema {len(head)} tokens, "
        f"doc ~{len(prompts[0]) - len(head)}, <= {output} out (json_schema)",
        prompts,
        sp,
        validate=valid_person,
        params=dict(documents=n, output=output),
    )


# ---------------------------------------------------------------------- multi-request programs
def multi_turn(
    tok: Tokens,
    scale: float = 1.0,
    seed: int = 0,
    *,
    users: int = 8,
    turns: int = 4,
    system_words: int = 64,
    user_words: int = 24,
    output: int = 16,
) -> Workload:
    """Chat users sharing one system prompt; turn t re-sends the whole history
    (the previous answers as the model generated them, token for token)."""
    rng = random.Random(seed + 3)
    n = _count(users, scale)
    system = tok.role("system", "You are a helpful assistant for a travel agency. " + words(rng, system_words))
    msgs = [[tok.role("user", f"Turn {t}: " + words(rng, user_words) + "?") for t in range(turns)] for _ in range(n)]
    asst_open = tok.role("assistant", close=False)
    asst_close = tok.close("assistant")

    def program(u: int) -> Program:
        async def run(gen: Gen) -> None:
            history = list(system)
            for t in range(turns):
                prompt = history + msgs[u][t] + asst_open
                r = await gen(prompt, greedy(output), t)
                if not r.ok:
                    return
                history = prompt + list(r.output_ids) + asst_close

        return run

    return Workload(
        "multi-turn",
        f"{n} users x {turns} turns, system {len(system)} tokens, user turn ~{len(msgs[0][0])}, {output} out",
        [program(u) for u in range(n)],
        n * turns,
        params=dict(users=n, turns=turns, output=output),
    )


TOOLS = [
    "search_flights(origin, destination, date)",
    "book_hotel(city, nights, budget)",
    "get_weather(city, date)",
    "convert_currency(amount, from, to)",
    "lookup_visa(country, passport)",
    "find_restaurants(city, cuisine)",
    "rent_car(city, days)",
    "check_calendar(user, week)",
]


def agent_fanout(
    tok: Tokens,
    scale: float = 1.0,
    seed: int = 0,
    *,
    programs: int = 8,
    fanout: int = 4,
    scaffold_words: int = 240,
    task_words: int = 24,
    plan_tokens: int = 16,
    call_tokens: int = 16,
    final_tokens: int = 16,
) -> Workload:
    """An agent step: a tool scaffold every task shares, a task, a plan; then
    ``fanout`` tool calls forked from the plan (they share it); then a join
    that reads every call's result and answers."""
    rng = random.Random(seed + 4)
    n = _count(programs, scale)
    scaffold = tok.role(
        "system",
        "You are a travel agent with tools. Tools:\n"
        + "".join(f"- {t}: {words(rng, scaffold_words // len(TOOLS))}\n" for t in TOOLS)
        + "Think, then call tools.",
    )
    tasks = [tok.role("user", "Task: " + words(rng, task_words)) for _ in range(n)]
    plan_open = tok.role("assistant", close=False) + tok.text("Plan:")
    calls = [tok.text(f"\nCall {k + 1}: {TOOLS[k % len(TOOLS)].split('(')[0]}(") for k in range(fanout)]
    final = tok.text("\nAll results are in. Final answer:")

    def program(i: int) -> Program:
        async def run(gen: Gen) -> None:
            ctx = scaffold + tasks[i] + plan_open
            plan = await gen(ctx, greedy(plan_tokens), 0)
            if not plan.ok:
                return
            base = ctx + list(plan.output_ids)
            branches = await asyncio.gather(*(gen(base + c, greedy(call_tokens), 1) for c in calls))
            joined = base + [t for c, b in zip(calls, branches) for t in c + list(b.output_ids)]
            await gen(joined + final, greedy(final_tokens), 2)

        return run

    return Workload(
        "agent-fanout",
        f"{n} tasks, scaffold {len(scaffold)} tokens, plan {plan_tokens} -> "
        f"fork({fanout}) x {call_tokens} -> join {final_tokens}",
        [program(i) for i in range(n)],
        n * (fanout + 2),
        params=dict(programs=n, fanout=fanout),
    )


def tree_of_thought(
    tok: Tokens,
    scale: float = 1.0,
    seed: int = 0,
    *,
    programs: int = 2,
    width: int = 4,
    depth: int = 2,
    question_words: int = 40,
    thought_tokens: int = 16,
    answer_tokens: int = 8,
) -> Workload:
    """The tree of ``example_programs.tree_of_thought`` (width 4, depth 2: 20
    thoughts and 16 answers per question), greedy, each branch steered by its
    own step header so branches differ."""
    rng = random.Random(seed + 5)
    n = _count(programs, scale)
    roots = [
        tok.role("system", "You solve problems by thinking step by step.")
        + tok.role("user", "Question: " + words(rng, question_words) + "?")
        + tok.role("assistant", close=False)
        for _ in range(n)
    ]
    newline = tok.text("\n")
    answer = tok.text("Answer:")

    def program(i: int) -> Program:
        async def run(gen: Gen) -> None:
            frontier = [roots[i]]
            for level in range(depth):
                heads = [tok.text(f"Step {level + 1} (idea {k + 1}):") for k in range(width)]
                prompts = [node + h for node in frontier for h in heads]
                outs = await asyncio.gather(*(gen(p, greedy(thought_tokens), level) for p in prompts))
                frontier = [p + list(o.output_ids) + newline for p, o in zip(prompts, outs)]
            await asyncio.gather(*(gen(leaf + answer, greedy(answer_tokens), depth) for leaf in frontier))

        return run

    per = sum(width ** (d + 1) for d in range(depth)) + width**depth
    return Workload(
        "tree-of-thought",
        f"{n} questions x (width {width}, depth {depth}: {per} requests), "
        f"thought {thought_tokens}, answer {answer_tokens}",
        [program(i) for i in range(n)],
        n * per,
        params=dict(programs=n, width=width, depth=depth),
    )


BUILDERS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "few-shot": few_shot,
    "multi-turn": multi_turn,
    "agent-fanout": agent_fanout,
    "agent-loop": agent_loop,
    "tree-of-thought": tree_of_thought,
    "json-extraction": json_extraction,
    "no-sharing": no_sharing,
}


def make_workload(name: str, tok: Tokens, scale: float = 1.0, seed: int = 0, **overrides: Any) -> Workload:
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    return BUILDERS[name](tok, scale, seed, **overrides)


def stage_waves(records: Sequence[dict]) -> list[list[tuple[list[int], int]]]:
    """Recorded requests -> waves for the transformers replay: wave k holds every
    request of stage k, in submission order."""
    waves: dict[int, list[tuple[list[int], int]]] = {}
    for r in sorted(records, key=lambda r: r["order"]):
        waves.setdefault(r["stage"], []).append((r["input_ids"], r["completion_tokens"]))
    return [waves[k] for k in sorted(waves)]
