"""The programs of ``examples/few_shot_batch.py`` and
``examples/tree_of_thought.py``, kept in one place so that the program
benchmark (``python -m radixrt.bench.programs``) measures exactly the programs
the examples run.

    import radixrt as rt
    from radixrt.bench.example_programs import capital_qa

    rt.set_default_backend(rt.Engine())
    print(capital_qa.run(country="France", temperature=0)["answer"])
"""

from __future__ import annotations

import radixrt as rt

# --- 5-shot capital cities ------------------------------------------------------

# The worked examples every ``capital_qa`` program starts with.
FEW_SHOT_CAPITALS = [
    ("Germany", "Berlin"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
]
# The questions: (country, its capital), none of them among the worked examples.
CAPITAL_QUESTIONS = [
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("England", "London"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Austria", "Vienna"),
    ("Poland", "Warsaw"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Ireland", "Dublin"),
    ("Hungary", "Budapest"),
    ("Belgium", "Brussels"),
    ("the Netherlands", "Amsterdam"),
    ("Switzerland", "Bern"),
    ("Czechia", "Prague"),
    ("Romania", "Bucharest"),
    ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"),
    ("Ukraine", "Kyiv"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("Israel", "Jerusalem"),
    ("Saudi Arabia", "Riyadh"),
    ("India", "New Delhi"),
    ("Pakistan", "Islamabad"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("South Korea", "Seoul"),
    ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"),
    ("Malaysia", "Kuala Lumpur"),
    ("Australia", "Canberra"),
    ("New Zealand", "Wellington"),
    ("Mexico", "Mexico City"),
    ("Cuba", "Havana"),
    ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"),
    ("Peru", "Lima"),
    ("Colombia", "Bogota"),
    ("Venezuela", "Caracas"),
    ("Brazil", "Brasilia"),
    ("Kenya", "Nairobi"),
    ("Ethiopia", "Addis Ababa"),
    ("Nigeria", "Abuja"),
    ("Ghana", "Accra"),
    ("Morocco", "Rabat"),
    ("Algeria", "Algiers"),
    ("Tunisia", "Tunis"),
    ("Senegal", "Dakar"),
    ("Uganda", "Kampala"),
    ("Afghanistan", "Kabul"),
    ("Nepal", "Kathmandu"),
    ("Bangladesh", "Dhaka"),
    ("Sri Lanka", "Colombo"),
    ("Mongolia", "Ulaanbaatar"),
    ("Iceland", "Reykjavik"),
    ("Estonia", "Tallinn"),
    ("Latvia", "Riga"),
]
CAPITALS_PREAMBLE = "Answer with the name of the capital city.\n\n" + "".join(
    f"Question: What is the capital of {c}?\nAnswer: {a}\n\n" for c, a in FEW_SHOT_CAPITALS
)


@rt.function
def capital_qa(s, country):
    """The five worked examples, then the question about ``country``; the
    capital lands in ``s["answer"]``. Every program shares the preamble, so a
    batch of them prefills it once and hits it in the radix cache."""
    s += CAPITALS_PREAMBLE
    s += "Question: What is the capital of " + country + "?\nAnswer:"
    s += rt.gen("answer", max_tokens=8, stop="\n") + "\n"


# --- tree of thought -------------------------------------------------------------

TOT_QUESTION = "A farmer has 3 pens with 4 sheep in each pen. He buys 5 more sheep. How many sheep does he have now?"


@rt.function
def tree_of_thought(s, question, width=4, depth=2, thought_tokens=24):
    """``depth`` levels of ``fork(width)`` thoughts (sampled, each branch with
    its own seed, so the tree is diverse but reproducible), then a greedy
    answer and a yes/no ``select`` self-check on every leaf.

    Returns the leaves as ``(yes_score, answer, path)``, best first: the
    normalized logprob of " yes", the stripped answer, and the thoughts that
    led to it."""
    s += rt.system("You solve problems by thinking step by step.")
    s += rt.user(question)
    s += rt.assistant_begin()
    frontier = [s]
    for level in range(depth):
        children = []
        for n, node in enumerate(frontier):
            kids = node.fork(width)
            for k, kid in enumerate(kids):
                seed = 1000 * level + width * n + k
                kid += (
                    f"Step {level + 1}:"
                    + rt.gen("thought", max_tokens=thought_tokens, stop="\n", temperature=0.8, top_p=0.95, seed=seed)
                    + "\n"
                )
            children.extend(kids)
        frontier = children
    for leaf in frontier:
        leaf += "Answer:" + rt.gen("answer", max_tokens=12, stop="\n", temperature=0) + "\n"
        leaf += "Is this answer correct (yes or no)?" + rt.select("verdict", choices=[" yes", " no"])
    leaves = []
    for leaf in frontier:
        yes_score = leaf.get_meta_info("verdict")["normalized_prompt_logprobs"][0]
        path = leaf.text()[len(s.text()) :].split("Answer:")[0]
        leaves.append((yes_score, leaf["answer"].strip(), path))
    leaves.sort(key=lambda x: -x[0])
    return leaves
