"""Programs and checks shared by the frontend tests: ``test_frontend_unit.py``
(a scripted backend, no model) and ``test_frontend.py`` (the embedded model)."""

from __future__ import annotations

from typing import Any

import pytest

from radixrt.frontend.errors import BackendError, ProgramError


def multi_turn_question(sgl: Any, max_tokens: int) -> Any:
    """SGLang's documented ``multi_turn_question`` program, written against
    ``sgl`` (the module a user imports as ``sgl``: radixrt, or its frontend),
    with ``max_tokens`` for both answers."""

    @sgl.function
    def multi_turn_question(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=max_tokens))
        s += sgl.user(question_2)
        s += sgl.assistant(sgl.gen("answer_2", max_tokens=max_tokens))

    return multi_turn_question


def assert_request_failure_surfaces(state: Any, failed: str, later: str) -> None:
    """The backend request producing variable ``failed`` of ``state`` failed:
    ``state.error()`` is that ``BackendError``, reading ``failed`` raises a
    ``ProgramError`` caused by it, and reading ``later`` (a variable the
    program would have produced afterwards) raises a ``ProgramError`` too."""
    assert isinstance(state.error(), BackendError)
    with pytest.raises(ProgramError) as ei:
        state[failed]
    assert isinstance(ei.value.__cause__, BackendError)
    with pytest.raises(ProgramError):
        state[later]
