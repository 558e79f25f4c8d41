"""A 5-shot batch with a progress bar.

    python examples/few_shot_batch.py [--n 64]

Every program starts with the same five worked examples. ``run_batch``
prefills that shared prefix once before the batch; every program then
computes only its own question, and the requests batch together.
"""
import argparse
import time

import radixrt as rt

FEW_SHOT = [("Germany", "Berlin"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Canada", "Ottawa"),
            ("Egypt", "Cairo")]
QUESTIONS = [
    ("France", "Paris"), ("Italy", "Rome"), ("England", "London"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Ireland", "Dublin"), ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("Switzerland", "Bern"), ("Czechia", "Prague"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Ukraine", "Kyiv"), ("Turkey", "Ankara"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Israel", "Jerusalem"), ("Saudi Arabia", "Riyadh"),
    ("India", "New Delhi"), ("Pakistan", "Islamabad"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("South Korea", "Seoul"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Malaysia", "Kuala Lumpur"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Mexico", "Mexico City"), ("Cuba", "Havana"),
    ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Peru", "Lima"), ("Colombia", "Bogota"),
    ("Venezuela", "Caracas"), ("Brazil", "Brasilia"), ("Kenya", "Nairobi"), ("Ethiopia", "Addis Ababa"),
    ("Nigeria", "Abuja"), ("Ghana", "Accra"), ("Morocco", "Rabat"), ("Algeria", "Algiers"),
    ("Tunisia", "Tunis"), ("Senegal", "Dakar"), ("Uganda", "Kampala"), ("Afghanistan", "Kabul"),
    ("Nepal", "Kathmandu"), ("Bangladesh", "Dhaka"), ("Sri Lanka", "Colombo"), ("Mongolia", "Ulaanbaatar"),
    ("Iceland", "Reykjavik"), ("Estonia", "Tallinn"), ("Latvia", "Riga"),
]
PREAMBLE = "Answer with the name of the capital city.\n\n" + "".join(
    f"Question: What is the capital of {c}?\nAnswer: {a}\n\n" for c, a in FEW_SHOT
)


@rt.function
def capital_qa(s, country):
    s += PREAMBLE
    s += "Question: What is the capital of " + country + "?\nAnswer:"
    s += rt.gen("answer", max_tokens=8, stop="\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args()
    engine = rt.Engine()
    rt.set_default_backend(engine)
    questions = (QUESTIONS * (args.n // len(QUESTIONS) + 1))[: args.n]

    t = time.time()
    states = capital_qa.run_batch([{"country": c} for c, _ in questions], temperature=0, progress_bar=True)
    elapsed = time.time() - t

    correct = sum(st["answer"].strip() == a for st, (_, a) in zip(states, questions))
    metas = [st.get_meta_info("answer") for st in states]
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    for st, (c, a) in list(zip(states, questions))[:5]:
        print(f"capital of {c}: {st['answer'].strip()} (expected {a})")
    print(f"\n{args.n} programs in {elapsed:.1f}s; {correct}/{args.n} correct")
    print(f"prompt tokens served from the radix cache: {cached}/{prompt} ({cached / prompt:.0%})")
    engine.shutdown()


if __name__ == "__main__":
    main()
