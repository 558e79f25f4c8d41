"""JSON-schema keywords the grammar cannot enforce are refused, each one checked against
xgrammar itself: the grammar accepts an instance that breaks it (were xgrammar to enforce one
some day, its case here fails, and the keyword can come off the list)."""

from __future__ import annotations

import json

import pytest

from radixrt.sampling.grammar import check_grammar
from radixrt.sampling.schema_support import check_enforceable

INT = {"type": "integer"}
PAIR = {"type": "object", "properties": {"a": INT, "b": INT}}
# keyword -> (a schema using it, an instance that breaks the schema)
DROPPED = {
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]"),
    "not": ({**PAIR, "required": ["a"], "not": {"properties": {"a": {"const": 1}}}}, '{"a": 1}'),
    "if": ({**PAIR, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "dependentRequired": ({**PAIR, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependencies": ({**PAIR, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, "9"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3"),
}
# enforced: kept (the grammar refuses the instance)
ENFORCED = {
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 5}]}, "9"),  # pydantic's wrapper of one $ref
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": False, "maxItems": 1}, "[1, 1]"),
    "format": ({"type": "string", "format": "date"}, '"soon"'),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": INT}, "additionalProperties": False},
        '{"y": 1}',
    ),
}


def _accepts(schema: dict, text: str) -> bool:
    from xgrammar import testing

    from radixrt.sampling.json_schema_grammar import json_schema_grammar

    return testing._is_grammar_accept_string(json_schema_grammar(json.dumps(schema)), text)


@pytest.mark.parametrize("keyword", DROPPED)
def test_a_keyword_the_grammar_drops_is_refused_wherever_it_is(keyword):
    schema, breaking = DROPPED[keyword]
    assert _accepts(schema, breaking), f"xgrammar enforces {keyword!r} now: take it off the list"
    with pytest.raises(ValueError, match=f"'{keyword}' at # is not supported"):
        check_grammar(("json_schema", json.dumps(schema)))
    nested = {"type": "object", "properties": {"not": {"type": "array", "items": schema}}, "$defs": {"x": INT}}
    with pytest.raises(ValueError, match=f"'{keyword}' at #/properties/not/items is not supported"):
        check_enforceable(nested)  # a property named like a keyword is a name, not the keyword
    tag = {"structures": [{"begin": "<f>", "schema": nested, "end": "</f>"}], "triggers": ["<f"]}
    with pytest.raises(ValueError, match="sampling parameter 'structural_tag' is invalid"):
        check_grammar(("structural_tag", json.dumps(tag)))
    check_grammar(("json_schema", json.dumps(schema)), enforce_all=False)  # a non-strict tool's schema


@pytest.mark.parametrize("keyword", ENFORCED)
def test_what_the_grammar_enforces_is_taken(keyword):
    schema, breaking = ENFORCED[keyword]
    assert not _accepts(schema, breaking)
    check_grammar(("json_schema", json.dumps(schema)))
