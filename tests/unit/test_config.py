"""EngineConfig: its sections, the flags generated from them, switches whose
default depends on the device, flags that need another, and the RuntimeInfo a
started scheduler reports."""

import argparse
import dataclasses
import pickle
import typing

import pytest

from radixrt.cli import serve_router_defaults, serve_router_needs
from radixrt.config import SECTIONS, EngineConfig, flag_defaults, flag_sections
from radixrt.config.engine_config import keyword_only_flags
from radixrt.config.fields import flag_of
from radixrt.config_deps import ENGINE_INDEPENDENT, ENGINE_NEEDS, Need, apply_needs
from radixrt.server.args import ServerArgs, add_serve_args, server_args_from_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return parser


# ---------------------------------------------------------------- sections, help, flags
@pytest.mark.parametrize("cls", [*SECTIONS.values(), ServerArgs], ids=lambda c: c.__name__)
def test_every_setting_has_its_help_once_as_field_metadata(cls):
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help")
        assert isinstance(text, str) and len(text) >= 5, f"{cls.__name__}.{f.name} has no help"
    assert cls.__doc__, f"{cls.__name__} has no docstring (its --help group's description)"


def _example(name: str) -> object:
    """A value of flag ``name`` other than its default that the config accepts (with its needs met)."""
    row = next((n for n in ENGINE_NEEDS if n.flag == name), None)
    if row is not None:
        return row.example
    default = flag_defaults()[name]
    strings = {
        "model_path": "/models/x",
        "dtype": "bfloat16",
        "device": "cuda",
        "kv_cache_dtype": "fp8_e4m3",
        "schedule_policy": "fcfs",
        "log_level": "debug",
        "speculative_algorithm": "RADIX",
        "kv_budget_policy": "infinigen",
        "kv_events_config": '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5599"}',
        "tokenizer_path": "/",  # they must exist
        "chat_template": "/",
        "grammar_backend": "xgrammar",
        "load_format": "safetensors",
        "tokenizer_mode": "auto",
        "revision": "main",
        "download_dir": "/tmp",
        "dist_init_addr": "10.0.0.1:5000",
        "mm_attention_backend": "fa3",
        "json_model_override_args": '{"rope_theta": 500000.0}',
        "preferred_sampling_params": '{"temperature": 0.6, "top_p": 0.95}',
        "hicache_io_backend": "kernel",
        "hicache_mem_layout": "page_first",
        "hicache_storage_prefetch_policy": "wait_complete",
    }
    if name in strings:
        return strings[name]
    if name in (
        "kv_budget_recent_fraction",
        "mem_fraction_static",
        "request_waiting_timeout_s",
        "request_running_timeout_s",
        "watchdog_timeout",
        "schedule_conservativeness",
    ):
        return 0.25
    if name == "cuda_graph_bs":  # a list of batch sizes
        return [1, 2, 4]
    only = {"nnodes": 1, "node_rank": 0, "base_gpu_id": 0, "gpu_id_step": 1, "ep_size": 1, "log_requests_level": 2}
    only |= {"cpu_offload_gb": 0.0, "model_impl": "auto"}
    if name in only:  # the one value that serves here, a level
        return only[name]
    if isinstance(default, bool):
        return not default
    if default is None:
        return True if name == "disable_overlap_schedule" else 4096
    return default + 1


def _argv(name: str, value: object) -> list[str]:
    f = next(f for f in dataclasses.fields(SECTIONS[flag_sections()[name]]) if f.name == name)
    if isinstance(value, bool):
        return [flag_of(f) if value else "--no-" + flag_of(f)[2:]]
    if isinstance(value, list):  # a list flag: --flag a b
        return [flag_of(f), *map(str, value)]
    return [flag_of(f), str(value)]


@pytest.mark.parametrize("name", [n for n in flag_sections() if n not in keyword_only_flags()])
def test_every_flag_parses_into_its_section(name):
    value = _example(name)
    args = _parser().parse_args(_argv(name, value))
    assert getattr(args, name) == value and type(getattr(args, name)) is type(value)
    met = {n.needs: n.met for n in ENGINE_NEEDS if n.flag == name}
    config = EngineConfig.from_cli_args(argparse.Namespace(**{**vars(args), **met}))
    section = getattr(config, flag_sections()[name])
    assert getattr(section, name) == value
    assert EngineConfig(**{name: value, **met}) == config  # the Engine's keywords: the same flat names


def test_a_number_flag_given_something_else_names_the_flag():
    """``Engine(max_total_tokens="big")`` failed later as an arithmetic error naming no flag."""
    import numpy as np

    for name, bad in (("max_total_tokens", "big"), ("max_total_tokens", 1.5), ("mem_fraction", "0.8")):
        with pytest.raises(TypeError, match=f"{name} must be"):
            EngineConfig(**{name: bad})
    assert EngineConfig(max_total_tokens=np.int64(4096)).cache.max_total_tokens == 4096


def test_defaults_live_once():
    """The parsers' defaults are the dataclasses': no flag repeats a default of its own."""
    assert EngineConfig.from_cli_args(_parser().parse_args([])) == EngineConfig()
    assert EngineConfig().to_flat() == flag_defaults()
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    env_keys = {f.name for f in dataclasses.fields(ServerArgs) if "env" in f.metadata}
    parsed = server_args_from_cli(parser.parse_args([]))
    assert dataclasses.replace(parsed, **{k: None for k in env_keys}) == ServerArgs()


def test_sections_group_the_help_and_flat_keywords_round_trip():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    titles = [g.title for g in parser._action_groups]
    assert [*SECTIONS, "server"] == [t for t in titles if t in (*SECTIONS, "server")]
    c = EngineConfig(page_size=4, chunked_prefill_size=64, log_level="info", max_n=3)
    assert (c.cache.page_size, c.scheduling.chunked_prefill_size, c.debug.log_level, c.limits.max_n) == (
        4,
        64,
        "info",
        3,
    )
    assert EngineConfig(**c.to_flat()) == c == EngineConfig(**dataclasses.asdict(c))
    assert EngineConfig(cache=c.cache, page_size=8).cache.page_size == 8  # a flag over a whole section
    with pytest.raises(TypeError, match="'page_sise'"):
        EngineConfig(page_sise=4)
    with pytest.raises(ValueError, match="chunked_prefill_size must be at least page_size"):
        EngineConfig(page_size=16, chunked_prefill_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cache.page_size = 2  # type: ignore[misc]


def test_each_component_takes_only_its_sections():
    """The planner, the host tier, the prefix cache and the runner are typed by
    the sections they read, never the whole EngineConfig."""
    from radixrt.config import CacheSettings, ExecutionSettings, HostCacheSettings, ModelSettings, SchedulingSettings
    from radixrt.executor.model_runner import ModelRunner
    from radixrt.executor.runner_settings import RunnerSettings
    from radixrt.executor.runtime_choice import resolve_runtime
    from radixrt.scheduler.host_tier import build_host_tier, build_prefix_cache
    from radixrt.scheduler.planner import BatchPlanner

    def first_param(fn):
        hints = typing.get_type_hints(fn)
        return hints[[p for p in fn.__code__.co_varnames if p != "self"][0]]

    assert first_param(BatchPlanner.__init__) is SchedulingSettings
    assert first_param(build_host_tier) is HostCacheSettings
    assert first_param(build_prefix_cache) is CacheSettings
    assert first_param(ModelRunner.__init__) is first_param(resolve_runtime) is RunnerSettings
    assert typing.get_type_hints(RunnerSettings) == {
        "model": ModelSettings,
        "execution": ExecutionSettings,
        "cache": CacheSettings,
        "max_running_requests": int,
    }


def test_a_scheduler_hands_out_sections_and_reports_runtime_info(tiny_llama):
    from radixrt.scheduler.scheduler import Scheduler

    config = EngineConfig(
        model_path=tiny_llama, max_total_tokens=512, page_size=4, host_kv_size=1024, max_n=5, grammar_max_chars=999
    )
    sched = Scheduler(config)
    try:
        assert sched.planner.config is config.scheduling
        assert sched.runner.settings.cache is config.cache and sched.runner.settings.model is config.model
        assert sched.host is not None and sched.host.pool.total_slots == 1024
        info = pickle.loads(pickle.dumps(sched.runtime_info()))  # it crosses the server's ready pipe
        assert (info.context_length, info.kv_total_slots, info.vocab_size) == (8192, 512, sched.vocab_size)
        assert info.limits == sched.limits and (info.limits.max_n, info.limits.grammar.max_chars) == (5, 999)
        assert info.eos_token_ids == tuple(sorted(sched.eos_token_ids))
        assert info.kv_cache["total_tokens"] == 512 and info.kv_cache["bytes_per_token"] > 0
        assert info.model_path == str(sched.runner.model_path)
    finally:
        sched.close()


# ---------------------------------------------------------------- overlap: default by device
@pytest.mark.parametrize(
    "device,flag,overlap",
    [
        ("cpu", None, False),
        ("cuda", None, True),  # unset: overlap on CUDA only
        ("cpu", False, True),
        ("cuda", True, False),  # set: as asked
    ],
)
def test_overlap_schedule_follows_the_device_unless_set(device, flag, overlap):
    assert EngineConfig(device=device, disable_overlap_schedule=flag).execution.overlap_schedule is overlap


@pytest.mark.parametrize(
    "argv,value",
    [
        ([], None),
        (["--disable-overlap-schedule"], True),
        (["--no-disable-overlap-schedule"], False),
    ],
)
def test_overlap_cli_flag_is_three_way(argv, value):
    assert EngineConfig.from_cli_args(_parser().parse_args(argv)).execution.disable_overlap_schedule is value


# ---------------------------------------------------------------- flags that need another (radixrt/config_deps.py)
def _met(need: Need) -> dict:
    """``need``'s flag set, with every need of that flag met."""
    kw = {need.flag: need.example}
    kw.update({n.needs: n.met for n in ENGINE_NEEDS if n.flag == need.flag})
    return kw


@pytest.mark.parametrize("need", ENGINE_NEEDS, ids=lambda n: f"{n.flag}->{n.needs}")
def test_every_dependent_flag_is_implied_or_refused(need):
    ok = EngineConfig(**_met(need)).to_flat()  # met: taken as given
    assert ok[need.flag] == need.example and ok[need.needs] == need.met
    unmet = {**_met(need), need.needs: need.unmet}
    if need.imply:
        assert EngineConfig(**unmet).to_flat()[need.needs] == need.met
    else:
        with pytest.raises(ValueError) as e:
            EngineConfig(**unmet)
        assert need.flag_text(need.example) in str(e.value) and f"needs {need.wants}" in str(e.value)
    default = flag_defaults()[need.flag]
    assert not need.is_set(default, default)  # a flag left at its default needs nothing


def test_every_flag_is_in_the_table_or_reviewed_as_needing_nothing():
    fields = set(flag_sections())
    flags = {n.flag for n in ENGINE_NEEDS}
    assert fields - flags - ENGINE_INDEPENDENT == set(), "add the new flag to ENGINE_NEEDS or ENGINE_INDEPENDENT"
    assert flags & ENGINE_INDEPENDENT == set()
    assert (flags | {n.needs for n in ENGINE_NEEDS} | ENGINE_INDEPENDENT) <= fields


def test_host_tier_size_turns_the_tier_on_and_the_implied_tier_is_checked_too():
    c = EngineConfig.from_cli_args(_parser().parse_args(["--host-kv-size", "20000"]))
    assert c.host_cache.enable_hierarchical_cache and c.host_cache.host_kv_size == 20000
    assert EngineConfig(**c.to_flat()) == c  # the Engine rebuilds it from the CLI's flags
    with pytest.raises(
        ValueError, match=r"\(implied by host_kv_size, --host-kv-size\) needs disable_radix_cache=False"
    ):
        EngineConfig(host_kv_size=20000, disable_radix_cache=True)
    assert not EngineConfig().host_cache.enable_hierarchical_cache
    # its knobs turn it on at their usual values too ("giving it turns the tier on")
    for flags in (["--hicache-ratio", "2"], ["--hicache-write-policy", "write_through"]):
        assert EngineConfig.from_cli_args(_parser().parse_args(flags)).host_cache.enable_hierarchical_cache, flags


def test_speculative_knobs_ask_for_speculation_at_their_usual_values_too():
    """--speculative-num-draft-tokens 4 turned speculation on, and 16 (its default) left it off."""
    for flags in (["--speculative-num-draft-tokens", "16"], ["--speculative-tree-width", "2"]):
        assert EngineConfig.from_cli_args(_parser().parse_args(flags)).speculative.enabled, flags
    on = EngineConfig(speculative_algorithm="RADIX").speculative
    assert (on.speculative_num_draft_tokens, on.speculative_ngram_order, on.speculative_tree_width) == (16, 8, 2)
    assert EngineConfig(**EngineConfig(speculative_algorithm="RADIX").to_flat()).speculative == on
    assert not EngineConfig().speculative.enabled


@pytest.mark.parametrize("need", serve_router_needs(), ids=lambda n: n.cli)
def test_serve_router_flags_need_dp(need):
    defaults = serve_router_defaults()
    args = argparse.Namespace(**defaults, dp=1)
    apply_needs(args, serve_router_needs(), defaults)  # at their defaults: nothing needed
    setattr(args, need.flag, need.example)
    with pytest.raises(ValueError, match=f"{need.cli} .*needs --dp 2 or more"):
        apply_needs(args, serve_router_needs(), defaults)
    args.dp = 2
    apply_needs(args, serve_router_needs(), defaults)


def test_an_sglang_launch_command_line_parses():
    """``python -m sglang.launch_server``'s common flags, as `radixrt serve` takes them: SGLang's
    spellings of radixrt's flags, and its flags that change nothing here (sglang_flags.py)."""
    from radixrt.cli import build_parser
    from radixrt.server.args import server_args_from_cli

    argv = (
        "serve --model-path /m --tokenizer-path / --chat-template / --mem-fraction-static 0.85 --dp-size 2 "
        "--tp-size 1 --trust-remote-code --enable-metrics --enable-cache-report --enable-mixed-chunk "
        "--skip-server-warmup --max-prefill-tokens 16384 --grammar-backend xgrammar --dtype half "
        "--sampling-backend pytorch --host 127.0.0.1 --port 30000 --tensor-parallel-size 1 --log-requests "
        "--watchdog-timeout 300 --load-format auto --nnodes 1 --node-rank 0 --disable-custom-all-reduce "
        "--enable-hierarchical-cache --hicache-ratio 2 --hicache-write-policy write_through --hicache-io-backend "
        "kernel --hicache-mem-layout page_first --hicache-storage-prefetch-policy wait_complete "
        "--load-balance-method total_requests --log-level-http info --sleep-on-idle --show-time-cost "
        "--log-level info --decode-log-interval 25 --collect-tokens-histogram --enable-tokenizer-batch-encode "
        "--disable-outlines-disk-cache --model-impl sglang "
        "--ep-size 1 --cpu-offload-gb 0 --stream-output --tokenizer-worker-num 4 "
        "--uvicorn-access-log-exclude-prefixes /metrics /health"
    ).split()
    args = build_parser("serve").parse_args(argv)
    assert args.dp == 2 and server_args_from_cli(args).port == 30000 and args.router_policy == "shortest_queue"
    assert build_parser("serve").parse_args(["serve", "--dp-size", "2"]).router_policy == "cache_aware"
    assert server_args_from_cli(args).log_level_http == "info" and args.log_interval == 25
    assert args.incremental_streaming_output  # --stream-output: SGLang's older spelling
    assert (args.tokenizer_worker_num, args.uvicorn_access_log_exclude_prefixes) == (4, ["/metrics", "/health"])
    for flags, message in (
        ({"ep_size": 8}, "without expert parallelism"),
        ({"cpu_offload_gb": 4}, "keeps every weight on its device"),
        ({"model_impl": "transformers"}, "its own implementation"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**flags)
    with pytest.raises(SystemExit):  # a token-count balance radixrt's router does not have
        build_parser("serve").parse_args(["serve", "--load-balance-method", "minimum_tokens"])
    config = EngineConfig.from_cli_args(args)
    assert (config.model.model_path, config.model.tokenizer_path, config.model.dtype) == ("/m", "/", "float16")
    assert config.cache.mem_fraction_static == 0.85 and config.execution.sampling_backend == "radixrt"
    assert config.sglang.skip_server_warmup and config.sglang.trust_remote_code
    assert config.host_cache.enable_hierarchical_cache and config.sglang.hicache_mem_layout == "page_first"
    with pytest.raises(ValueError, match="grammar_backend"):
        EngineConfig(grammar_backend="outlines")
    with pytest.raises(ValueError, match="hicache_storage_prefetch_policy must be wait_complete: radixrt holds"):
        EngineConfig(hicache_storage_prefetch_policy="best_effort")


def test_an_rl_framework_s_engine_keywords_are_taken():
    """What a public RL framework passes to ``sglang.Engine(...)`` for its rollout engines (beside the
    flags radixrt has): each was a TypeError, and attention_backend='fa3' a ValueError."""
    rl = dict(
        base_gpu_id=0,
        gpu_id_step=1,
        dist_init_addr="10.0.0.1:5000",
        port=40001,
        nccl_port=29600,
        mm_attention_backend="fa3",
        attention_backend="fa3",
        enable_memory_saver=True,
        nnodes=1,
        node_rank=0,
        trust_remote_code=True,
        skip_tokenizer_init=True,
        load_format="dummy",
    )
    config = EngineConfig(model_path="/m", **rl)
    assert config.execution.attention_backend == "auto"  # FlashInfer's kernels on CUDA: no FA3 here
    assert (config.sglang.port, config.sglang.nccl_port) == (40001, 29600)
    assert EngineConfig(attention_backend="torch_native").execution.attention_backend == "torch"
    for name, value in (("base_gpu_id", 2), ("gpu_id_step", 2)):
        with pytest.raises(ValueError, match=f"{name} must be .*CUDA_VISIBLE_DEVICES"):
            EngineConfig(**{name: value})
    with pytest.raises(ValueError, match="nccl_port must be 0 to 65535"):
        EngineConfig(nccl_port=70000)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="sdpa")
    # the Engine's port is no flag: `radixrt serve --port` is the server's, and stays out of the config
    from radixrt.cli import build_parser

    args = build_parser("serve").parse_args(["serve", "--port", "30001", "--attention-backend", "fa3"])
    assert EngineConfig.from_cli_args(args).sglang.port is None


def test_serve_refuses_prefixes_and_out_of_range_values_at_parse_time(capsys):
    """A prefix bound silently to another flag ("--debug" to --debug-check-invariants); a port past
    65,535 and an empty pool failed after the model loaded, with a traceback."""
    from radixrt.cli import build_parser

    for argv in (["serve", "--debug"], ["serve", "--stream", "4"], ["serve", "--port", "99999"]):
        with pytest.raises(SystemExit):
            build_parser("serve").parse_args(argv)
    assert "port must be 0 to 65535" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_total_tokens must hold at least one page"):
        EngineConfig(max_total_tokens=0)
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):  # was a child process's traceback, thrice
        EngineConfig(dtype="float64")


def test_vllms_serve_flags_are_named_in_radixrts_words(capsys):
    from radixrt.cli import main

    assert main(["serve", "--max-model-len", "4096"]) == 2
    assert "--max-model-len is vLLM's; here it is --context-length" in capsys.readouterr().err
    assert main(["serve", "--gpu-memory-utilization=0.9"]) == 2
    assert "--mem-fraction-static" in capsys.readouterr().err


def test_vllms_spellings_of_values_are_taken():
    from radixrt.cli import build_parser
    from radixrt.server.args import server_args_from_cli
    from radixrt.server.tools.parsers import get_parser

    argv = [
        "serve",
        "--kv-cache-dtype",
        "fp8",
        "--reasoning-parser",
        "deepseek_r1",
        "--tool-call-parser",
        "llama3_json",
    ]
    args = build_parser("serve").parse_args(argv)
    assert EngineConfig.from_cli_args(args).cache.kv_cache_dtype == "fp8_e4m3"  # vLLM's fp8 is e4m3
    sargs = server_args_from_cli(args)
    assert (
        sargs.reasoning_parser == "deepseek-r1"
        and type(get_parser(sargs.tool_call_parser, None)).__name__ == "Llama3Parser"
    )


def test_mem_fraction_static_sizes_the_pool_as_sglang(monkeypatch):
    """That share of the total holds weights and pool: the pool gets the free memory beyond the
    rest; max_total_tokens decides where given; a share that leaves nothing is refused."""
    from radixrt.config.sections import CacheSettings
    from radixrt.executor import pool_size

    class PerGiB:
        def tokens_in(self, nbytes: float) -> int:
            return int(nbytes // 2**30)

    monkeypatch.setattr(pool_size, "total_memory_bytes", lambda device: 100 * 2**30)
    monkeypatch.setattr(pool_size, "available_memory_bytes", lambda device: 60 * 2**30)
    assert pool_size.kv_pool_tokens(CacheSettings(mem_fraction_static=0.9), PerGiB(), "cpu") == 50
    assert pool_size.kv_pool_tokens(CacheSettings(mem_fraction=0.5), PerGiB(), "cpu") == 30
    assert pool_size.kv_pool_tokens(CacheSettings(mem_fraction_static=0.9, max_total_tokens=7), PerGiB(), "cpu") == 7
    with pytest.raises(ValueError, match="mem_fraction_static 0.3 leaves no memory"):
        pool_size.kv_pool_tokens(CacheSettings(mem_fraction_static=0.3), PerGiB(), "cpu")


def test_fewer_loaded_adapters_than_a_batch_mixes_is_refused() -> None:
    """SGLang's rule: --max-loaded-loras at least --max-loras-per-batch (a step's adapters are all held)."""
    with pytest.raises(ValueError, match=r"max_loaded_loras \(1\) must be at least max_loras_per_batch \(8\)"):
        EngineConfig(model_path="m", lora_paths=["a=/tmp/a"], max_loaded_loras=1)
    assert EngineConfig(model_path="m", lora_paths=["a=/tmp/a"], max_loaded_loras=2, max_loras_per_batch=2)
