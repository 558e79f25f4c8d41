"""Weights updated in place and generation paused: SGLang's routes for RL rollouts.

* ``POST /update_weights_from_disk`` ``{"model_path", "abort_all_requests"?,
  "weight_version"?, "load_format"?, "flush_cache"?}``: serve the weights of
  the checkpoint at ``model_path`` (a folder on the server's disk, the
  architecture being served) from now on. Answers once they serve:
  ``{"success", "message", "num_paused_requests"}``, 200, or 400 when the
  checkpoint cannot be read or differs (the old weights keep serving).
  Running requests finish with the old weights first (``abort_all_requests``:
  ended instead); the prefix cache is always dropped, so ``flush_cache:
  false`` is refused. The tokenizer stays the one loaded at start. SGLang's
  ``rid`` (a label) is accepted and ignored; its ``manifest`` (tensor metadata
  for its own loaders) must be unset or null: a set one is a 400.
* ``POST /pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}``
  and ``POST /continue_generation``.
* ``POST /release_memory_occupation`` and ``/resume_memory_occupation`` ``{"tags"?}``: give the
  KV cache's and the weights' memory back while idle, and take it back (radixrt/scheduler/
  memory_occupation.py); ``{"success", "message", "released", "freed_bytes"}``, 400 when refused.
* ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size", "group_name"?, "backend"?}``, ``/update_weights_from_distributed`` ``{"names",
  "dtypes", "shapes", "group_name"?, "weight_version"?}`` and ``/destroy_weights_update_group``
  ``{"group_name"?}``: a trainer's broadcast of new weights (radixrt/executor/weight_groups.py);
  ``{"success", "message"}``, 400 when refused.
* ``POST /update_weight_version`` ``{"new_version", "abort_all_requests"?}``: label the
  weights ``new_version`` without changing them (every request ended first unless
  ``abort_all_requests`` is false); ``{"success", "message", "new_version"}``. Each result's
  ``meta_info.weight_version`` is the label of the weights that computed it.
* ``GET /get_weight_version``: ``{"weight_version"}`` ("default" until an update);
  ``/get_model_info`` also gives it, and the last update's path as ``model_path``.
* ``GET`` or ``POST /get_weights_by_name`` ``{"name", "truncate_size"?}``: the first
  ``truncate_size`` (100) rows of a served weight, by its Hugging Face name, as a JSON
  list of float32 values (to check an update); 400 for an unknown name, a quantized
  layer, ``--tp`` above 1, or more than a million values.

With an admin key set (``--admin-api-key``) the POST routes that change state
and the weights' read-back need it (an update reads the server's disk); without
one, what every route needs. Under ``--dp`` the front sends the POST routes to every
replica, and one replica answers the read-back (all serve the same weights). Contracts:
radixrt/scheduler/generation_control.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from radixrt.requests.messages import (
    ContinueGenerationReq,
    GetWeightsReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    UpdateDistributedReq,
    UpdateWeightsReq,
    WeightsGroupReq,
    WeightVersionReq,
)
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import ServerError, bad_request
from radixrt.server.http_utils import JSON, read_json

router = APIRouter()

# An update waits for the running requests to finish: the answer may take this long.
UPDATE_TIMEOUT_S = 3600.0
MAX_VERSION_CHARS = 256
# SGLang's fields that change nothing here (graphs are always captured again; memory is the host's)
_IGNORED = ("is_async", "torch_empty_cache", "recapture_cuda_graph", "token_step", "keep_pause")


async def _body(request: Request, ctx: ServerContext, what: str) -> dict[str, Any]:
    if ctx.admin_api_key:
        ctx.require_admin(request, what)
    if not await request.body():  # SGLang's clients may post /continue_generation without one
        return {}
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _version(body: dict[str, Any], name: str, required: bool = False) -> Any:
    """The weights' label a body gives in ``name`` (None: unset or null, unless ``required``)."""
    version = body.get(name)
    if (version is not None or required) and (not isinstance(version, str) or len(version) > MAX_VERSION_CHARS):
        raise bad_request(f"'{name}' must be a string of at most {MAX_VERSION_CHARS} characters.", name)
    return version


def _update_request(body: dict[str, Any]) -> UpdateWeightsReq:
    """The update a body asks for; ServerError 400 for what it cannot be (a null is the default)."""
    path, version = body.get("model_path"), _version(body, "weight_version")
    abort_all = body.get("abort_all_requests")
    if not isinstance(path, str) or not path:
        raise bad_request("'model_path' must be a non-empty string.", "model_path")
    if body.get("load_format") not in (None, "auto"):
        raise bad_request("'load_format' must be null or 'auto' (safetensors, as at start).", "load_format")
    if body.get("flush_cache") not in (None, True):
        raise bad_request("'flush_cache' must be true: KV computed with other weights is never served.", "flush_cache")
    if abort_all is not None and not isinstance(abort_all, bool):
        raise bad_request("'abort_all_requests' must be a boolean.", "abort_all_requests")
    if body.get("manifest") is not None:
        raise bad_request(
            "'manifest' (tensor metadata for SGLang's own loaders) is not supported: radixrt reads the "
            "checkpoint's safetensors files at 'model_path' itself; leave it unset or null.",
            "manifest",
        )
    if body.get("rid") is not None and not isinstance(body["rid"], str):
        raise bad_request("'rid' must be a string or null.", "rid")
    known = {"model_path", "load_format", "flush_cache", "abort_all_requests", "weight_version", "manifest", "rid"}
    known.update(_IGNORED)
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"Unknown field(s): {', '.join(unknown)}.", unknown[0])
    return UpdateWeightsReq(path, bool(abort_all), version)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    msg = _update_request(await _body(request, ctx, "updating the weights"))
    reply = await ctx.tm.control(msg, "update_weights", timeout=UPDATE_TIMEOUT_S)
    if reply.ok:
        ctx.weights_path = ctx.server_args["model_path"] = msg.model_path
        ctx.weight_version = msg.model_path if msg.weight_version is None else msg.weight_version
    return JSON(reply.payload, status_code=200 if reply.ok else 400)


@router.post("/pause_generation")
async def pause_generation(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    mode = (await _body(request, ctx, "pausing generation")).get("mode") or "abort"
    if not isinstance(mode, str):
        raise bad_request("'mode' must be 'abort', 'retract' or 'in_place'.", "mode")
    reply = await ctx.tm.control(PauseGenerationReq(mode), "pause")
    if not reply.ok:
        raise ServerError(400, reply.payload["message"], "mode")
    return JSON({"message": "Generation paused successfully.", "status": "ok", "mode": mode})


@router.post("/continue_generation")
async def continue_generation(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    await _body(request, ctx, "continuing generation")
    await ctx.tm.control(ContinueGenerationReq(), "continue")
    return JSON({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    return await _memory(request, ctx, release=True)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    return await _memory(request, ctx, release=False)


async def _memory(request: Request, ctx: ServerContext, release: bool) -> Response:
    body = await _body(request, ctx, "releasing or resuming memory")
    unknown = sorted(set(body) - {"tags"})
    if unknown:
        raise bad_request(f"Unknown field(s): {', '.join(unknown)}.", unknown[0])
    # reading the weights again takes as long as an update's read
    reply = await ctx.tm.control(MemoryOccupationReq(release, body.get("tags")), "memory", timeout=UPDATE_TIMEOUT_S)
    if not reply.ok:
        raise ServerError(400, reply.payload["message"], "tags")
    what = "released" if release else "resumed"
    return JSON({"success": True, "message": f"Memory {what}.", **reply.payload})


def _field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise bad_request(f"'{name}' must be {'an integer' if kind is int else 'a ' + kind.__name__}.", name)
    return value


def _group_request(body: dict[str, Any], join: bool) -> WeightsGroupReq:
    name = _field(body, "group_name", str, "weight_update_group")
    if not join:
        return WeightsGroupReq(name, False)
    port, rank, world = (_field(body, f, int) for f in ("master_port", "rank_offset", "world_size"))
    if not 0 <= rank < world or not 0 < port < 65536:
        raise bad_request("'rank_offset' must be in [0, world_size) and 'master_port' a port.", "rank_offset")
    address, backend = _field(body, "master_address", str), _field(body, "backend", str, "gloo")
    return WeightsGroupReq(name, True, address, port, rank, world, backend)


def _distributed_request(body: dict[str, Any]) -> UpdateDistributedReq:
    names, dtypes, shapes = (_field(body, f, list) for f in ("names", "dtypes", "shapes"))
    if not len(names) == len(dtypes) == len(shapes) or not all(isinstance(n, str) for n in names + dtypes):
        raise bad_request("'names', 'dtypes' and 'shapes' must hold one entry per tensor (strings, strings, lists).")
    if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
        raise bad_request("each of 'shapes' must be a list of non-negative integers.", "shapes")
    if body.get("load_format") not in (None, "direct"):
        raise bad_request("'load_format' must be null or 'direct'.", "load_format")
    version = _version(body, "weight_version")
    group = _field(body, "group_name", str, "weight_update_group")
    return UpdateDistributedReq(names, dtypes, shapes, group, bool(body.get("abort_all_requests")), version)


def _not_under_tp(ctx: ServerContext, what: str) -> None:
    """A 400 before anything connects: the weights arrive whole, and each rank holds a shard."""
    if int(ctx.server_args.get("tp_size") or 1) > 1:
        raise bad_request(f"{what} is not served under tensor parallelism (--tp): each rank holds a shard.")


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    _not_under_tp(ctx, "a weight-update group")
    msg = _group_request(await _body(request, ctx, "joining a weight-update group"), join=True)
    return _answer(await ctx.tm.control(msg, "weights_group", timeout=UPDATE_TIMEOUT_S))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    msg = _group_request(await _body(request, ctx, "leaving a weight-update group"), join=False)
    return _answer(await ctx.tm.control(msg, "weights_group"))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    msg = _distributed_request(await _body(request, ctx, "updating the weights"))
    reply = await ctx.tm.control(msg, "update_weights", timeout=UPDATE_TIMEOUT_S)
    if reply.ok and msg.weight_version is not None:
        ctx.weight_version = msg.weight_version
    return _answer(reply)


def _answer(reply: Any) -> Response:
    return JSON(
        {"success": bool(reply.payload["success"]), "message": reply.payload["message"]},
        status_code=200 if reply.ok else 400,
    )


@router.post("/update_weight_version")
async def update_weight_version(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = await _body(request, ctx, "labelling the weights")
    version, abort_all = _version(body, "new_version", required=True), body.get("abort_all_requests")
    if abort_all is not None and not isinstance(abort_all, bool):
        raise bad_request("'abort_all_requests' must be a boolean.", "abort_all_requests")
    unknown = sorted(set(body) - {"new_version", "abort_all_requests", "rid"})
    if unknown:
        raise bad_request(f"Unknown field(s): {', '.join(unknown)}.", unknown[0])
    await ctx.tm.control(WeightVersionReq(version, abort_all is not False), "weight_version")
    ctx.weight_version = version
    return JSON({"success": True, "message": f"Weight version updated to {version}", "new_version": version})


@router.get("/get_weight_version")
async def get_weight_version(ctx: ServerContext = Depends(server_context)) -> Response:
    stats = await ctx.tm.get_stats()
    return JSON({"weight_version": stats["weight_version"]})


def _weights_request(body: dict[str, Any]) -> GetWeightsReq:
    name, size = body.get("name"), body.get("truncate_size")
    size = 100 if size is None else size  # a null is the default, as in the update's body
    if not isinstance(name, str) or not name:
        raise bad_request("'name' must be a weight's name, e.g. 'model.layers.0.self_attn.q_proj.weight'.", "name")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise bad_request("'truncate_size' must be a positive integer.", "truncate_size")
    unknown = sorted(set(body) - {"name", "truncate_size"})
    if unknown:
        raise bad_request(f"Unknown field(s): {', '.join(unknown)}.", unknown[0])
    return GetWeightsReq(name, size)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    reply = await ctx.tm.control(_weights_request(await _body(request, ctx, "reading the weights")), "weights")
    if not reply.ok:
        raise ServerError(400, reply.payload["message"], "name")
    # up to a million values: made into lists on a worker thread, not the event loop
    return JSON(await run_in_threadpool(reply.payload["values"].tolist))
