"""SGLang's ``sglang.lang.ir`` under radixrt: every public name of it,
importable from here (programs write ``from sglang.lang.ir import
REGEX_INT``).

This module defines nothing. The expression nodes live in ``nodes.py``, the
regexes of ``gen(dtype=...)`` and ``SglSamplingParams`` in
``sampling_params.py``, ``ChoicesSamplingMethod`` in ``choices.py``,
``global_config`` in ``global_config.py`` and ``SglFunction`` in
``function.py``. It sits above all of them and nothing in the frontend
imports it, so it may import the program object, which imports the
interpreter, which executes the nodes.
"""

from __future__ import annotations

from .choices import ChoicesSamplingMethod
from .function import SglFunction
from .global_config import global_config
from .nodes import (
    SglArgument,
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglFork,
    SglGen,
    SglGetForkItem,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglSeparateReasoning,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
    role_turn,
    to_expr,
)
from .sampling_params import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SglSamplingParams

__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "ChoicesSamplingMethod",
    "SglArgument",
    "SglCommitLazy",
    "SglConcateAndAppend",
    "SglConstantText",
    "SglExpr",
    "SglExprList",
    "SglFork",
    "SglFunction",
    "SglGen",
    "SglGetForkItem",
    "SglImage",
    "SglRoleBegin",
    "SglRoleEnd",
    "SglSamplingParams",
    "SglSelect",
    "SglSeparateReasoning",
    "SglVarScopeBegin",
    "SglVarScopeEnd",
    "SglVariable",
    "SglVideo",
    "global_config",
    "role_turn",
    "to_expr",
]
