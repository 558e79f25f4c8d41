"""`python -m radixrt.bench.step_time` runs end to end and reports every batch it was asked for."""
import json
import subprocess
import sys


def test_step_time_bench_reports_each_batch(tmp_path):
    out = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "-m", "radixrt.bench.step_time", "--batches", "1,3", "--steps", "2", "--repeats", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
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
