"""The `radixrt` command line, run as a user would."""
import json
import subprocess
import sys


def _radixrt(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixrt.cli", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_download_prints_the_model_folder(default_model_path):
    proc = _radixrt("download")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == default_model_path


def test_generate_json_and_logs():
    proc = _radixrt(
        "generate", "--json", "--max-new-tokens", "5", "--max-total-tokens", "2048",
        "--log-level", "info", "--log-interval", "1", "--chat", "What is 2+2?", "Name a color.",
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 2
    assert all(1 <= r["meta_info"]["completion_tokens"] <= 5 for r in results)
    # per-step log lines: batch size, throughput, cache hit rate and KV use
    assert "cache hit" in proc.stderr and "KV used" in proc.stderr and "tok/s" in proc.stderr


def test_generate_rejects_unknown_model_folder(tmp_path):
    proc = _radixrt("generate", "--model", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 2
    assert "radixrt: error:" in proc.stderr and "not a local folder" in proc.stderr
    assert "Traceback" not in proc.stderr
