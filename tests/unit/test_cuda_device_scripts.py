"""The device scripts on CPU: the carried-archive install logic and the packer's
pure helpers (no network, no nvcc), and gpu_check.py's --dry-run end to end."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "device" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_split_and_reinstall_carried_archive(tmp_path, monkeypatch):
    pack = _load("pack_flashinfer")
    check = _load("gpu_check")
    site = tmp_path / "stage" / "site" / "fakepkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("VALUE = 42\n")
    (site / "blob.bin").write_bytes(random.Random(0).randbytes(20000))  # incompressible
    carry = tmp_path / "carry"
    carry.mkdir()
    archive = carry / "flashinfer-0.0-sm90a.tar.xz"
    with tarfile.open(archive, "w:xz") as tf:
        tf.add(tmp_path / "stage" / "site", arcname="site")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    parts = pack.split_file(archive, 4096)
    assert len(parts) > 1 and not archive.exists() and all(p.stat().st_size <= 4096 for p in parts)
    manifest = {
        "flashinfer_version": "0.0",
        "archive": archive.name,
        "archive_sha256": sha,
        "parts": [{"name": p.name, "bytes": p.stat().st_size} for p in parts],
    }
    (carry / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(check, "STAGE", tmp_path / "dev-stage")
    monkeypatch.setattr(check, "SITE_DIR", tmp_path / "dev-site")
    report = check.Report(tmp_path / "out", 60)

    # staging: the parts travel over two calls; the first one cannot install yet
    first = tmp_path / "call1"
    first.mkdir()
    for f in [carry / "manifest.json", parts[0]]:
        (first / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="not carried yet"):
        check.install_flashinfer(first, report)
    second = tmp_path / "call2"
    second.mkdir()
    for f in parts[1:]:
        (second / f.name).write_bytes(f.read_bytes())
    got = check.install_flashinfer(second, report)
    assert (got / "fakepkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert check.install_flashinfer(second, report) == got  # installed once

    # a corrupted part is caught
    monkeypatch.setattr(check, "SITE_DIR", tmp_path / "dev-site-2")
    bad = tmp_path / "dev-stage" / parts[0].name
    bad.write_bytes(b"x" + bad.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        check.install_flashinfer(second, report)


def test_plain_checkout_imports_mapped_packages(tmp_path):
    """Without an install (as on the GPU machine), the checkout's root on sys.path
    is enough: radixrt maps radixrt.kernels -> kernels/ and radixrt.frontend -> frontend/."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower()]; "
        "import radixrt.kernels.flashinfer_backend as k, radixrt.frontend.interpreter as f; "
        "print(k.__file__); print(f.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.split()
    assert out == [str(ROOT / "kernels" / "flashinfer_backend.py"), str(ROOT / "frontend" / "interpreter.py")]


def test_pack_trim_keeps_python_and_needed_data(tmp_path):
    pack = _load("pack_flashinfer")
    full = tmp_path / "full"
    pkg = full / "flashinfer"
    files = {
        "__init__.py": b"x",
        "decode.py": b"x",
        "tuning_configs/a.json": b"{}",
        "cake_backend/kernels.so": b"\0" * (pack.SMALL_FILE + 1),
        "data/include/flashinfer/attention.cuh": b"x",
        "data/csrc/batch_decode.cu": b"x",
        "data/csrc/huge.cu": b"x" * (pack.CSRC_SMALL + 1),
        "data/csrc/sub/other.cu": b"x",
        "data/cutlass/include/cute/a.hpp": b"x",
        "data/cccl/used.h": b"x",
        "data/cccl/unused.h": b"x",
        "data/aot/mod/mod.so": b"elf",
    }
    for rel, data in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes(data)
    (full / "flashinfer_python-0.0.dist-info").mkdir()
    (full / "flashinfer_python-0.0.dist-info" / "METADATA").write_text("Name: flashinfer-python\n")
    (full / "flashinfer_python-0.0.dist-info" / "RECORD").write_text("big\n")
    (full / "flashinfer_python-0.0.dist-info" / "licenses").mkdir()
    (full / "flashinfer_python-0.0.dist-info" / "licenses" / "LICENSE").write_text("Apache-2.0\n")
    out = tmp_path / "out"
    pack.trim(full, out, keep_data={pkg / "data/cccl/used.h"})
    kept = {str(p.relative_to(out / "flashinfer")) for p in (out / "flashinfer").rglob("*") if p.is_file()}
    assert kept == {
        "__init__.py",
        "decode.py",
        "tuning_configs/a.json",
        "data/include/flashinfer/attention.cuh",
        "data/csrc/batch_decode.cu",
        "data/cccl/used.h",
        "data/aot/mod/mod.so",
    }
    assert (out / "flashinfer_python-0.0.dist-info" / "METADATA").exists()
    assert not (out / "flashinfer_python-0.0.dist-info" / "RECORD").exists()
    assert (out / "flashinfer_python-0.0.dist-info" / "licenses" / "LICENSE").exists()


@pytest.mark.slow  # runs every section, the embedded model's end-to-end one included
def test_gpu_check_dry_run(tmp_path):
    """Every section of the device script, on CPU with the FlashInfer emulation."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/device/gpu_check.py",
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--carry",
            str(tmp_path / "no-carry"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["errors"] == {}
    s = data["sections"]
    assert s["correctness"]["pass"] and s["correctness"]["cases"] == 2 * 4 * 7
    assert s["fp8kv"]["pass"] and s["fp8kv"]["cases"] == 2 * 2 * 2 * 3
    assert {v["page_size"] for v in s["bandwidth"]["decode"]} == {1, 16}
    assert s["sampling"]["pass"]
    assert s["beam"]["engine_vs_loop"] > 0 and s["beam"]["peak_kv_slots"] > 0
    assert s["hostkv"]["pass"] and s["hostkv"]["round_trip_exact"] and s["hostkv"]["load_GBps"] > 0
    for shape in ("default", "llama-1b"):
        for overlap in ("on",):  # the dry run times the overlap loop only
            rows = s["steptime"]["rows"][f"{shape}, overlap {overlap}"]
            assert [r["batch"] for r in rows] == [1, 4] and all(r["ms_per_step"] > 0 for r in rows)
    cpu = s["steptime"]["cpu_tiny"]
    assert cpu["op_overhead_us"] > 0 and [r["batch"] for r in cpu["rows"]] == [1, 4]
    e2e = s["e2e"]
    for model in ("default", "llama-1b"):
        row = e2e[model]["radixrt"]
        assert row["backend"] == "FlashInferBackend"
        for wl in ("batch-decode", "shared-prefix"):
            assert row[wl]["tok_s"] > 0 and row[wl]["speedup_vs_transformers"] > 0
        assert row["shared-prefix"]["cached_tokens"] > 0
    budget = s["kvbudget"]
    if "skipped" not in budget:  # after the speculative section, as the time budget allows
        assert budget["context"] == 256 and budget["h2o_25"]["prefill_s"] > 0
    spec = s["speculative"]
    if "skipped" not in spec:  # the last section: a loaded machine may run out of the time budget first
        assert spec["all_equal"] and len(spec["rows"]) == 4 * 2 and all(r["verify_ct"] > 0 for r in spec["rows"])
    assert "SUMMARY" in proc.stdout


def test_disagreement_gaps_tell_a_flipped_tie_from_a_wrong_token(make_tiny):
    """gpu_check's diagnosis of greedy tokens that differ from transformers': the logit
    gap between the two choices, in units of the step's logit spread, at the first
    difference (transformers' own token against itself: 0; against its worst: large)."""
    import torch
    from transformers import AutoModelForCausalLM

    check = _load("gpu_check")
    model = AutoModelForCausalLM.from_pretrained(make_tiny("llama"), dtype=torch.float32).eval()
    prompt = [5, 17, 33, 81]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert check.disagreement_gaps(model, [prompt], [[best] * 8], [[best] * 8], "cpu") is None
    wrong = check.disagreement_gaps(model, [prompt], [[best] * 8], [[worst] * 8], "cpu")
    assert wrong["cases"] == 1 and wrong["max"] > 2.0
    want = ((logits[best] - logits[worst]) / logits.std()).item()
    assert abs(wrong["median"] - want) < 1e-4
