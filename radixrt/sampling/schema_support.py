"""Which JSON-schema keywords a constrained request may use: those the grammar enforces.

xgrammar (0.2.9) compiles a schema's structure, types, enums, consts, ranges, lengths,
patterns, formats, item and property counts, but a few assertions it drops without a word:
a request whose schema holds one of them would get a ``stop`` answer that breaks its own
schema (``uniqueItems`` gave ``[1, 2, 2]``). As OpenAI's strict structured outputs and vLLM's
xgrammar backend do, such a schema is refused (a ValueError, a 400 on the server), naming
the keyword and where it is. Checked against xgrammar's grammar, a violating instance for each:

* ``uniqueItems: true``, ``contains`` / ``minContains`` / ``maxContains``;
* ``not``, ``if`` / ``then`` / ``else``, ``dependentRequired``, ``dependentSchemas``,
  ``dependencies``;
* ``allOf`` of more than one schema (one schema, pydantic's wrapper of a ``$ref``, is enforced);
* ``multipleOf`` other than a whole number on an ``integer`` (on a ``number`` it is dropped).

Annotations (``title``, ``description``, ``default``, ``examples``, an unknown ``format`` or
``contentEncoding``) assert nothing and pass. ``oneOf`` is enforced as ``anyOf`` is (every
engine does so): an instance that matches two of its branches is not refused. This module
imports no torch and no xgrammar.
"""

from __future__ import annotations

from typing import Any, Iterator

# keywords whose value is one subschema, a list of them, or a name -> subschema mapping
_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "contains", "not", "if", "then", "else")  # fmt: skip
_MANY = ("prefixItems", "allOf", "anyOf", "oneOf", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DROPPED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
            "dependentSchemas", "dependencies")  # fmt: skip


def _subschemas(node: dict, path: str) -> Iterator[tuple[Any, str]]:
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield node[key], f"{path}/{key}"
    for key in _MANY:
        if isinstance(node.get(key), list):
            yield from ((s, f"{path}/{key}/{i}") for i, s in enumerate(node[key]))
    for key in _NAMED:
        if isinstance(node.get(key), dict):
            yield from ((s, f"{path}/{key}/{name}") for name, s in node[key].items())


def _dropped(node: dict) -> Iterator[str]:
    """The keywords of one schema object that the grammar would not enforce."""
    yield from (key for key in _DROPPED if key in node)
    if node.get("uniqueItems") is True:
        yield "uniqueItems"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        yield "allOf"
    if "multipleOf" in node:
        step = node["multipleOf"]
        whole = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
        if node.get("type") != "integer" or not whole:
            yield "multipleOf"


def check_enforceable(schema: Any) -> None:
    """ValueError naming the first keyword of ``schema`` (a parsed JSON schema) that the
    grammar would not enforce, and where it is (a JSON pointer)."""
    stack = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in _dropped(node):
            why = "an allOf of more than one schema" if key == "allOf" else "this keyword"
            raise ValueError(
                f"the schema's {key!r} at {path} is not supported: constrained decoding cannot enforce {why}, "
                "so answers could break the schema (remove it, or check answers yourself)"
            )
        stack.extend(reversed(list(_subschemas(node, path))))


def check_tag_schemas(tag: Any) -> None:
    """`check_enforceable` for every schema a structural tag holds: its ``structures``' (the
    earlier form) and the ``json_schema`` contents of its ``format`` (xgrammar's)."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                check_enforceable(node["json_schema"])
            for st in node.get("structures", ()) if isinstance(node.get("structures"), list) else ():
                if isinstance(st, dict):
                    check_enforceable(st.get("schema"))
            stack.extend(v for k, v in node.items() if k not in ("structures", "json_schema"))
