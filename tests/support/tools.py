"""The function tools the OpenAI tool-calling tests declare, in the shapes of
both OpenAI routes: chat completions nest the function
(``{"type": "function", "function": {...}}``), the Responses API does not
(``{"type": "function", "name": ..., ...}``)."""

from __future__ import annotations

from typing import Any

INSTRUCTIONS = "You are a careful assistant. Use the tools to answer."

WEATHER_FUNCTION: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}
ADD_FUNCTION: dict[str, Any] = {
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999},
            "b": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["a", "b"],
    },
}
# tool name -> the JSON schema its arguments must satisfy
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER_FUNCTION, ADD_FUNCTION)}


def chat_tool(function: dict[str, Any]) -> dict[str, Any]:
    """``function`` as a ``tools`` entry of /v1/chat/completions."""
    return {"type": "function", "function": function}


def responses_tool(function: dict[str, Any]) -> dict[str, Any]:
    """``function`` as a ``tools`` entry of /v1/responses."""
    return {"type": "function", **function}
