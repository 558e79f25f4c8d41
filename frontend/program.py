"""`Program`: what running and tracing need of a program object.

``function.py``'s `SglFunction` (what ``@function`` makes) is the program
object; the interpreter (interpreter.py) runs one and the tracer (tracer.py)
traces one. Both take any object with the attributes below rather than
`SglFunction` itself, because function.py imports both of them: typing them
against this protocol keeps the frontend's imports one-way (function ->
interpreter -> tracer -> program).
"""

from __future__ import annotations

from typing import Any, Protocol


class Program(Protocol):
    """A program's name, its parameters and how to call its body."""

    __name__: str
    arg_names: list[str]  # the program arguments (the parameters after the state), in order
    bind_arguments: dict[str, Any]  # arguments fixed by ``bind``

    def bind_args(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional and keyword program arguments (over the bound ones) by name."""
        ...

    def call_body(self, state: Any, arguments: dict[str, Any]) -> Any:
        """Call the program's function on ``state`` with ``arguments``."""
        ...
