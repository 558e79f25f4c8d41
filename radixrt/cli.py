"""The `radixrt` command: download, generate, serve, bench, plan."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Optional

from radixrt.config import EngineConfig
from radixrt.config_deps import Need
from radixrt.help_format import HelpFormatter


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if level.lower() != "debug":  # a line per request the router sends (every health check) below debug
        logging.getLogger("httpx").setLevel(logging.WARNING)


def cmd_download(args: argparse.Namespace) -> int:
    from radixrt.executor.model_store import download_default_model

    path = download_default_model(force=args.force)
    print(path)
    return 0


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux's ``/proc/self/stat``), else None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def startup_breakdown(phases: list[tuple[str, float]], first: str, total: Optional[float]) -> str:
    """One line: where the time to ``first`` (the last phase's name) went."""
    total_s = "" if total is None else f" {total:.1f} s"
    return f"start-up to the {first}{total_s}: " + ", ".join(f"{name} {s:.2f} s" for name, s in phases)


def _log_startup(phases: list[tuple[str, float]], engine: Any, first: str) -> None:
    """Splits the engine's set-up into the runner's phases and logs the breakdown at info."""
    runner_s = dict(getattr(engine.scheduler.runner, "startup_s", {}))
    out = []
    for name, s in phases:
        if name == "engine":
            out += list(runner_s.items())
            name, s = "rest of the engine", max(s - sum(runner_s.values()), 0.0)
        out.append((name, s))
    age = process_age_s()
    logging.getLogger("radixrt.cli").info(startup_breakdown(out, first, age))


def cmd_generate(args: argparse.Namespace) -> int:
    phases = [("python and the CLI", process_age_s() or 0.0)]
    clock = time.perf_counter()
    from radixrt.engine import Engine

    phases.append(("imports", time.perf_counter() - clock))
    config = EngineConfig.from_cli_args(args)
    clock = time.perf_counter()
    engine = Engine(**config.to_flat())
    phases.append(("engine", time.perf_counter() - clock))
    try:
        prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if args.chat:
            prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        if args.beam_width > 1:
            sampling.update(beam_width=args.beam_width, length_penalty=args.length_penalty)
        clock = time.perf_counter()
        if args.stream and len(prompts) == 1:
            printed, logged = 0, False
            incremental = engine.config.output.incremental_streaming_output  # chunks hold only new text
            for chunk in engine.generate(prompts[0], sampling, stream=True):
                if not logged:
                    _log_startup([*phases, ("first token", time.perf_counter() - clock)], engine, "first token")
                    logged = True
                sys.stdout.write(chunk["text"] if incremental else chunk["text"][printed:])
                sys.stdout.flush()
                printed = len(chunk["text"])
            sys.stdout.write("\n")
            return 0
        results = engine.generate(prompts, sampling)
        _log_startup([*phases, ("generate", time.perf_counter() - clock)], engine, "results")
        for r in results:
            if args.json:
                print(json.dumps(r))
            else:
                print(r["text"])
                beam = r["meta_info"].get("beam")
                print(
                    f"--- {r['meta_info']['completion_tokens']} tokens, "
                    f"{r['meta_info']['cached_tokens']} cached prompt tokens"
                    + (f", beam score {beam['score']:.4f}" if beam else ""),
                    file=sys.stderr,
                )
    finally:
        engine.shutdown()
    return 0


def add_serve_command(p: argparse.ArgumentParser) -> None:
    """The flags of `radixrt serve`: one server's (radixrt/server/launch.py),
    then ``--dp`` and the ``--router-*`` flags of the router in front of
    ``--dp`` replicas (radixrt/router/cli.py); runs :func:`cmd_serve`."""
    from radixrt.router.cli import add_policy_args
    from radixrt.server.args import add_serve_args

    add_serve_args(p)
    dp = p.add_argument_group("data parallel (the router in front of --dp replicas)")
    dp.add_argument(
        "--dp",
        "--dp-size",  # SGLang's spellings
        "--data-parallel-size",
        dest="dp",
        type=int,
        default=1,
        help="data parallel: this many replicas (each its own scheduler, KV pool and radix "
        "cache; flags apply per replica) behind one router front (docs/scale_out.md)",
    )
    add_policy_args(dp, prefix="router-")
    dp.add_argument(
        "--load-balance-method",
        dest="router_policy",
        type=lambda v: "shortest_queue" if v == "total_requests" else v,  # the fewest requests in flight
        choices=("round_robin", "shortest_queue"),
        default=argparse.SUPPRESS,  # --router-policy's default stands
        help="SGLang's spelling of --router-policy for its policies radixrt has (total_requests is "
        "shortest_queue); default: --router-policy's",
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """`radixrt serve`: one server, or with ``--dp N`` (N > 1) N replicas behind
    a router (radixrt/router/dp.py). The server and the router do not import
    each other: this is where the choice is made."""
    from radixrt.config_deps import apply_needs
    from radixrt.server.args import server_args_from_cli
    from radixrt.server.launch import launch_server

    apply_needs(args, serve_router_needs(), serve_router_defaults())  # --router-* flags need --dp 2+
    config = EngineConfig.from_cli_args(args)
    if args.dp > 1:
        from radixrt.router.dp import serve_dp

        return serve_dp(config, server_args_from_cli(args), args)
    if args.dp < 1:
        raise ValueError(f"--dp must be at least 1, got {args.dp}")
    return launch_server(config, server_args_from_cli(args))


def serve_router_needs() -> tuple[Need, ...]:
    """`radixrt serve`'s ``--router-*`` flags: read only by the router in front
    of ``--dp N`` replicas, so each needs ``--dp`` 2 or more (refused, not
    implied: replicas multiply the memory the server takes)."""
    rows = []
    for action in _router_parser()._actions:
        cli = next((s for s in action.option_strings if s.startswith("--router-")), None)
        if cli is None:
            continue
        rows.append(
            Need(
                action.dest,
                _other_value(action),
                "dp",
                2,
                1,
                "--dp 2 or more (a router runs only in front of replicas)",
                lambda v: v >= 2,
                cli=cli,
            )
        )
    return tuple(rows)


def serve_router_defaults() -> dict[str, Any]:
    """The ``--router-*`` flags' defaults, by destination."""
    return vars(_router_parser().parse_args([]))


def _router_parser() -> argparse.ArgumentParser:
    from radixrt.router.cli import add_policy_args

    p = argparse.ArgumentParser(add_help=False)
    add_policy_args(p, prefix="router-")
    return p


def _other_value(action: argparse.Action) -> Any:
    """A value of an argparse option other than its default (a row's ``example``)."""
    default = action.default
    if action.choices:
        return next(c for c in action.choices if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    return f"{default}-other"


def _add_download(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=cmd_download)


def _add_generate(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    p.add_argument("prompt", nargs="*", help="prompts; none: one prompt per non-empty stdin line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--beam-width", type=int, default=1, help="beam search of this width (1: no beam search)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam score = logprob / length ** this")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt only)")
    p.add_argument("--json", action="store_true", help="print whole SGLang-shaped results, one JSON per line")
    p.set_defaults(func=cmd_generate)


def _add_router(p: argparse.ArgumentParser) -> None:
    from radixrt.router.cli import add_router_args, router_main

    add_router_args(p)
    p.set_defaults(func=router_main)


def _add_bench(p: argparse.ArgumentParser) -> None:
    from radixrt.bench.main import add_bench_args, bench_main

    add_bench_args(p)
    p.set_defaults(func=bench_main)


def _add_plan(p: argparse.ArgumentParser) -> None:
    from radixrt.plan import add_plan_args, plan_main

    add_plan_args(p)
    p.set_defaults(func=plan_main)


# (name, help, what adds its flags): a command's flags are built only when it runs or for help
COMMANDS = (
    (
        "download",
        "fetch and convert the embedded default model (SmolLM2-135M-Instruct) into "
        "$RADIXRT_HOME (default ~/.cache/radixrt); prints its folder",
        _add_download,
    ),
    ("generate", "generate from prompts (arguments or stdin lines)", _add_generate),
    ("serve", "run the HTTP server (SGLang-native and OpenAI APIs)", add_serve_command),
    (
        "router",
        "route requests over radixrt servers (data parallel): cache_aware, round_robin or "
        "shortest_queue, with health checks and failover (see docs/scale_out.md)",
        _add_router,
    ),
    (
        "bench",
        "benchmark radixrt against its baselines (transformers generate, radix cache off, "
        "other policies), offline on in-process engines and online against HTTP servers "
        "(see docs/benchmarks.md)",
        _add_bench,
    ),
    (
        "plan",
        "capacity arithmetic from a model's config.json: KV bytes per token, "
        "max live tokens, concurrency (loads no weights)",
        _add_plan,
    ),
)


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The `radixrt` parser; with ``only``, the other commands get their help line
    but not their flags (whose modules, the server's, the router's and the
    benchmarks', then need not be imported)."""
    parser = argparse.ArgumentParser(
        prog="radixrt", description="RadixAttention runtime for LLM programs", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text, add_flags in COMMANDS:
        # no prefixes: "--debug" bound to --debug-check-invariants, "--stream 4" to --stream-interval
        p = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter, allow_abbrev=False)
        if only is None or only == name:
            add_flags(p)
    return parser


# `vllm serve` flags a migrating user types, and what `radixrt serve` calls them
VLLM_FLAGS = {
    "--max-model-len": "--context-length",
    "--gpu-memory-utilization": "--mem-fraction-static",
    "--max-num-seqs": "--max-running-requests",
    "--max-num-batched-tokens": "--chunked-prefill-size",
    "--enable-prefix-caching": "nothing (the radix cache is always on; --disable-radix-cache turns it off)",
    "--no-enable-prefix-caching": "--disable-radix-cache",
    "--enable-auto-tool-choice": "nothing (tool calls are always read; --tool-call-parser picks the format)",
    "--seed": "--random-seed",
    "--enforce-eager": "--disable-cuda-graph",
    "--max-logprobs": "--max-top-logprobs-num",
    "--block-size": "--page-size",
    "--lora-modules": "--lora-paths",
    "--generation-config": "--sampling-defaults",
    "--enable-log-requests": "--log-requests",
    "--disable-log-requests": "nothing (requests are logged only under --log-requests)",
    "--max-log-len": "--log-requests-level (2 cuts each text at 2,048 characters, 3 logs it whole)",
}


def vllm_flag_hint(given: list[str]) -> Optional[str]:
    """What `radixrt serve` calls the first `vllm serve` flag of ``given`` (None without one)."""
    for arg in given:
        flag = arg.split("=", 1)[0]
        if flag in VLLM_FLAGS:
            return f"{flag} is vLLM's; here it is {VLLM_FLAGS[flag]}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    command = given[0] if given and given[0] in {name for name, _, _ in COMMANDS} else None
    hint = vllm_flag_hint(given) if command == "serve" else None
    if hint is not None:
        print(f"radixrt serve: error: {hint}", file=sys.stderr)
        return 2
    args = build_parser(command).parse_args(given)
    try:
        _setup_logging(getattr(args, "log_level", "warning") or "warning")
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad input: a clear message, no traceback
        print(f"radixrt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
