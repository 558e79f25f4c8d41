"""SGLang's request fields that radixrt does not implement (GenerateReqInput, SGLang 0.5.x), for
`/generate` and `Engine.generate`: accepted while unset, refused by name when set, so that SGLang's
clients, which send some of them empty, work unchanged."""

from __future__ import annotations

from typing import Any

from radixrt.requests.errors import RequestError

# SGLang request fields (GenerateReqInput, SGLang 0.5.x) radixrt does not implement:
# accepted while empty/unset, a 400 naming the field when set.
UNSUPPORTED_FIELDS = {
    # multimodal inputs
    "image_data",
    "audio_data",
    "video_data",
    "input_embeds",
    "modalities",
    "mm_hashes",
    "mm_content_hashes",
    "use_audio_in_video",
    "video_config",
    "images_config",
    "mm_processor_kwargs",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "image_max_dynamic_patch",
    "video_max_dynamic_patch",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "encoder_urls",
    "positional_embed_overrides",
    # adapters (by id), sessions, custom processors
    "lora_id",
    "session_id",
    "custom_logit_processor",
    # disaggregation and data parallelism
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "data_parallel_rank",  # rank 0 (a single server's) is taken; the router serves the others (router/dp_rank.py)
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "http_worker_ipc",
    "kv_hints",
    # extra outputs
    "return_routed_experts",
    "routed_experts_start_len",
    "return_indexer_topk",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
    "return_bytes",
    "return_entropy",
    "multi_item_delimiter_indices",
    "token_indices_to_pool",
    # generation options radixrt does not have
    "background",
    "require_reasoning",
    "max_thinking_tokens",
    "watermark",
    "conversation_id",
    "label",
    "custom_labels",
}
# Hints that never change an answer (logging, tracing, routing): never refused (/generate honours
# log_metrics false: the request is left out of the metrics).
# (stream_options: SGLang's /generate reads none, its cache-hit client sends include_usage)
HINT_FIELDS = {"log_metrics", "no_logs", "routing_key", "external_trace_header", "received_time", "stream_options"}


def _is_set(value: Any) -> bool:
    """Whether a field holds a value (SGLang's clients send unset ones as None, False or empty)."""
    return value not in (None, False, [], {}, "")


def check_unsupported(fields: dict[str, Any]) -> None:
    """RequestError naming the first of ``fields`` (names from the two sets above) that is set;
    a hint is ignored whatever its value."""
    for key, value in fields.items():
        if key in HINT_FIELDS or not _is_set(value):
            continue
        raise RequestError(f"'{key}' is not supported by radixrt.", key)


# SGLang's arguments that Engine.generate implements but names only through ``**sglang_fields``
# (keyword arguments of `build_specs` under the same names; ``session_params`` is the Engine's own)
ENGINE_EXTRAS = ("return_prompt_token_ids", "extra_key", "return_hidden_states")


def engine_extras(fields: dict[str, Any]) -> dict[str, Any]:
    """The `ENGINE_EXTRAS` among ``fields``, as `build_specs` keyword arguments; every other
    field checked by `check_engine_fields`."""
    rest = dict(fields)
    extras = {name: rest.pop(name) for name in ENGINE_EXTRAS if name in rest}
    check_engine_fields(rest)
    return extras


def check_engine_fields(fields: dict[str, Any]) -> None:
    """``Engine.generate``'s SGLang arguments: TypeError for a name SGLang does not take either,
    then `check_unsupported`."""
    for key in fields:
        if key not in UNSUPPORTED_FIELDS and key not in HINT_FIELDS:
            raise TypeError(f"Engine.generate() got an unexpected keyword argument {key!r}")
    check_unsupported(fields)
