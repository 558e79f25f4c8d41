"""A request body read whole under a size limit, then handed to the app: what the server's
and the router's ASGI guards both do before a route runs."""

from __future__ import annotations

from typing import Callable


class ClientLeft(Exception):
    """The client closed the connection before its request body was complete."""


class BodyTooLarge(Exception):
    """The request body passed the limit (the rest was not read)."""


async def read_body(receive: Callable, limit: int) -> bytes:
    """The whole body from an ASGI ``receive``; `BodyTooLarge` as soon as more than ``limit``
    bytes came, `ClientLeft` if the client disconnects first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft(f"the client left after sending {size} bytes of the request body")
        if message["type"] != "http.request":
            continue
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that gives the app ``body`` in one message, then passes through to
    ``receive`` (so the app still hears the client leave)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()

    return replay
