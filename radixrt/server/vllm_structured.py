"""vLLM's structured-output fields on the OpenAI routes: ``structured_outputs``
(``{"json": ...}``, ``"regex"``, ``"choice"``, ``"grammar"``, ``"json_object"``,
``"structural_tag"``) and the older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``, as radixrt's constraint sampling parameters (``json_schema``, ``regex``,
``ebnf``, ``structural_tag``).

Unknown fields are ignored on these routes, so without this a vLLM client's constraint would be
dropped without a word and its output left free. A request sets at most one constraint, whatever
its vocabulary (OpenAI's ``response_format``, SGLang's ``regex``/``json_schema``/``ebnf``, vLLM's);
two are a 400 naming both, as is a value of the wrong kind or a grammar that cannot compile.
vLLM's tuning knobs (``guided_decoding_backend``, ``guided_whitespace_pattern``,
``structured_outputs.disable_any_whitespace`` ...) are accepted and not used.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from radixrt.sampling.grammar import check_grammar
from radixrt.server.errors import bad_request

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_KNOBS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

Constraint = tuple[str, str, str]  # (the field that asked, the sampling parameter, its source)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    quoted = ('"' + "".join(_EBNF_ESCAPES.get(c, c) for c in choice) + '"' for choice in choices)
    return "root ::= " + " | ".join(quoted)


def _constraint(field: str, kind: str, value: Any) -> Constraint:
    """``value`` of vLLM's ``kind`` (json, regex, choice, grammar, json_object, structural_tag)."""
    if kind == "json" and isinstance(value, (str, dict)):
        return field, "json_schema", value if isinstance(value, str) else json.dumps(value)
    if kind in ("regex", "grammar") and isinstance(value, str):
        return field, "regex" if kind == "regex" else "ebnf", value
    if kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return field, "ebnf", choice_grammar(value)
    if kind == "json_object" and value is True:
        return field, "json_schema", json.dumps({"type": "object"})
    if kind == "structural_tag" and isinstance(value, (str, dict)):
        return field, "structural_tag", value if isinstance(value, str) else json.dumps(value)
    wanted = {
        "json": "a JSON schema (an object or its text)",
        "choice": "a non-empty list of strings",
        "json_object": "true",
        "structural_tag": "a structural tag (an object or its text)",
    }.get(kind, "a string")
    raise bad_request(f"'{field}' must be {wanted}.", field)


def vllm_constraints(req: Any) -> list[Constraint]:
    """The constraints the request's vLLM fields set, each checked for its kind."""
    found = []
    for name in GUIDED_FIELDS:
        value = getattr(req, name, None)
        if value is not None:
            found.append(_constraint(name, name.removeprefix("guided_"), value))
    so: Optional[Any] = getattr(req, "structured_outputs", None)
    if so is not None and not isinstance(so, dict):
        raise bad_request("'structured_outputs' must be an object.", "structured_outputs")
    for key, value in (so or {}).items():
        if value is None or value is False or key in _KNOBS:
            continue
        if key not in ("json", "regex", "choice", "grammar", "json_object", "structural_tag"):
            where = f"structured_outputs.{key}"
            raise bad_request(f"'{where}' is not a structured output this server knows.", where)
        found.append(_constraint(f"structured_outputs.{key}", key, value))
    return found


def vllm_constraint_sampling(req: Any, others: list[str]) -> dict[str, str]:
    """The sampling parameter of the request's one vLLM constraint ({} without one); 400 where it
    sets several, or one beside ``others`` (the request's other constraint fields that are set),
    or one that cannot compile."""
    found = vllm_constraints(req)
    if not found:
        return {}
    field, kind, source = found[0]
    named = [f for f, _, _ in found[1:]] + others
    if named:
        listed = ", ".join(f"'{n}'" for n in named)
        raise bad_request(f"'{field}' cannot be combined with {listed}: give one constraint.", field)
    try:
        check_grammar((kind, source))
    except ValueError as e:
        raise bad_request(f"'{field}' is unusable: {str(e).split(': ', 1)[-1]}", field) from None
    return {kind: source}
