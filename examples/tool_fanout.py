"""Tool-call fan-out in the DSL: fork into k tool calls, run them, join.

    python examples/tool_fanout.py

One conversation (a system prompt listing the tools in radixrt's generic
tool format, then the user's request) is forked into one branch per tool.
Each branch writes its call as ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``, with the tool's name as forced text and the arguments
constrained by the tool's JSON schema; the call is read back with the
same parser the OpenAI route uses, the tool runs in Python, and its result
goes back into the branch as a ``<tool_response>`` turn. The branches run
together and share the conversation's KV from the radix cache; the join
gathers the results and the agent answers. The figures printed at the end
are the prompt tokens each branch found cached.

Over HTTP the same loop is a plain OpenAI-SDK agent: ``tools=...``,
``tool_choice="required"`` and ``message.tool_calls`` (docs/tool_calling.md).
"""

import json
import time

import radixrt as rt
from radixrt.server.tools import check_tools, get_parser
from radixrt.server.tools.render import generic_tools_text

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "restaurants",
            "description": "Restaurants in a city for a budget",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "budget": {"type": "string", "enum": ["low", "mid", "high"]},
                },
                "required": ["city", "budget"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "sights",
            "description": "Sights worth seeing in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "count": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["city", "count"],
            },
        },
    },
]
RUN = {
    "weather": lambda a: f"{a['city']}: sunny, 24 C",
    "restaurants": lambda a: f"{a['city']} ({a['budget']}): grilled fish by the river",
    "sights": lambda a: f"{a['count']} sights in {a['city']}: the tower, the old quarter, the hill",
}
PARSER = get_parser("generic", None)
SYSTEM = "You are a travel agent. Call the tools you are asked to call.\n\n" + generic_tools_text(
    check_tools(TOOLS, "required", None), PARSER
)


def call_prefix(name: str) -> str:
    """The forced start of a call of ``name`` in the generic format."""
    return PARSER.call_begin(name)


def run_call(name: str, args_text: str) -> str:
    """Read back the call a branch wrote (``args_text``: its arguments) and run the tool."""
    (call,) = PARSER.parse(call_prefix(name) + args_text + PARSER.call_end).named_calls()
    return RUN[call.name](json.loads(call.args))  # the tool runs here, in Python


@rt.function
def plan_trip(s, request):
    s += rt.system(SYSTEM)
    s += rt.user(request)
    branches = s.fork(len(TOOLS))
    for branch, tool in zip(branches, TOOLS):
        fn = tool["function"]
        branch += rt.user(f"Call the {fn['name']} tool.")
        branch += rt.assistant(
            call_prefix(fn["name"]) + rt.gen("args", max_tokens=40, json_schema=fn["parameters"]) + PARSER.call_end
        )
        result = run_call(fn["name"], branch["args"])
        branch += rt.user(f"<tool_response>\n{result}\n</tool_response>")
        branch += rt.assistant(rt.gen("note", max_tokens=24, stop="\n"))
    branches.join()  # s["args"] and s["note"] are now lists, one entry per tool
    s += rt.user("Write a one-sentence plan from the tool results.")
    s += rt.assistant(rt.gen("plan", max_tokens=48, frequency_penalty=0.8))


def main() -> None:
    engine = rt.Engine()
    rt.set_default_backend(engine)
    t = time.time()
    state = plan_trip.run(request="A weekend in Lisbon on a small budget: what should I know?", temperature=0)
    for tool, args, meta in zip(TOOLS, state["args"], state.get_meta_info("args")):
        name = tool["function"]["name"]
        print(f"{name}({args}) -> cached {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens")
    print("plan:", state["plan"].strip())
    print(f"ran in {time.time() - t:.1f}s")
    engine.shutdown()


if __name__ == "__main__":
    main()
