"""Constrained-decoding benchmark: extract a fixed JSON schema from documents
with jump-forward on, with it off, and without any constraint.

    python -m radixrt.bench.constrained                      # 32 documents, default model
    python -m radixrt.bench.constrained --documents 8 --max-new-tokens 96 --json out.json

Every run sends all documents at once to an in-process Engine (greedy), after
a warm-up request that also compiles the schema (it is compiled once and
cached, so the runs measure decoding, not compilation); the radix cache is
flushed before each run. The two constrained runs use two engines that
differ only in ``enable_jump_forward``; the unconstrained run reuses the
jump-forward engine (no grammar, so jump-forward does nothing there).

Reported per run: wall time, engine steps (batched forward passes), output
tokens, output-token throughput, valid JSON objects (``jsonschema``), and
for jump-forward the draft tokens proposed and kept. "Decode steps saved"
is the number of output tokens that entered through verified drafts: each
would have cost a request one decode step. Jump-forward's output equals the
token-by-token run's (checked and reported). Figures are ratios from one run
on one machine; absolute times only mean something on that machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any, Optional

from radixrt.help_format import HelpFormatter

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "occupation": {"type": "string", "maxLength": 30},
        "employed": {"type": "boolean"},
        "contact": {
            "type": "object",
            "properties": {
                "email": {"type": "string", "maxLength": 40},
                "phone": {"type": "string", "pattern": "[0-9]{3}-[0-9]{4}"},
            },
            "required": ["email", "phone"],
        },
        "languages": {
            "type": "array",
            "items": {"type": "string", "enum": ["English", "French", "Spanish", "German", "Japanese"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "city", "occupation", "employed", "contact", "languages"],
}
FIRST = "Ada Ben Chloe Dmitri Elena Farid Grace Hiro Ines Jonas Kavya Liam Maya Noah Olga Pedro".split()
LAST = "Brook Chen Diaz Evans Fischer Garcia Hughes Ito Jensen Khan Lopez Moreau Novak Okafor".split()
CITIES = "Lisbon Oslo Kyoto Lima Accra Quito Riga Porto Hanoi Perth Dakar Bern".split()
JOBS = "nurse pilot baker teacher plumber chemist farmer librarian welder architect".split()
LANGS = ["English", "French", "Spanish", "German", "Japanese"]


def make_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` short synthetic biographies holding every field of SCHEMA."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        langs = rng.sample(LANGS, rng.randrange(1, 4))
        employed = rng.random() < 0.7
        docs.append(
            f"{first} {last} is {rng.randrange(19, 80)} years old and lives in {rng.choice(CITIES)}. "
            f"{'They work as a' if employed else 'They used to work as a'} {rng.choice(JOBS)}"
            f"{'' if employed else ' and are now retired'}. You can reach {first} at "
            f"{first.lower()}.{last.lower()}@example.com or by phone on {rng.randrange(100, 999)}-"
            f"{rng.randrange(1000, 9999)}. {first} speaks {', '.join(langs[:-1]) + ' and ' if len(langs) > 1 else ''}"
            f"{langs[-1]}."
        )
    return docs


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_once(engine: Any, prompts: list[str], sampling: dict) -> dict:
    engine.flush_cache()
    before = engine.get_stats()
    t0 = time.perf_counter()
    results = engine.generate(prompts, [dict(sampling) for _ in prompts])
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    delta = {
        k: after[k] - before[k] for k in ("steps", "generated_tokens", "jump_forward_proposed", "jump_forward_tokens")
    }
    out_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "wall_s": wall,
        "steps": delta["steps"],
        "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / wall,
        "valid": sum(_valid(r["text"]) for r in results),
        "finished_stop": sum(r["meta_info"]["finish_reason"]["type"] == "stop" for r in results),
        "draft_proposed": delta["jump_forward_proposed"],
        "decode_steps_saved": delta["jump_forward_tokens"],
        "output_ids": [r["output_ids"] for r in results],
        "sample": results[0]["text"],
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.constrained",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--documents", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)

    from radixrt.engine import Engine

    schema = json.dumps(SCHEMA)
    docs = make_documents(args.documents, args.seed)
    constrained = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "json_schema": schema}
    free = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    runs: dict[str, dict] = {}
    for label, jf in (("jump-forward on", True), ("jump-forward off", False)):
        engine = Engine(args.model, max_total_tokens=args.max_total_tokens, device=args.device, enable_jump_forward=jf)
        try:
            system = (
                "Extract the person described in the document into JSON with the fields name, age, city, "
                "occupation, employed, contact (email, phone) and languages. Reply with the JSON object only."
            )
            prompts = [
                engine.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": d}])
                for d in docs
            ]
            engine.generate(prompts[0], {**constrained, "max_new_tokens": 4})  # warm-up + compile the schema
            runs[label] = run_once(engine, prompts, constrained)
            if jf:
                runs["unconstrained"] = run_once(engine, prompts, free)
        finally:
            engine.shutdown()

    on, off, plain = runs["jump-forward on"], runs["jump-forward off"], runs["unconstrained"]
    identical = on["output_ids"] == off["output_ids"]
    print(
        f"{args.documents} documents, <= {args.max_new_tokens} new tokens, greedy, model {args.model}, "
        f"device {args.device}"
    )
    print(
        f"{'run':<18} {'wall s':>7} {'steps':>6} {'out tok':>8} {'tok/s':>7} {'valid':>6} {'stop':>5} "
        f"{'drafted':>8} {'saved':>6}"
    )
    for label in ("jump-forward on", "jump-forward off", "unconstrained"):
        r = runs[label]
        print(
            f"{label:<18} {r['wall_s']:7.2f} {r['steps']:6d} {r['output_tokens']:8d} {r['tokens_per_s']:7.1f} "
            f"{r['valid']:6d} {r['finished_stop']:5d} {r['draft_proposed']:8d} {r['decode_steps_saved']:6d}"
        )
    saved = on["decode_steps_saved"]
    print(
        f"decode steps saved by jump-forward: {saved} of {on['output_tokens']} output tokens "
        f"({100 * saved / max(on['output_tokens'], 1):.1f}%); draft tokens kept {saved}/{on['draft_proposed']}"
    )
    print(
        f"throughput ratio jump-forward on / off: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x "
        f"(wall {off['wall_s'] / on['wall_s']:.2f}x); engine steps {on['steps']} vs {off['steps']}"
    )
    print(
        f"throughput ratio jump-forward on / unconstrained: {on['tokens_per_s'] / plain['tokens_per_s']:.2f}x; "
        f"off / unconstrained: {off['tokens_per_s'] / plain['tokens_per_s']:.2f}x"
    )
    print(f"jump-forward on and off outputs identical: {identical}")
    print(f"sample output: {on['sample']}")
    if args.json_out:
        figures = {k: {kk: vv for kk, vv in v.items() if kk != "output_ids"} for k, v in runs.items()}
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": figures, "identical_outputs": identical}, f, indent=2)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
