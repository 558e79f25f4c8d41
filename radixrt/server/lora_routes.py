"""LoRA adapters over HTTP (SGLang's routes): ``POST /load_lora_adapter``
(``{"lora_name": ..., "lora_path": ...}``: load, or reload with new weights)
and ``POST /unload_lora_adapter`` (``{"lora_name": ...}``).

With an admin key set (``--admin-api-key``) both need it (they read the
server's disk); without one, what every route needs. The server answers to
``"<adapter>"`` and ``"<served model>:<adapter>"`` on the OpenAI routes for each loaded adapter
(`ServerContext.lora_of`) and lists them in ``/v1/models``; on ``/generate``
an adapter is ``lora_path``, one per prompt or one for all. Under ``--dp`` the front sends
both to every replica (radixrt/router/broadcast.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import ServerError, bad_request
from radixrt.server.http_utils import JSON, read_json

router = APIRouter()


async def _body(request: Request, ctx: ServerContext, fields: tuple[str, ...]) -> dict:
    if ctx.admin_api_key:
        ctx.require_admin(request, "loading and unloading LoRA adapters")
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name]:
            raise bad_request(f"'{name}' must be a non-empty string.", name)
    return body


async def _control(ctx: ServerContext, name: str, path: str | None) -> Response:
    reply = await ctx.tm.lora_control(name, path)
    if not reply.ok:
        message = str(reply.payload.get("error", "refused"))
        about_the_name = path is None or message.startswith(("LoRA adapter name", "unknown LoRA adapter"))
        raise ServerError(400, message, "lora_name" if about_the_name else "lora_path")
    adapters = reply.payload.get("adapters", [])
    ctx.lora_adapters = {a["name"] for a in adapters}
    return JSON({"success": True, "loaded_adapters": {a["name"]: a["path"] for a in adapters}})


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = await _body(request, ctx, ("lora_name", "lora_path"))
    if body["lora_name"] in ctx.model_aliases:  # `model: "<name>"` would mean the base model
        raise bad_request(
            f"LoRA adapter name {body['lora_name'][:128]!r} is a name of the served model; choose another.",
            "lora_name",
        )
    return await _control(ctx, body["lora_name"], body["lora_path"])


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = await _body(request, ctx, ("lora_name",))
    return await _control(ctx, body["lora_name"], None)
