"""Agent tool-call fan-out with fork.

    python examples/agent_fanout.py

A trip-planning agent reads a request, then forks one branch per tool
(weather, food, sights). Each branch writes its tool call, the tool runs in
Python, and the branch summarizes the observation. The branches run
concurrently: their requests reach the engine together, batch, and share the
conversation prefix from the radix cache. The join gathers the summaries and
the agent writes the final answer.
"""

import time

import radixrt as rt

TOOLS = {
    "weather": lambda city: {"lisbon": "sunny, 24 C", "oslo": "rain, 9 C"}.get(city.lower(), "mild, 18 C"),
    "food": lambda city: {
        "lisbon": "grilled sardines and pastel de nata",
        "oslo": "smoked salmon and cinnamon buns",
    }.get(city.lower(), "local street food"),
    "sights": lambda city: {
        "lisbon": "Belem Tower and the Alfama district",
        "oslo": "the Opera House and Vigeland Park",
    }.get(city.lower(), "the old town"),
}

SYSTEM = (
    "You are a travel agent. You call tools by writing a city name, read the tool result, "
    "and summarize it in one sentence."
)


@rt.function
def plan_trip(s, request):
    s += rt.system(SYSTEM)
    s += rt.user(request)
    s += rt.assistant("The city is:" + rt.gen("city", max_tokens=6, stop=["\n", ".", ","]))
    city = s["city"].strip()

    branches = s.fork(len(TOOLS))
    for branch, tool in zip(branches, TOOLS):
        branch += rt.user(f"Call the {tool} tool.")
        branch += rt.assistant(f'{tool}(city="' + rt.gen("arg", max_tokens=6, stop='"') + '")')
        observation = TOOLS[tool](branch["arg"].strip() or city)  # the tool runs here, in Python
        branch += rt.user(f"Tool result: {observation}. Summarize it in one sentence.")
        branch += rt.assistant(rt.gen("summary", max_tokens=32, stop="\n", frequency_penalty=0.8))
    branches.join()  # s["summary"] and s["arg"] are now lists, one entry per tool

    notes = "\n".join(f"- {tool}: {summary.strip()}" for tool, summary in zip(TOOLS, s["summary"]))
    s += rt.user(f"Notes:\n{notes}\nWrite a two-sentence plan for the trip.")
    s += rt.assistant(rt.gen("plan", max_tokens=64, frequency_penalty=0.8))


def main() -> None:
    engine = rt.Engine()
    rt.set_default_backend(engine)
    t = time.time()
    state = plan_trip.run(request="I want to spend a weekend in Lisbon. What should I know?", temperature=0)
    print("city:", state["city"].strip())
    for tool, arg, summary, meta in zip(TOOLS, state["arg"], state["summary"], state.get_meta_info("summary")):
        print(f"[{tool}({arg!r})] {summary.strip()}")
        print(f"    cached {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens")
    print("\nplan:", state["plan"].strip())
    print(f"\nran in {time.time() - t:.1f}s")
    engine.shutdown()


if __name__ == "__main__":
    main()
