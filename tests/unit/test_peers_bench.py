"""`radixrt bench --peers`: the radixrt configurations it takes, the table it prints, and one
small run end to end on the tiny model (llama.cpp only where llama_cpp is importable)."""

import json
import subprocess
import sys

import pytest

from radixrt.bench.peers import PeerRow, PeerWorkload, config_label, finish, format_table, gguf_kind, parse_config


def test_parse_config_types_fields_as_the_command_line_does():
    assert parse_config("bfloat16") == {"dtype": "bfloat16"}
    flags = parse_config("dtype=float32, max_total_tokens=4096, disable_radix_cache=true")
    assert flags == {"dtype": "float32", "max_total_tokens": 4096, "disable_radix_cache": True}
    assert config_label(flags) == "radixrt float32 max_total_tokens=4096 disable_radix_cache=True"
    with pytest.raises(ValueError, match="'no_such_field' is not an EngineConfig field"):
        parse_config("no_such_field=1")


def test_results_are_tokens_per_second_or_seconds_by_workload():
    wls = [PeerWorkload("a", [[1, 2]] * 4, 10, "tok/s"), PeerWorkload("b", [[1]] * 2, 5, "s", transformers=False)]
    row = finish(PeerRow("x", wall_s={"a": 2.0, "b": 3.0}), wls)
    assert row.results == {"a": 20.0, "b": 3.0}  # 4 x 10 tokens in 2 s; b in seconds
    other = finish(PeerRow("y", wall_s={"a": 4.0}), wls)
    text = format_table([row, other], wls)
    lines = text.splitlines()
    assert lines[0].split() == ["workload", "x", "y"]
    assert "20.0 tok/s" in lines[1] and "10.0 tok/s" in lines[1]
    assert "3.0 s" in lines[2] and lines[2].rstrip().endswith("-")  # y did not run b
    md = format_table([row, other], wls, markdown=True).splitlines()
    assert md[0] == "| workload | x | y |" and md[1] == "|---|---:|---:|"


def test_gguf_kind_reads_the_quantization_from_the_file_name():
    assert gguf_kind("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert gguf_kind("model.gguf") == "GGUF"


@pytest.mark.slow  # every workload of the benchmark: ~10 s
def test_peers_bench_runs_every_workload_on_the_tiny_model(tiny_llama, tmp_path):
    out = tmp_path / "peers.json"
    cmd = [sys.executable, "-m", "radixrt.cli", "bench", "--peers", "--model", tiny_llama, "--json-out", str(out)]
    cmd += ["--scale", "0.03", "--radixrt-config", "dtype=float32,disable_radix_cache=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    systems = [r["system"] for r in report["rows"]]
    assert systems[0] == "radixrt float32 disable_radix_cache=True"
    assert systems[-1].startswith("transformers generate")
    for row in report["rows"]:
        expected = set(report["workloads"]) - ({"32 shared prefix"} if "transformers" in row["system"] else set())
        assert set(row["results"]) == expected and all(v > 0 for v in row["results"].values())
    if not any(s.startswith("llama.cpp") for s in systems):
        assert report["notes"] and report["notes"][0].startswith("llama.cpp skipped: ")
    assert "one conversation" in proc.stdout and "tok/s" in proc.stdout
