"""The `radixrt` command line, run as a user would."""

import json
import subprocess
import sys

import pytest


def _radixrt(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixrt.cli", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_download_prints_the_model_folder(default_model_path):
    proc = _radixrt("download")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == default_model_path


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "default"])
def test_generate_json_and_logs(request, model):
    if model == "tiny":
        model = request.getfixturevalue("tiny_llama")
    proc = _radixrt(
        "generate",
        "--model",
        model,
        "--json",
        "--max-new-tokens",
        "5",
        "--max-total-tokens",
        "2048",
        "--log-level",
        "info",
        "--log-interval",
        "1",
        "--chat",
        "What is 2+2?",
        "Name a color.",
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 2
    assert all(1 <= r["meta_info"]["completion_tokens"] <= 5 for r in results)
    # per-step log lines: batch size, throughput, cache hit rate and KV use
    assert "cache hit" in proc.stderr and "KV used" in proc.stderr and "tok/s" in proc.stderr
    assert "start-up to the results" in proc.stderr  # the breakdown, up to the whole batch here


def _breakdown(stderr: str) -> tuple[float, dict[str, float]]:
    """The total and the phases of the start-up breakdown line."""
    line = next(ln for ln in stderr.splitlines() if "start-up to the first token" in ln)
    head, phases = line.split("start-up to the first token ", 1)[1].split(": ", 1)
    parts = [p.rsplit(" ", 2) for p in phases.split(", ")]
    return float(head.split()[0]), {name: float(value) for name, value, unit in parts if unit == "s"}


@pytest.mark.slow
def test_generate_stream_logs_where_the_start_up_time_went(tiny_llama):
    """`--log-level info` breaks the time to the first token into phases that add up to it."""
    proc = _radixrt(
        "generate", "--model", tiny_llama, "--stream", "--max-new-tokens", "3", "--log-level", "info", "Hello"
    )
    assert proc.returncode == 0, proc.stderr
    total, phases = _breakdown(proc.stderr)
    assert list(phases) == [
        "python and the CLI",
        "imports",
        "weights",
        "tokenizer",
        "KV pool",
        "rest of the engine",
        "first token",
    ]
    assert all(s >= 0 for s in phases.values()) and phases["imports"] > 0 and phases["weights"] > 0
    assert 0.8 * total <= sum(phases.values()) <= total + 0.1  # the phases cover the wait, once each
    assert "dtype auto on the CPU: " in proc.stderr  # the dtype decision is logged too


@pytest.mark.slow
def test_generate_rejects_unknown_model_folder(tmp_path):
    proc = _radixrt("generate", "--model", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 2
    assert "radixrt: error:" in proc.stderr and "not a local folder" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flags,missing",
    [
        (["--schedule-low-priority-values-first"], "--enable-priority-scheduling"),
        (["--router-policy", "round_robin"], "--dp 2 or more"),
        (["--host-kv-size", "4096", "--disable-radix-cache"], "no --disable-radix-cache"),
    ],
)
def test_serve_refuses_a_flag_without_what_it_needs(flags, missing):
    """Refused before any model loads: exit 2, a message naming the missing flag."""
    proc = _radixrt("serve", "--model", "/nonexistent", *flags)
    assert proc.returncode == 2
    assert "radixrt: error:" in proc.stderr and missing in proc.stderr and flags[0] in proc.stderr
    assert "Traceback" not in proc.stderr


def _options(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_flag_has_a_help_line_with_its_default():
    import argparse

    from radixrt.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "serve", "bench", "plan", "download"):
        parser = sub.choices[name]
        text = "".join(parser.format_help().split())  # argparse wraps lines, also at hyphens
        for action in _options(parser):
            assert action.help, f"radixrt {name} {action.option_strings[0]} has no help"
            line = parser._get_formatter()._expand_help(action)
            assert "".join(line.split()) in text and "default" in line, (name, action.option_strings, line)


def test_engine_flags_are_listed_by_section():
    """`radixrt serve --help` and `radixrt generate --help` group the flags by
    EngineConfig section (each flag under its own), then the server's."""
    import argparse

    from radixrt.cli import build_parser
    from radixrt.config import SECTIONS, flag_sections
    from radixrt.config.engine_config import keyword_only_flags

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, extra in (("serve", ["server"]), ("generate", [])):
        parser = sub.choices[name]
        groups = {g.title: g for g in parser._action_groups}
        assert [*SECTIONS, *extra] == [t for t in groups if t in (*SECTIONS, *extra)]
        help_text = parser.format_help()
        for section in (*SECTIONS, *extra):
            assert f"\n{section}:\n" in help_text
        for dest, section in flag_sections().items():
            if dest not in keyword_only_flags():  # the Engine's port=: `radixrt serve --port` is the server's
                assert dest in {a.dest for a in groups[section]._group_actions}, (name, dest)


def test_serve_help_never_prints_the_api_key(monkeypatch):
    monkeypatch.setenv("RADIXRT_API_KEY", "s3cret-key")
    proc = _radixrt("serve", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "s3cret-key" not in proc.stdout and "$RADIXRT_API_KEY" in proc.stdout


def test_top_level_help_says_bench_runs_offline_and_online():
    proc = _radixrt("--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "offline" in text and "online" in text


def test_the_server_module_refuses_bad_flags_in_one_line():
    """``python -m radixrt.server`` (what LocalServer runs) as ``radixrt serve``: exit 2 and one line,
    for a log level no logger has (it served at warning) and for fewer loaded adapters than a batch mixes."""
    for flags, said in (
        (["--log-level", "bogus"], "log_level must be one of debug, info, warning, error, critical"),
        (["--lora-paths", "a=/x", "--max-loaded-loras", "1"], "must be at least max_loras_per_batch"),
    ):
        cmd = [sys.executable, "-m", "radixrt.server", "--model", "/nonexistent", *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_serve_on_a_port_in_use_ends_before_the_model_loads(tiny_llama):
    """The port is claimed first: a port in use is one line and exit 1 before any child starts
    (it was found by uvicorn once the model had loaded, minutes later on a large model)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "radixrt.server",
            "--model",
            tiny_llama,
            "--port",
            str(port),
            "--log-level",
            "info",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr, proc.stderr[-2000:]
    assert "scheduler" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
