"""Loads the model, owns the KV pool and the attention backend, runs forwards.

The runner sees batches as slot lists and token ids; it knows nothing of the
radix tree or of scheduling.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Sequence

import torch

from radixrt.config import EngineConfig
from radixrt.executor.batch_invariant import enable_batch_invariant
from radixrt.executor.lora.batch import LoRABatch
from radixrt.executor.lora.pool import LoRARuntime, install_lora
from radixrt.executor.model_store import resolve_model_path
from radixrt.executor.models import load_model
from radixrt.executor.models.config import ModelConfig, architecture_differences
from radixrt.executor.models.decode_stack import use_decode_stack
from radixrt.executor.models.loader import checkpoint_tensor, empty_model, with_tensors
from radixrt.executor.models.native_linear import use_native_linears, use_native_row_ops
from radixrt.executor.models.quantized_linear import integer_products_only, quantize_model
from radixrt.executor.models.rope import LENGTH_DEPENDENT
from radixrt.executor.parallel import TPGroup, shard_model
from radixrt.executor.parallel.ranks import Followers
from radixrt.executor.pool_size import kv_pool_tokens
from radixrt.executor.runner_settings import RunnerSettings
from radixrt.executor.runtime_choice import check_device, fit_to_model, quantization_spec, resolve_runtime
from radixrt.kernels import AttentionBackend, AttentionMetadata, create_backend
from radixrt.kernels.kv_scores import ScoreJob, ScoringPass
from radixrt.memory.kv_format import kv_footprint
from radixrt.memory.kv_pool import KVPool
from radixrt.memory.req_to_token import ReqToTokenPool
from radixrt.requests.tokenizer_utils import load_tokenizer
from radixrt.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

# the most values `ModelRunner.weights_by_name` returns (about 20 MB of JSON)
MAX_WEIGHT_VALUES = 1 << 20


def _weights_in_order(model: Any) -> list[torch.Tensor]:
    """A model's tensors in an order every rank derives from the config alone (a tied head once)."""
    return [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]


@dataclass
class LoadedWeights:
    """A checkpoint read by `ModelRunner.load_weights`, for `ModelRunner.install_weights`."""

    path: str
    model: Any  # a LlamaForCausalLM
    config: ModelConfig


class ModelRunner:
    @classmethod
    def from_config(cls, config: EngineConfig) -> "ModelRunner":
        """The runner of ``config``'s model, execution and cache sections."""
        return cls(RunnerSettings.of(config))

    def __init__(self, settings: RunnerSettings, tp: Optional[TPGroup] = None) -> None:
        """With ``tp_size > 1`` and no ``tp``, this runner is rank 0 (the
        leader): it starts the other ranks and forwards each model call to them
        (see ``radixrt.executor.parallel``); a follower passes its ``tp``."""
        self.settings = settings
        self.lora: Optional[LoRARuntime] = None  # set by the scheduler under --enable-lora (lora/pool.py)
        model, ex, cache = settings.model, settings.execution, settings.cache
        self.followers: Optional[Followers] = None
        if ex.tp_size > 1 and tp is None:
            self.followers = Followers(settings)
            tp = self.followers.group
        self.tp = tp
        if tp is not None and not ex.device.startswith("cuda"):
            # the ranks share the machine's cores: oversubscribed intra-op threads spin against each other
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp.size))
        self.device = tp.device if tp is not None else ex.device
        check_device(self.device)
        self.choice = resolve_runtime(settings)
        self.dtype = self.choice.dtype
        if self.device.startswith("cuda") and self.choice.kv_dtype == torch.int8:
            logger.warning(
                "kv_cache_dtype int8: FlashInfer cannot read it, attention runs on the torch backend "
                "without CUDA graphs (fp8_e4m3 keeps FlashInfer)"
            )
        clock = time.perf_counter()
        loaded = self.load_weights(model.model_path, dummy=model.load_format == "dummy")
        self.model_path, self.model, self.model_config = loaded.path, loaded.model, loaded.config
        self.shard_config = self._shard(self.model)  # this rank's heads: what its KV pool and attention see
        # seconds of each start-up phase, for the start-up breakdown (`radixrt generate --log-level info`)
        self.startup_s = {"weights": time.perf_counter() - clock}
        clock = time.perf_counter()
        self.tokenizer: Any = load_tokenizer(model.tokenizer_source(self.model_path), model.chat_template)
        self.startup_s["tokenizer"] = time.perf_counter() - clock
        mc = self.model_config
        self.choice = fit_to_model(self.choice, mc.head_dim)
        if tp is not None:  # the graphs would capture collectives; not supported yet
            self.choice = replace(self.choice, cuda_graph=False, cuda_graph_max_bs=0)
        self.context_length = mc.check_context_length(model.context_length)
        self.page_size = cache.page_size
        self.num_pages = self._num_pages()  # what the allocator hands out: pages 0 .. num_pages-1
        if tp is not None:  # every rank's pool has the leader's slot numbering
            self.num_pages = tp.command(self.num_pages)
        use_graphs = self.choice.cuda_graph and self.model.rope.rope_type not in LENGTH_DEPENDENT
        # CUDA graphs pad decode batches with rows that write their K/V into one
        # scratch page past the allocator's range
        clock = time.perf_counter()
        self.kv_pool = KVPool(
            mc.num_layers,
            self.num_pages + (1 if use_graphs else 0),
            self.page_size,
            self.shard_config.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
            kv_cache_dtype=cache.kv_cache_dtype,
        )
        # one row per running request, one column per token it may hold
        self.req_to_token = ReqToTokenPool(
            settings.max_running_requests,
            self.context_length + 1,
            self.device,
            scratch_slot=self.num_pages * self.page_size if use_graphs else 0,
        )
        self.startup_s["KV pool"] = time.perf_counter() - clock
        self._choose_linear_products(deterministic=ex.enable_deterministic_inference)
        self.backend: AttentionBackend = self._attention_backend()
        self.cuda_graph: Optional[Any] = self._capture_decode_graphs() if use_graphs else None
        self._compile()
        self._log_loaded()

    def load_weights(self, model_path: str, dummy: bool = False) -> LoadedWeights:
        """Read the checkpoint at ``model_path`` into a new model as this runner's settings say
        (dtype, quantization; on the host under tensor parallel; ``dummy``: random weights of its
        config, `loader.dummy_weights`, as ``load_format="dummy"`` starts). Touches nothing the runner
        uses, so it may run on another thread while the runner serves. ValueError when the
        checkpoint's architecture is not the one being served."""
        model = self.settings.model
        path = resolve_model_path(model_path)
        quantization = quantization_spec(model.weight_quantization, model.dtype)
        # tensor parallel: on the host, whole and float (`_shard` keeps this rank's part and quantizes
        # it); at start every rank reads it, an update only the leader (the others receive its tensors)
        device = "cpu" if self.tp else self.device
        overrides = model.config_overrides()
        new, config = load_model(path, self.dtype, device, None if self.tp else quantization, dummy, overrides)
        served = getattr(self, "model_config", None)  # None while __init__ loads the first checkpoint
        if served is not None and (differs := architecture_differences(served, config)):
            raise ValueError(f"{model_path!r} is not the architecture being served: {differs}")
        return LoadedWeights(str(path), new, config)

    def install_weights(self, loaded: LoadedWeights) -> None:
        """Serve ``loaded``'s weights from now on (`load_weights` checked their architecture). The
        caller has no step in flight and drops every KV computed with the old weights; the other
        tensor-parallel ranks receive these tensors (`receive_weights`). The KV pool, backend and
        tokenizer stay."""
        if self.followers is not None:  # the ranks get these very weights, not a second read of the path
            self.followers.send("reload", loaded.path)
            for t in _weights_in_order(loaded.model):
                self.tp.broadcast_(t)  # type: ignore[union-attr]  # a leader has its group
        self._shard(loaded.model)
        self.model_path, self.model = loaded.path, loaded.model
        self._choose_linear_products(self.deterministic)
        self._tell_backend_the_stack(self.backend)
        if self.cuda_graph is not None:
            self.cuda_graph = self._capture_decode_graphs()
        self._compile()
        if self.lora is not None:
            install_lora(self, self.lora.context)
        logger.info("now serving the weights of %s", self.model_path)

    def weights_with(self, named_tensors: list, base: Optional[LoadedWeights] = None) -> LoadedWeights:
        """A copy of the served weights (or of ``base``, an update not installed yet) with
        ``named_tensors`` in their place (`loader.with_tensors`), for `install_weights`; only reads
        the model, so it may run beside the step loop. ValueError under tensor parallelism, for
        quantized weights, and for a name or shape the model does not have."""
        if self.tp is not None:
            raise ValueError("weights are not updated from tensors under tensor parallelism (each rank holds a shard)")
        src = base or LoadedWeights(self.model_path, self.model, self.model_config)
        return LoadedWeights(src.path, with_tensors(src.model, named_tensors), src.config)

    def receive_weights(self, path: str) -> LoadedWeights:
        """A follower rank's copy of the weights its leader installs (`install_weights`)."""
        assert self.tp is not None, "only a tensor-parallel rank receives weights"
        model = empty_model(self.model_config, self.dtype, "cpu")
        for t in _weights_in_order(model):
            self.tp.broadcast_(t)
        return LoadedWeights(path, model, self.model_config)

    def _shard(self, model: Any) -> Any:
        """This rank's share of ``model`` (tensor parallel), moved to the device; its config."""
        if self.tp is None:
            return self.model_config
        config = shard_model(model, self.model_config, self.tp)
        quantization = quantization_spec(self.settings.model.weight_quantization, self.settings.model.dtype)
        if quantization is not None:  # each rank quantizes its own shards
            quantize_model(model, quantization)
        model.to(self.device)
        return config

    def _compile(self) -> None:
        if self.settings.execution.enable_torch_compile:
            from radixrt.executor.models.compiled import enable_compile

            enable_compile(self.model)

    def _choose_linear_products(self, deterministic: bool) -> None:
        """Sets ``self.deterministic``. Deterministic mode: batch-invariant linear layers; else on
        the CPU, few-row float32 products on the native kernels (`native_linear`: linear layers, RMSNorm, rope)
        and decode steps' layer stacks in one native call where every layer runs on them (`decode_stack`)."""
        self.deterministic = deterministic
        if self.tp is not None:
            self.tp.ordered_sum = deterministic
        if deterministic:
            enable_batch_invariant(self.model)
            integer_products_only(self.model)  # quantized layers: every row count in integers
        elif self.device == "cpu":
            use_native_linears(self.model)
            use_native_row_ops(self.model)
            use_decode_stack(self.model)

    def _attention_backend(self) -> AttentionBackend:
        """The backend the model's attention runs through, configured for this
        rank's heads (deterministic mode forces the batch-invariant torch path)."""
        mc = self.model_config
        if self.deterministic:
            from radixrt.kernels.torch_ref import TorchReferenceBackend

            return TorchReferenceBackend(deterministic=True)
        backend = create_backend(self.choice.attention_backend, self.device)
        if hasattr(backend, "configure"):  # FlashInfer plans once per batch with these
            backend.configure(
                self.shard_config.num_heads,
                self.shard_config.num_kv_heads,
                mc.head_dim,
                self.dtype,
                kv_dtype=self.kv_pool.storage_dtype,
            )
        return self._tell_backend_the_stack(backend)

    def _capture_decode_graphs(self) -> Any:
        """Capture CUDA graphs of the decode step (padding rows write into the
        scratch page past the allocator's range)."""
        from radixrt.executor.cuda_graph import DecodeCudaGraphRunner

        # a replay reads rope's position table as captured: it must already cover the context
        self.model.rope.reserve(self.context_length, next(self.model.parameters()).device, self.dtype)
        runner = DecodeCudaGraphRunner(
            self.model,
            self.kv_pool,
            self.backend,
            self.choice.cuda_graph_max_bs,
            scratch_slot=self.num_pages * self.page_size,
            page_size=self.page_size,
            device=self.device,
            max_context_len=self.context_length,
            sizes=self.choice.cuda_graph_sizes,
            pad=self.choice.cuda_graph_padding,
        )
        runner.capture()
        return runner

    def _log_loaded(self) -> None:
        mc, fp = self.model_config, self.kv_pool.footprint
        logger.info(
            "loaded %s (%s, %s): KV pool %d slots (page_size %d, %s, %d B/token, %d tokens/GiB), context %d",
            self.model_path,
            mc.architecture,
            self.dtype,
            self.num_pages * self.page_size,
            self.page_size,
            fp.format.name,
            fp.bytes_per_token,
            fp.tokens_per_gib,
            self.context_length,
        )

    def _num_pages(self) -> int:
        mc = self.model_config
        cache = self.settings.cache
        fp = kv_footprint(
            mc.num_layers, self.shard_config.num_kv_heads, mc.head_dim, cache.kv_cache_dtype, str(self.dtype)
        )
        tokens = kv_pool_tokens(cache, fp, self.device)
        pages = tokens // self.page_size
        if pages < 1:
            raise ValueError(f"KV pool of {tokens} tokens holds no page of {self.page_size}")
        return pages

    @torch.inference_mode()
    def forward_batch(
        self,
        input_ids: list[int] | torch.Tensor,
        rows: list[int],
        q_lens: list[int],
        kv_lens: list[int],
        table_writes: Optional[torch.Tensor] = None,
        tree: Optional[list[Optional[list[int]]]] = None,
        position_offsets: Optional[list[int]] = None,
        score_jobs: Optional[list[ScoreJob]] = None,
        lora_rows: Optional[list[Any]] = None,
    ) -> torch.Tensor:
        """The scheduler's step: request ``i`` computes its last ``q_lens[i]`` of
        ``kv_lens[i]`` tokens, whose slots are row ``rows[i]`` of the
        request-to-slot table, after ``table_writes`` (from
        `ReqToTokenPool.take_writes`) are applied. ``input_ids`` [sum(q_lens)]
        may already be on the device. ``tree``: per request, the draft tree its
        new tokens form (``AttentionMetadata.tree``) or None. Requests under a KV
        budget: ``position_offsets`` (``AttentionMetadata.position_offsets``) and
        ``score_jobs``, whose accumulators gain each layer's attention mass
        (kernels/kv_scores.py). ``lora_rows``: each token row's LoRA adapter (None:
        the base model). Returns hidden states [sum(q_lens), hidden]."""
        budgeted = position_offsets is not None or bool(score_jobs)
        if budgeted and self.followers is not None:
            raise RuntimeError("KV budgets do not run tensor parallel")
        if self.followers is not None:
            ids_list = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
            writes = None if table_writes is None else table_writes.cpu()
            self.followers.send("forward", ids_list, rows, q_lens, kv_lens, writes, tree)
        self.req_to_token.apply(table_writes)
        table = self.req_to_token.table
        ids = torch.as_tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if not budgeted and self.cuda_graph is not None and self.cuda_graph.can_run(q_lens, kv_lens):
            return self.cuda_graph.forward_rows(ids, table, rows, kv_lens, self.req_to_token.padding_row)
        meta = AttentionMetadata.from_table(table, rows, q_lens, kv_lens, self.page_size, tree, position_offsets)
        if score_jobs:
            assert meta.slot_table is not None, "metadata from a table has a slot table"
            kept = [meta.slot_table[j.batch_index, : kv_lens[j.batch_index]] for j in score_jobs]
            meta.scoring = ScoringPass(score_jobs, q_lens, kept)
        self.backend.plan(meta)
        if lora_rows is None:
            return self.model(ids, meta.positions, meta, self.kv_pool, self.backend)
        assert self.lora is not None, "LoRA rows on a runner without --enable-lora"
        self.lora.context.batch = LoRABatch.build(lora_rows, self.device)
        try:
            return self.model(ids, meta.positions, meta, self.kv_pool, self.backend)
        finally:
            self.lora.context.batch = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: list[int],
        seq_slots: list[list[int]],
        q_lens: list[int],
        tree: Optional[list[Optional[list[int]]]] = None,
        allow_graph: bool = True,
    ) -> torch.Tensor:
        """Compute ``q_lens[i]`` new tokens of each sequence (whose whole slot list
        is ``seq_slots[i]``; ``tree`` as in `forward_batch`); writes their K/V into
        the pool; returns hidden states [sum(q_lens), hidden]. A decode batch
        replays a CUDA graph where one was captured, or runs the CPU's native decode stack, unless
        ``allow_graph`` is False (then the model's Python layer stack runs it)."""
        if not allow_graph and self.model.decode_stack is not None:
            stack, self.model.decode_stack = self.model.decode_stack, None
            try:
                return self.forward(input_ids, seq_slots, q_lens, tree)
            finally:
                self.model.decode_stack = stack
        graphs = self.cuda_graph if allow_graph else None
        if graphs is not None and graphs.can_run(q_lens, [len(s) for s in seq_slots]):
            return graphs.forward(input_ids, seq_slots)
        if self.tp is not None:
            raise RuntimeError("ModelRunner.forward does not run tensor parallel; use forward_batch")
        meta = AttentionMetadata.build(seq_slots, q_lens, self.page_size, self.device, tree)
        self.backend.plan(meta)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        return self.model(ids, meta.positions, meta, self.kv_pool, self.backend)

    def disable_decode_stack(self) -> None:
        """Run every step on the model's Python layers (LoRA's layers wrap what the stack would call)."""
        self.model.decode_stack = None
        self._tell_backend_the_stack(self.backend)

    def _tell_backend_the_stack(self, backend: AttentionBackend) -> AttentionBackend:
        """``backend``, told below how many rows the native decode stack runs a decode batch."""
        from radixrt.kernels.torch_ref import TorchReferenceBackend

        if isinstance(backend, TorchReferenceBackend):
            backend.native_stack_rows = self.fast_path_tokens
        return backend

    @property
    def fast_path_tokens(self) -> int:
        """Token rows below which a step of one-token decodes and draft chains runs the CPU's
        native decode stack (0: no stack, or a KV pool it cannot drive), a cheaper step than the
        Python layers' (`forward`)."""
        stack = self.model.decode_stack
        if stack is None or not stack.drives(self.kv_pool):
            return 0
        from radixrt.executor.models.decode_stack import MAX_ROWS

        return MAX_ROWS

    def create_sampler(self, vocab_size: int, eos_token_ids: Iterable[int]) -> Sampler:
        """The sampler ``sampling_backend`` asks for (FlashInfer's kernels only on CUDA)."""
        from radixrt.sampling.flashinfer_sampler import create_sampler

        return create_sampler(self.settings.execution.sampling_backend, vocab_size, eos_token_ids, self.device)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given hidden rows."""
        if self.followers is not None:
            self.followers.send("logits", hidden.cpu())
        return self.model.compute_logits(hidden.to(self.device))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies the stored K/V of slots ``src`` to ``dst`` (`KVPool.copy_slots`) in every rank's pool.
        Called between steps only (no forward in flight), so the ranks see it in step order."""
        if self.followers is not None:
            self.followers.send("copy_slots", list(src), list(dst))
        self.kv_pool.copy_slots(src, dst)

    def weights_by_name(self, name: str, truncate_size: int) -> torch.Tensor:
        """A float32 CPU copy of the first ``truncate_size`` rows of the checkpoint tensor ``name``
        (Hugging Face's name) as served (SGLang's ``get_weights_by_name``; the caller makes the
        lists, off the step loop). ValueError for a name the model lacks, a quantized layer, a
        tensor-parallel runner (its ranks hold shards), or more than `MAX_WEIGHT_VALUES` values."""
        if self.tp is not None:
            raise ValueError("weights are not read back under tensor parallelism (each rank holds a shard)")
        try:
            rows = checkpoint_tensor(self.model, name)[:truncate_size]
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        if rows.numel() > MAX_WEIGHT_VALUES:
            raise ValueError(
                f"the first {truncate_size} rows of {name!r} hold {rows.numel()} values (at most {MAX_WEIGHT_VALUES})"
            )
        return rows.to("cpu", torch.float32, copy=True)

    def check_ranks(self) -> None:
        """Raise if a tensor-parallel follower has exited (its next collective would hang or fail)."""
        if self.followers is not None and not self.followers.alive():
            codes = [p.returncode for p in self.followers.procs]
            raise RuntimeError(f"a tensor-parallel rank exited (exit codes of ranks 1..: {codes})")

    def close(self) -> None:
        """Stop the follower ranks (tensor parallel; idempotent)."""
        if self.followers is not None:
            self.followers.stop()
        if self.tp is not None:
            self.tp.close()
            self.tp = None
