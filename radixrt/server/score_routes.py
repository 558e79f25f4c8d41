"""SGLang's decoder-only scoring route: ``POST /v1/score``.

Body: ``query``, ``items``, ``label_token_ids``, ``apply_softmax``, ``item_first``
and ``model`` (SGLang's ``ScoringRequest``; an adapter's name or ``"<model>:<adapter>"`` scores with a
LoRA adapter). Answer: ``{"scores": [[p, ...], ...], "model", "usage", "object":
"scoring"}``, one list per item in ``label_token_ids`` order (see
`radixrt.requests.scoring`). Any other field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.requests.intake import RequestSpec, build_specs
from radixrt.requests.scoring import SCORE_SAMPLING, ScoreAsk, score_ask, score_prompts, scores_of
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import as_bad_request, bad_request
from radixrt.server.http_utils import JSON, raise_refused, raise_state_errors, read_json, wait_group
from radixrt.server.tokenizer_manager import TokenizerManager

router = APIRouter()

_SCORE_KEYS = {"query", "items", "label_token_ids", "apply_softmax", "item_first", "model"}


def _score_plan(body: dict, tm: TokenizerManager, lora: Any) -> tuple[ScoreAsk, list[RequestSpec]]:
    """The call's prompts and validated specs (blocking: tokenizes; run off the event loop)."""
    with as_bad_request():
        ask = score_ask(
            body.get("query"),
            body.get("items"),
            body.get("label_token_ids"),
            body.get("apply_softmax", False),
            body.get("item_first", False),
        )
        prompts = score_prompts(ask, lambda text: tm.encode(text, field="items"), tm.limits)
        specs = build_specs(
            prompts,
            sampling_params=dict(SCORE_SAMPLING),
            token_ids_logprob=ask.label_token_ids,
            lora_path=lora,
        )
    tm.validate_specs(specs)
    return ask, specs


@router.post("/v1/score")
async def score(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """Score each item; 499 (empty) if the client leaves first."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    unknown = sorted(set(body) - _SCORE_KEYS)
    if unknown:
        raise bad_request(f"Unknown field '{unknown[0]}' in the /v1/score request.", unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    lora = ctx.lora_of(model)
    tm = ctx.tm
    tm.check_alive()
    ask, specs = await tm.run_tokenize(_score_plan, body, tm, lora)
    group = tm.submit(specs, validated=True)
    if not await wait_group(request, tm, group):
        return Response(status_code=499)
    raise_state_errors(group)
    raise_refused(group)
    results = [st.acc.to_dict() for st in group.states]
    prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return JSON(
        {
            "scores": scores_of(results, ask.apply_softmax),
            "model": model or ctx.served_model_name,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens},
            "object": "scoring",
        }
    )
