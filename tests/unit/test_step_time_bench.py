"""`python -m radixrt.bench.step_time` runs end to end and reports every batch it was asked for,
through the scheduler alone, `Engine.generate` and ``POST /generate`` (a real server, streaming and not)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # the benchmark's own process, a server and an Engine: ~15 s
def test_step_time_bench_reports_each_batch(tmp_path):
    out = tmp_path / "steps.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixrt.bench.step_time",
            "--batches",
            "1,3",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "one small torch op costs" in proc.stdout
    report = json.loads(out.read_text())
    assert report["op_overhead_us"] > 0 and report["threads"] == 1
    assert isinstance(report["cpu_decode_kernel"], bool)
    assert "decode attention: " in proc.stdout
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["model_ms_per_step"] > 0
        assert abs(r["model_ms_per_step"] + r["host_ms_per_step"] - r["ms_per_step"]) < 1e-6
    assert [r["batch"] for r in report["engine_rows"]] == [1, 3]
    modes = ["http", "http-stream", "http-streams"]
    assert [(r["batch"], r["mode"]) for r in report["http_rows"]] == [(b, m) for b in (1, 3) for m in modes]
    by_batch = {r["batch"]: r["ms_per_step"] for r in rows}
    for r in report["engine_rows"] + report["http_rows"]:
        assert r["ms_per_step"] >= 0 and r["scheduler_ms_per_step"] == by_batch[r["batch"]]
        assert abs(r["ratio"] * r["scheduler_ms_per_step"] - r["ms_per_step"]) < 1e-6
    for path in ("Engine.generate", "POST /generate ", "POST /generate stream", "B streaming requests"):
        assert path in proc.stdout


@pytest.mark.slow
def test_decode_kernel_bench_times_both_paths_and_checks_them():
    proc = subprocess.run(
        [sys.executable, "-m", "radixrt.bench.decode_kernel", "--shape", "4,40,4,2,16", "--calls", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    header, row = proc.stdout.strip().splitlines()[-2:]
    assert header.startswith("shape") and row.split()[0] == "4,40,4,2,16"
    *times, diff = (float(x) for x in row.split()[1:])
    assert len(times) == 4 and all(t > 0 for t in times)
    assert diff < 1e-4  # the C kernel agrees with gather + SDPA


@pytest.mark.slow
def test_decode_kernel_bench_with_drafts_times_the_rows_read_apart_too():
    proc = subprocess.run(
        [sys.executable, "-m", "radixrt.bench.decode_kernel", "--shape", "2,40,4,2,16", "--calls", "2", "--draft", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr  # (1 when the grouped rows differ from the rows apart)
    header, row = proc.stdout.strip().splitlines()[-2:]
    assert "rows apart" in header and row.split()[0] == "2,40,4,2,16"
    values = row.replace("/", " ").split()[1:]
    assert len(values) == 7 and float(values[4]) < 1e-4 and float(values[5]) > 0


@pytest.mark.slow
def test_decode_kernel_bench_times_another_build_and_refuses_one_that_differs(tmp_path):
    """``--against-source``: another build of the C source, timed beside the current one; a
    build whose outputs are not the current kernel's bit for bit ends the run with a message."""
    from radixrt.kernels import cpu_decode

    def run(source: Path) -> subprocess.CompletedProcess:
        args = ["--shape", "2,40,4,2,16", "--calls", "2", "--draft", "3", "--against-source", str(source)]
        return subprocess.run(
            [sys.executable, "-m", "radixrt.bench.decode_kernel", *args], capture_output=True, text=True, timeout=300
        )

    same = run(cpu_decode.SOURCE)
    assert same.returncode == 0, same.stderr
    header, row = same.stdout.strip().splitlines()[-2:]
    assert "other warm / cold us" in header
    values = row.replace("/", " ").split()[1:]
    assert len(values) == 11 and all(float(v) > 0 for v in values[7:])  # its times and the ratios
    text = cpu_decode.SOURCE.read_text()
    assert text.count("* scale;") == 1
    other = tmp_path / "scaled.c"
    other.write_text(text.replace("* scale;", "* scale * 1.5f;"))
    differs = run(other)
    assert differs.returncode != 0 and "outputs differ from the current kernel's" in differs.stderr


def test_decode_slot_table_lays_out_prompts_then_interleaved_decode_tokens():
    from radixrt.bench.decode_kernel import decode_slot_table

    table = decode_slot_table(3, 34)
    assert table[1, :32].tolist() == list(range(32, 64))
    assert table[:, 32].tolist() == [96, 97, 98] and table[:, 33].tolist() == [99, 100, 101]
    assert len(set(table.flatten().tolist())) == table.numel()
