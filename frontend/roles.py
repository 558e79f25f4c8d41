"""Chat turns: what ``SglRoleBegin`` / ``SglRoleEnd`` do to a program state.

A turn is rendered as text between the backend's role markers (so the
prompt is exactly what the model's chat template would produce) and
recorded as a message ``{"role", "content"}`` for backends that take
messages. Rules: turns do not nest, a turn is closed by its own role, and
when the first turn of an empty state is not a system turn the backend's
default system prompt (if its template has one) is inserted first, as the
template itself would (``global_config.insert_default_system_prompt``).

The functions take the program state's executor (``ex``) and use its
``text_``, ``messages_``, ``cur_role``, ``cur_role_begin_pos``,
``role_markers``, ``default_system_prompt`` and ``append``.
"""

from __future__ import annotations

from typing import Any

from .errors import FrontendError
from .global_config import global_config


def begin_role(ex: Any, role: str) -> None:
    """Open a ``role`` turn: append its begin marker (after the default
    system turn, when due) and remember where its content starts."""
    if ex.cur_role is not None:
        raise FrontendError(f"role {role!r} opened inside role {ex.cur_role!r}: roles cannot nest")
    if role not in ex.role_markers:
        raise FrontendError(f"unknown role {role!r}")
    if _default_system_due(ex, role):
        begin_role(ex, "system")
        ex.append(ex.default_system_prompt)
        end_role(ex, "system")
    ex.append(ex.role_markers[role][0])
    ex.cur_role = role
    ex.cur_role_begin_pos = len(ex.text_)


def end_role(ex: Any, role: str) -> None:
    """Close the open ``role`` turn: record its message and append its end marker."""
    if ex.cur_role != role:
        raise FrontendError(f"role {role!r} closed while {ex.cur_role!r} is open")
    content = ex.text_[ex.cur_role_begin_pos :].lstrip()  # as SGLang records the message
    ex.append(ex.role_markers[role][1])
    ex.messages_.append({"role": role, "content": content})
    ex.cur_role = None
    ex.cur_role_begin_pos = None


def _default_system_due(ex: Any, role: str) -> bool:
    return bool(
        role != "system"
        and not ex.messages_
        and not ex.text_
        and ex.default_system_prompt
        and global_config.insert_default_system_prompt
    )
