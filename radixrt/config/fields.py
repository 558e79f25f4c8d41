"""Settings as dataclass fields whose metadata carries their ``--help`` text,
and the command-line flags generated from them.

A field made with :func:`setting` holds its default and its help once; the
CLI adds one flag per field (``--field-name``; the type, the switch kind and
the default come from the field), so a flag's help, default and parsing cannot
drift from the field. Metadata keys besides ``help``:

* ``flag``: the flag's spelling when it is not ``--<name with dashes>``;
* ``aliases``: more spellings (``("--tp",)``);
* ``type``: the parser of the value (default: from the annotation);
* ``choices``: argparse's choices;
* ``env``: an environment variable whose value is the CLI default (the
  dataclass default stays; the help must say so, and the value is never
  printed);
* ``cli``: False for a setting that has no flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import numbers
import os
import types
import typing
from typing import Any, Optional


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field with default ``default`` and ``help`` (plus the CLI
    metadata keys of the module docstring)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


def flag_of(f: dataclasses.Field) -> str:
    """The command-line spelling of field ``f``."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def help_of(cls: type, name: str) -> str:
    """The help text of ``cls``'s field ``name``."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


@functools.cache
def _value_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's value type and whether it may be None (``Optional[T]``)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1
        out[name] = (args[0] if optional else hint, optional)
    return out


def check_number(cls: type, name: str, value: Any) -> None:
    """TypeError naming flag ``name`` (a field of ``cls``) when it takes a number and ``value``
    is not one (``max_total_tokens="big"`` failed later, as an arithmetic error of no flag)."""
    typ, _ = _value_types(cls)[name]
    if value is None or typ not in (int, float):
        return
    if not isinstance(value, numbers.Integral if typ is int else numbers.Real):
        raise TypeError(f"{name} must be {'an integer' if typ is int else 'a number'}, got {value!r}")


def add_fields_as_args(parser: Any, cls: type) -> None:
    """Add one flag per field of dataclass ``cls`` to ``parser`` (a parser or
    an argument group); ``dest`` is the field's name."""
    types_ = _value_types(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        kind, optional = types_[f.name]
        names = (flag_of(f), *f.metadata.get("aliases", ()))
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"], "default": f.default}
        if kind is bool:
            # off by default: --flag; on by default: --flag/--no-flag; unset (None) by default: either or neither
            kw["action"] = argparse.BooleanOptionalAction if optional or f.default else "store_true"
        elif typing.get_origin(kind) is list:  # a list of values: --flag a b c
            kw["nargs"] = "+"
            kw["type"] = f.metadata.get("type", typing.get_args(kind)[0])
        else:
            kw["type"] = f.metadata.get("type", kind)
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if "env" in f.metadata:
            kw["default"] = os.environ.get(f.metadata["env"], f.default)
        parser.add_argument(*names, **kw)


def values_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s fields that ``args`` holds, by field name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        listed = ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]
        raise ValueError(f"unknown {name} {value!r}; choose {listed}")


def first_line(cls: type) -> Optional[str]:
    """The first line of ``cls``'s docstring (an argument group's description)."""
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None
