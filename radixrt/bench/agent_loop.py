"""The ``agent-loop`` workload of ``radixrt bench``: agents in a tool loop.

Every agent shares one system prompt and one tool list (OpenAI-style JSON
schemas), has a task of its own, and runs ``steps`` steps; in each step it
makes ``calls`` tool calls in parallel (one request each, forked from the
conversation so far: the assistant turn opened, then the call's name, the
model writes its arguments), the calls are joined into one assistant message
with the ``calls`` tool calls, and one ``role: "tool"`` message per call
brings its result back. After the last step one more request writes the
answer. So step s re-sends the whole conversation: the shared head, the
agent's task and every earlier call and result, which is what an OpenAI-SDK
agent does over ``/v1/chat/completions``.

Prompts are built at the token level (like every workload here) so that
shared prefixes are shared exactly:

* the head (system prompt, tools, the agent's task) is rendered by the
  model's chat template with its ``tools`` argument; a template that ignores
  tools (the embedded SmolLM2's) gets them in the system message as a JSON
  list, followed by how to call them (``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>``, one per call);
* an assistant turn is the template's assistant markers around the calls,
  each ``<tool_call>{"name": "<tool>", "arguments": `` + the model's tokens
  (as generated) + ``}</tool_call>``;
* a tool result is the template's rendering of a ``role: "tool"`` message
  (a user message where the template has no tool role).

Ideal prompt tokens (tokens never seen before, `common.ideal_prompt_tokens`)
against those computed, with the cache on and off, is the figure to read:
with the cache on only the new tail of each step (the calls' headers, the
previous step's calls and results) should be computed.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

from radixrt.bench.common import words
from radixrt.bench.workload_base import Gen, Program, Tokens, Workload, greedy

TOOL_NAMES = [
    "search_flights",
    "book_hotel",
    "get_weather",
    "convert_currency",
    "lookup_visa",
    "find_restaurants",
    "rent_car",
    "check_calendar",
]
CALL_OPEN = '<tool_call>\n{"name": "%s", "arguments": '
CALL_CLOSE = "}\n</tool_call>\n"


def tool_schemas(rng: random.Random, description_words: int) -> list[dict]:
    """One OpenAI function tool per name, with two or three string/number parameters."""
    tools = []
    for name in TOOL_NAMES:
        props: dict[str, Any] = {}
        for p in rng.sample(["city", "date", "country", "amount", "budget", "days", "cuisine", "user"], 3):
            props[p] = {
                "type": "number" if p in ("amount", "budget", "days") else "string",
                "description": words(rng, 6),
            }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": words(rng, description_words),
                    "parameters": {"type": "object", "properties": props, "required": list(props)[:2]},
                },
            }
        )
    return tools


class ChatBlocks:
    """Token blocks of one chat template: the conversation head, assistant
    markers and tool-result messages (see the module docstring)."""

    def __init__(self, tok: Tokens) -> None:
        self.tok = tok
        self.tokenizer = tok.tokenizer

    def _render(self, messages: list[dict], **kw: Any) -> str:
        from radixrt.requests.tokenizer_utils import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=False, extra=kw or None)

    def head(self, system: str, tools: list[dict], task: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        plain = self._render(messages)
        with_tools = self._render(messages, tools=tools)
        if with_tools == plain:  # the template ignores tools: the generic format in the system message
            listing = json.dumps([t["function"] for t in tools])
            messages[0]["content"] = (
                f"{system}\n\nYou can call these tools:\n<tools>{listing}</tools>\n"
                'To call a tool, write <tool_call>{"name": <tool name>, "arguments": '
                "<JSON object>}</tool_call>, one per call."
            )
            with_tools = self._render(messages)
        return self.tok.text(with_tools)

    def tool_result(self, call_id: str, content: str) -> list[int]:
        """A ``role: "tool"`` message as the template renders it after a system message."""
        base = [{"role": "system", "content": "s"}]
        msg = {"role": "tool", "content": content, "tool_call_id": call_id}
        try:
            before, after = self._render(base), self._render(base + [msg])
            if after.startswith(before) and content in after:
                return self.tok.text(after[len(before) :])
        except Exception:  # noqa: BLE001 - a template without a tool role
            pass
        return self.tok.role("user", f"Result of {call_id}: {content}")


def agent_loop(
    tok: Tokens,
    scale: float = 1.0,
    seed: int = 0,
    *,
    agents: int = 4,
    steps: int = 4,
    calls: int = 3,
    system_words: int = 120,
    tool_words: int = 20,
    task_words: int = 24,
    call_tokens: int = 12,
    result_words: int = 24,
    answer_tokens: int = 16,
    echo: bool = False,
) -> Workload:
    """``agents`` agents x ``steps`` steps x ``calls`` parallel tool calls, then an answer each
    (``echo``: see the module docstring)."""
    rng = random.Random(seed + 11)
    n = max(1, round(agents * scale))
    blocks = ChatBlocks(tok)
    system = "You are a travel agent. Use the tools to act for the user. " + words(rng, system_words)
    tools = tool_schemas(rng, tool_words)
    tasks = [(_echo_task(rng) if echo else "") + words(rng, task_words) for _ in range(n)]
    heads = [blocks.head(system, tools, "Task: " + task) for task in tasks]
    asst_open = tok.role("assistant", close=False)
    asst_close = tok.close("assistant")
    call_close = tok.text(CALL_CLOSE)
    answer_head = tok.text("All tool results are in. Answer:")
    # a step's calls name different tools (as parallel calls usually do), so its branches differ
    names = [
        rng.sample(TOOL_NAMES, calls) if calls <= len(TOOL_NAMES) else [rng.choice(TOOL_NAMES) for _ in range(calls)]
        for _ in range(steps)
    ]
    results = [[[words(rng, result_words) for _ in range(calls)] for _ in range(steps)] for _ in range(n)]

    def program(a: int) -> Program:
        async def run(gen: Gen) -> None:
            history = list(heads[a])
            for s in range(steps):
                opens = [tok.text(CALL_OPEN % name) for name in names[s]]
                outs = await asyncio.gather(*(gen(history + asst_open + o, greedy(call_tokens), s) for o in opens))
                if not all(r.ok for r in outs):
                    return
                turn = [t for o, r in zip(opens, outs) for t in o + list(r.output_ids) + call_close]
                history = history + asst_open + turn + asst_close
                for c in range(calls):
                    result = results[a][s][c]
                    if echo:
                        args = tok.tokenizer.decode(outs[c].output_ids)
                        result = f'{{"status": "ok", "arguments": {args.strip()}, "result": "{result}"}}'
                    history += blocks.tool_result(f"call_{s}_{c}", result)
            await gen(history + asst_open + answer_head, greedy(answer_tokens), steps)

        return run

    shape = (
        f"{n} agents x {steps} steps x {calls} parallel calls, shared head ~{len(heads[0])} tokens "
        f"({len(tools)} tools), {call_tokens}-token calls, {result_words}-word results, answer {answer_tokens}"
    )
    return Workload(
        "agent-loop",
        shape,
        [program(a) for a in range(n)],
        n * (steps * calls + 1),
        params=dict(agents=n, steps=steps, calls=calls, tools=len(tools), echo=echo),
    )


CITIES = ["Lisbon", "Osaka", "Nairobi", "Quito", "Tallinn", "Hobart", "Tromso", "Cusco", "Tbilisi", "Hanoi"]
TRAVELLERS = ["Ada Moreau", "Bram Okafor", "Chen Wei", "Dana Kowalski", "Emil Haddad", "Fern Alvarez"]


def _echo_task(rng: random.Random) -> str:
    """Concrete values for the tool calls' arguments to copy (``echo``)."""
    return (
        f"{rng.choice(TRAVELLERS)} (user id u-{rng.randrange(1000, 9999)}) flies to {rng.choice(CITIES)} on "
        f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d} for {rng.randrange(2, 15)} days with a "
        f"budget of {rng.randrange(5, 60) * 100} dollars and likes {rng.choice(['ramen', 'tapas', 'curry'])}. "
    )
