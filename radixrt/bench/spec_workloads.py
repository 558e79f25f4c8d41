"""The workloads of the speculative-decoding benchmark (``radixrt bench --speculative``).

Each builder returns a `Workload` of token-level programs (the ``gen``
protocol of ``workload_base``) with ``params["warm"]``: the prompts to
prefill before the timed run (single-turn workloads; empty where prompts
depend on earlier outputs). All generation is greedy with fixed lengths.

* ``agent-loop``: `agent_loop.agent_loop` with ``echo`` (the task names the
  values the tool calls' arguments copy, tool results echo the arguments),
  one call per step, so the number of agents in flight is the batch size;
* ``code-edit``: a Python function of 30-60 lines from the standard library
  (`code_snippets`, read with ``inspect.getsource``) and a small change to
  make (rename a parameter, add a comment); the answer copies most of it;
* ``no-repetition``: distinct open questions, nothing to copy;
* ``dsl-few-shot`` is not built here: it runs the frontend's
  `example_programs.capital_qa` through ``run_batch`` (see ``speculative``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import textwrap
from dataclasses import dataclass

from radixrt.bench.agent_loop import agent_loop
from radixrt.bench.workload_base import Gen, Program, Tokens, Workload, greedy

# Modules whose functions the code-edit prompts quote: pure Python, in every CPython.
CODE_MODULES = (
    "textwrap",
    "shlex",
    "difflib",
    "calendar",
    "argparse",
    "csv",
    "fnmatch",
    "posixpath",
    "tokenize",
    "heapq",
    "configparser",
    "urllib.parse",
    "base64",
    "gettext",
    "pprint",
    "string",
    "email.utils",
    "json.encoder",
    "ftplib",
    "smtplib",
    "tarfile",
    "zipfile",
    "pathlib",
    "inspect",
    "shutil",
    "statistics",
    "optparse",
    "locale",
    "plistlib",
    "ipaddress",
)
TOPICS = (
    "the deep ocean floor",
    "friendship between rivals",
    "volcanoes",
    "the first city ever built",
    "learning to play the cello",
    "a winter in the Arctic",
    "bees and their hives",
    "the history of paper",
    "a lighthouse keeper",
    "desert night skies",
    "the invention of the bicycle",
    "a market in the rain",
    "growing tomatoes",
    "glaciers",
    "an old clockmaker",
    "migrating birds",
    "the smell of bread",
    "a chess tournament",
    "coral reefs",
    "the silk road",
    "a robot that paints",
    "thunderstorms",
    "a mountain village",
    "the moons of Jupiter",
    "forgotten languages",
    "a long train journey",
    "fireflies",
    "the first day of school",
    "an abandoned library",
    "kites",
    "the northern lights",
    "a family recipe",
    "octopuses",
    "a jazz club at midnight",
    "salt",
    "the tallest tree",
    "a letter never sent",
    "sand dunes",
    "a shipwreck",
    "the color blue",
)
FORMS = (
    "Write a short story about {}.",
    "What would you tell a child about {}?",
    "Describe {} in your own words, with one surprising detail.",
    "Why do people find {} fascinating? Give your own view.",
)


@dataclass(frozen=True)
class Sizes:
    """Output lengths (tokens) and prompt shapes of the workloads."""

    code_tokens: int = 64
    code_min_lines: int = 30
    code_max_lines: int = 60
    answer_tokens: int = 48
    agent_steps: int = 3
    call_tokens: int = 32
    agent_answer_tokens: int = 16
    dsl_min_programs: int = 4


def code_snippets(n: int, min_lines: int = 30, max_lines: int = 60) -> list[str]:
    """``n`` distinct stdlib functions of ``min_lines``..``max_lines`` lines (dedented source),
    taken round-robin over `CODE_MODULES`, each module's functions in name order: the same
    list on every call with one Python version. Fewer if the modules do not hold ``n``."""
    per_module: list[list[str]] = []
    seen: set[str] = set()
    for name in CODE_MODULES:
        mod = importlib.import_module(name)
        found = []
        for _, obj in sorted(vars(mod).items()):
            if not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
                continue
            try:
                src = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if min_lines <= len(src.splitlines()) <= max_lines and src.startswith("def ") and src not in seen:
                seen.add(src)
                found.append(src)
        per_module.append(found)
    out: list[str] = []
    for i in range(max((len(f) for f in per_module), default=0)):
        out.extend(f[i] for f in per_module if i < len(f))
    return out[:n]


def edit_instruction(src: str, i: int) -> str:
    """The small change asked of snippet ``i``: rename its first parameter (even ``i``) or add a comment."""
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
    if i % 2 == 0 and params:
        return f"Rename the parameter `{params[0]}` to `{params[0]}_arg` everywhere in it."
    return f"Add the comment `# checked` as the first line of the body of `{fn.name}`."


def _single(name: str, shape: str, prompts: list[list[int]], sp: dict, **params: object) -> Workload:
    def program(ids: list[int]) -> Program:
        async def run(gen: Gen) -> None:
            await gen(ids, sp, 0)

        return run

    return Workload(name, shape, [program(p) for p in prompts], len(prompts), params={"warm": prompts, **params})


def _chat(tok: Tokens, user: str) -> list[int]:
    return tok.role("user", user) + tok.role("assistant", close=False)


def code_edit(tok: Tokens, n: int, sizes: Sizes = Sizes()) -> Workload:
    """``n`` requests, each a distinct function and a change to make; ``sizes.code_tokens`` out."""
    snippets = code_snippets(n, sizes.code_min_lines, sizes.code_max_lines)
    if len(snippets) < n:
        raise ValueError(
            f"only {len(snippets)} stdlib functions of {sizes.code_min_lines}-{sizes.code_max_lines} lines"
        )
    prompts = [
        _chat(
            tok,
            "Here is a Python function.\n\n```python\n" + src + "```\n\n" + edit_instruction(src, i) + " Reply with "
            "the complete rewritten function and nothing else.",
        )
        for i, src in enumerate(snippets)
    ]
    lines = [len(s.splitlines()) for s in snippets]
    return _single(
        "code-edit",
        f"{n} stdlib functions of {min(lines)}-{max(lines)} lines, rewrite with one change, {sizes.code_tokens} out",
        prompts,
        greedy(sizes.code_tokens),
    )


def open_questions(tok: Tokens, n: int, seed: int = 0, sizes: Sizes = Sizes()) -> Workload:
    """``n`` distinct open questions (a form x a topic, none repeated); ``sizes.answer_tokens`` out."""
    pairs = [(f, t) for t in TOPICS for f in FORMS]
    if n > len(pairs):
        raise ValueError(f"at most {len(pairs)} distinct open questions")
    random.Random(seed + 23).shuffle(pairs)
    prompts = [_chat(tok, form.format(topic)) for form, topic in pairs[:n]]
    return _single(
        "no-repetition", f"{n} distinct open questions, {sizes.answer_tokens} out", prompts, greedy(sizes.answer_tokens)
    )


def agent_replay(tok: Tokens, n: int, seed: int = 0, sizes: Sizes = Sizes()) -> Workload:
    """``n`` agents of `agent_loop` with ``echo``, one tool call per step."""
    wl = agent_loop(
        tok,
        1.0,
        seed,
        agents=n,
        steps=sizes.agent_steps,
        calls=1,
        system_words=60,
        call_tokens=sizes.call_tokens,
        answer_tokens=sizes.agent_answer_tokens,
        echo=True,
    )
    wl.params["warm"] = []
    return wl


TOKEN_WORKLOADS = ("agent-loop", "code-edit", "no-repetition")


def build(name: str, tok: Tokens, n: int, seed: int = 0, sizes: Sizes = Sizes()) -> Workload:
    """The token-level workload ``name`` with ``n`` programs."""
    if name == "agent-loop":
        return agent_replay(tok, n, seed, sizes)
    if name == "code-edit":
        return code_edit(tok, n, sizes)
    if name == "no-repetition":
        return open_questions(tok, n, seed, sizes)
    raise ValueError(f"unknown workload {name!r}; one of {', '.join(TOKEN_WORKLOADS)}")
