"""A JSON schema's xgrammar ``Grammar``, with JSON's own rule for string characters.

xgrammar (0.2.9, the newest) compiles a string with ``minLength`` or ``maxLength``
to a counted repeat of ``[^"\\\r\n]``, which lets a model write the control
characters U+0000-U+001F (a tab, U+0019, ...) raw inside the string; RFC 8259
forbids them there, so ``json.loads`` refuses the answer (its unbounded strings
exclude them). The schema's grammar is rebuilt from its EBNF text with that class
excluding them, as xgrammar's unbounded strings do. Only grammars made from
schemas (a JSON schema, a structural tag's) go through here: the class means a
JSON string's character there.
"""

from __future__ import annotations

from typing import Any

# JSON layout the grammars enforce: one line, ", " between items, ": " after keys.
JSON_SEPARATORS = (", ", ": ")

_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def json_schema_grammar(schema_json: str) -> Any:
    """The xgrammar ``Grammar`` of ``schema_json`` (no free whitespace, ``JSON_SEPARATORS``);
    raises what xgrammar raises on a bad schema."""
    import xgrammar as xgr

    return with_json_string_chars(
        xgr.Grammar.from_json_schema(schema_json, any_whitespace=False, separators=JSON_SEPARATORS)
    )


def with_json_string_chars(grammar: Any) -> Any:
    """``grammar`` (made by xgrammar from a schema, or a structural tag holding schemas) with its
    bounded strings' character class excluding the control characters."""
    import xgrammar as xgr

    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def json_schema_ebnf(schema_json: str) -> str:
    """``json_schema_grammar`` as EBNF text (a structural tag's part)."""
    return str(json_schema_grammar(schema_json))
