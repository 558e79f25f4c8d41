"""The Engine's control methods (SGLang's names): the cache, counters, LoRA adapters,
pausing generation, weight updates, sessions and what the engine serves. `EngineControl` is a
base of `radixrt.Engine`; a method that asks the scheduler sends it one control message
(radixrt/scheduler/control_requests.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from radixrt.requests.messages import (
    ContinueGenerationReq,
    ControlReply,
    FlushCacheReq,
    GetWeightsReq,
    LoRAControlReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    ProfileReq,
    StatsReq,
    UpdateDistributedReq,
    UpdateTensorsReq,
    UpdateWeightsReq,
    WeightsGroupReq,
    WeightVersionReq,
)
from radixrt.requests.profile_fields import profile_request
from radixrt.requests.runtime_info import internal_state
from radixrt.requests.sessions import SessionStore
from radixrt.version import __version__

_NOT_GENERATIVE = "radixrt serves generative models, without an embedding or classification head"
# SGLang's Engine methods radixrt does not have, and why: an AttributeError that says so
SGLANG_ONLY_METHODS = {
    "encode": _NOT_GENERATIVE,
    "async_encode": _NOT_GENERATIVE,
    "rerank": _NOT_GENERATIVE,
    "async_score": "call score() (from a thread, in async code)",
    "update_weights_from_ipc": "its tensors are CUDA IPC handles; use update_weights_from_tensor",
    "load_lora_adapter_from_tensors": "load the adapter's PEFT folder with load_lora_adapter",
    "begin_weight_update": "use update_weights_from_tensor or update_weights_from_distributed",
    "end_weight_update": "use update_weights_from_tensor or update_weights_from_distributed",
    "collective_rpc": "the runtime runs no user code on its workers",
    "freeze_gc": "the scheduler's garbage collector is left as Python sets it",
    "start_expert_distribution_record": "radixrt serves dense (Llama-family) models",
    "stop_expert_distribution_record": "radixrt serves dense (Llama-family) models",
    "dump_expert_distribution_record": "radixrt serves dense (Llama-family) models",
}


class EngineControl:
    lora_adapters: set[str]
    model_path: Any
    config: Any  # EngineConfig
    info: Any  # the scheduler's RuntimeInfo
    context_length: int
    tokenizer: Any
    sessions: SessionStore

    def _control_call(self, msg: Any) -> ControlReply:
        raise NotImplementedError

    if not TYPE_CHECKING:  # (type checkers keep seeing an unknown attribute as an error)

        def __getattr__(self, name: str) -> Any:
            why = SGLANG_ONLY_METHODS.get(name)
            if why is None:
                raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
            raise AttributeError(f"Engine.{name} (SGLang's) is not supported by radixrt: {why}")

    def flush_cache(self) -> bool:
        """Drop every cached prefix (False while requests run). The counters of
        `get_stats` are not reset: they count from the engine's start."""
        return self._control_call(FlushCacheReq()).ok

    def get_stats(self) -> dict:
        """The scheduler's counters (cumulative since the start) and its state now."""
        return self._control_call(StatsReq()).payload

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: Optional[str] = None,
        abort_all_requests: bool = False,
        weight_version: Optional[str] = None,
    ) -> tuple[bool, str, int]:
        """Serve the weights of the checkpoint at ``model_path`` (same architecture) from now
        on, without a restart (SGLang's method; its contract: radixrt/scheduler/generation_control.py).
        Returns when they serve: (success, message, requests that waited for them). Running
        requests finish first with the old weights (``abort_all_requests``: every request is
        ended instead); the prefix cache is dropped. ``load_format``: only None or "auto"
        (safetensors, as at start)."""
        if load_format not in (None, "auto"):
            return False, f"load_format {load_format!r} is not supported (None or 'auto': safetensors)", 0
        reply = self._control_call(UpdateWeightsReq(str(model_path), abort_all_requests, weight_version))
        p = reply.payload
        if reply.ok:
            self.model_path = model_path
        return bool(p["success"]), str(p["message"]), int(p["num_paused_requests"])

    def update_weights_from_tensor(
        self,
        named_tensors: list,
        load_format: Optional[str] = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: Optional[str] = None,
    ) -> tuple[bool, str]:
        """Serve the weights being served with ``named_tensors`` ((checkpoint name, tensor) pairs:
        some or all of the model's, e.g. one bucket of a trainer's state dict) in their place, as
        `update_weights_from_disk` does (SGLang's method): running requests finish first, the
        prefix cache is dropped, calls add up in order. ``flush_cache`` False is taken but the
        cache is dropped anyway (no KV of other weights is served). ``load_format``: None or
        "direct". Returns (success, message); refused under ``--tp`` and for quantized weights."""
        import torch

        if load_format not in (None, "direct"):
            return False, f"load_format {load_format!r} is not supported (None or 'direct': (name, tensor) pairs)"
        pairs = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
                raise TypeError(f"named_tensors must be (name, tensor) pairs, got {type(pair).__name__}")
            if not isinstance(pair[1], torch.Tensor):
                raise TypeError(f"{pair[0]!r}: expected a torch.Tensor, got {type(pair[1]).__name__}")
        reply = self._control_call(UpdateTensorsReq([tuple(p) for p in pairs], abort_all_requests, weight_version))
        return bool(reply.payload["success"]), str(reply.payload["message"])

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> tuple[bool, str]:
        """Join a trainer's weight-update group as rank ``rank_offset`` of ``world_size`` (SGLang's
        method; radixrt/executor/weight_groups.py): returns once every rank joined, (success,
        message). ``backend``: "gloo" on a CPU, "nccl" on CUDA."""
        msg = WeightsGroupReq(
            group_name, True, master_address, int(master_port), int(rank_offset), int(world_size), backend
        )
        p = self._control_call(msg).payload
        return bool(p["success"]), str(p["message"])

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: Optional[str] = None,
        weight_version: Optional[str] = None,
    ) -> tuple[bool, str]:
        """Serve the tensors rank 0 of ``group_name`` broadcasts now (one per name, in order, of
        those dtypes and shapes) in place of those weights, as `update_weights_from_tensor` does
        (SGLang's method); (success, message). ``flush_cache`` is taken: the cache is dropped anyway."""
        if load_format not in (None, "direct"):
            return False, f"load_format {load_format!r} is not supported (None or 'direct')"
        if not len(names) == len(dtypes) == len(shapes):
            return False, "names, dtypes and shapes must have one entry per tensor"
        msg = UpdateDistributedReq(
            list(names), list(dtypes), [list(s) for s in shapes], group_name, False, weight_version
        )
        p = self._control_call(msg).payload
        return bool(p["success"]), str(p["message"])

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        p = self._control_call(WeightsGroupReq(group_name, False)).payload
        return bool(p["success"]), str(p["message"])

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows of the served weight ``name`` (Hugging Face's name,
        e.g. ``model.layers.0.self_attn.q_proj.weight``) as float32 lists, to check an update
        (SGLang's method). ValueError for an unknown name, a quantized layer, ``--tp`` above 1,
        or more than a million values."""
        if isinstance(truncate_size, bool) or not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        reply = self._control_call(GetWeightsReq(str(name), truncate_size))
        if not reply.ok:
            raise ValueError(reply.payload["message"])
        return reply.payload["values"].tolist()  # here, not on the scheduler's thread

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating until `continue_generation`: "abort" ends every request first,
        "retract" sends running ones back to the queue without their KV, "in_place" keeps
        them as they are. ValueError for another mode."""
        reply = self._control_call(PauseGenerationReq(mode))
        if not reply.ok:
            raise ValueError(reply.payload["message"])

    def continue_generation(self) -> None:
        self._control_call(ContinueGenerationReq())

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        """Label the weights being served ``new_version`` (outputs' ``meta_info.weight_version``
        from the next step on) without changing them; ``abort_all_requests`` (SGLang's default)
        ends every request first."""
        if not isinstance(new_version, str):
            raise TypeError(f"new_version must be a string, got {type(new_version).__name__}")
        self._control_call(WeightVersionReq(new_version, bool(abort_all_requests)))

    def get_weight_version(self) -> str:
        """The label of the weights being served: "default" at start, then the
        ``weight_version`` (or the path) of the last update."""
        return str(self.get_stats()["weight_version"])

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> list[dict]:
        """Load (or reload) a LoRA adapter (SGLang's method); the adapters now known (ValueError: refused)."""
        return self._lora_control(LoRAControlReq(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> list[dict]:
        """Forget a LoRA adapter (running requests finish with it)."""
        return self._lora_control(LoRAControlReq(lora_name))

    def _lora_control(self, msg: LoRAControlReq) -> list[dict]:
        reply = self._control_call(msg)
        if not reply.ok:
            raise ValueError(reply.payload.get("error", "LoRA control failed"))
        adapters = list(reply.payload.get("adapters", []))
        self.lora_adapters = {a["name"] for a in adapters}
        return adapters

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        """Give the memory of ``tags`` ("kv_cache", "weights", "cuda_graph"; None: all) back while
        idle, SGLang's method for RL loops (contract: radixrt/scheduler/memory_occupation.py);
        generation waits until `resume_memory_occupation`. ``{"released", "freed_bytes"}``;
        ValueError while requests run, on CUDA, under ``tp_size`` above 1, or for a bad tag."""
        return self._memory(MemoryOccupationReq(True, tags))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        """Take ``tags``' memory back (the weights are read again from the checkpoint served)."""
        return self._memory(MemoryOccupationReq(False, tags))

    def _memory(self, msg: MemoryOccupationReq) -> dict:
        reply = self._control_call(msg)
        if not reply.ok:
            raise ValueError(reply.payload["message"])
        return dict(reply.payload)

    def start_profile(self, **fields: Any) -> str:
        """Profile the scheduler's steps with the torch profiler until `stop_profile` or
        ``num_steps`` (SGLang's method and fields: radixrt/requests/profile_fields.py); the path
        the trace will be written to. ValueError for a bad field or a profile already running."""
        return self._profile(profile_request(fields))

    def stop_profile(self) -> str:
        """End the profile; the path of the trace it wrote (ValueError: none runs)."""
        return self._profile(ProfileReq("stop"))

    def _profile(self, msg: ProfileReq) -> str:
        reply = self._control_call(msg)
        if not reply.ok:
            raise ValueError(reply.payload["message"])
        return str(reply.payload["path"])

    def open_session(
        self,
        capacity_of_str_len: Optional[int] = None,
        session_id: Optional[str] = None,
        streaming: bool = False,
        timeout: Optional[float] = None,
    ) -> str:
        """Open a session (SGLang's method; ``capacity_of_str_len`` is taken and not needed): its
        id, for ``session_params={"id": ...}`` on `generate`, whose turns then send only their new
        tokens (`radixrt.requests.sessions`: streaming and tree sessions, bounds). ValueError on a
        bad argument or an id already open."""
        return self.sessions.open(session_id, streaming, timeout)

    def close_session(self, session_id: str) -> None:
        """Forget a session's turns (ValueError: no such session open)."""
        self.sessions.close(session_id)

    def get_server_info(self) -> dict:
        stats = self.get_stats()
        return {
            **self.config.to_flat(),
            **self.info.settings,  # what the model requires in place of the configured (model_fit.py)
            "model_path": self.model_path,
            "context_length": self.context_length,
            "max_total_num_tokens": self.info.kv_total_slots,
            "kv_cache": self.info.kv_cache,  # as /get_server_info: bytes per token, capacity (kv_format.py)
            "host_kv_cache": stats.get("host_kv"),  # the host tier (--enable-hierarchical-cache), or None
            "weight_version": stats["weight_version"],
            "version": __version__,
            "stats": stats,
            "internal_states": [
                internal_state(stats, self.info.kv_total_slots, self.config.scheduling.max_running_requests)
            ],
        }

    def get_model_info(self) -> dict:
        """SGLang's Engine.get_model_info (the server's ``/get_model_info``)."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": getattr(self.tokenizer, "name_or_path", None) or self.model_path,
            "weight_version": self.get_weight_version(),
            "is_generation": True,
            "context_length": self.context_length,
            "vocab_size": self.info.vocab_size,
            "chat_role_markers": {k: list(v) for k, v in self.chat_role_markers.items()},
            "preferred_sampling_params": self.limits.preferred_sampling,
        }

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    @property
    def chat_role_markers(self) -> dict[str, tuple[str, str]]:
        from radixrt.requests.chat_roles import derive_role_markers

        return derive_role_markers(self.tokenizer)
