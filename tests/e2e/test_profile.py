"""SGLang's ``/start_profile`` and ``/stop_profile`` and the Engine's methods (tiny random Llama):
the trace is a real torch profiler trace holding the steps that ran, bounded by ``num_steps``;
bad fields, a second start and a stop with none running are clear errors, and the server goes on."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

import radixrt
from tests.support.servers import TINY_SERVER_ADMIN_KEY, TINY_SERVER_KEY


def _step_ranges(path: str) -> list[str]:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "aten::embedding" for e in events)  # the model's ops are in it
    return [e["name"] for e in events if str(e.get("name", "")).startswith("radixrt step ")]


def test_the_engine_profiles_until_stopped_or_num_steps(tiny_llama, tmp_path):
    e = radixrt.Engine(tiny_llama, max_total_tokens=4096)
    try:
        path = e.start_profile(output_dir=str(tmp_path), profile_id="run1", activities=["CPU"])
        assert path == str(tmp_path / "run1-TP-0.trace.json.gz")
        with pytest.raises(ValueError, match="already running"):
            e.start_profile(output_dir=str(tmp_path))
        e.generate("hello", {"max_new_tokens": 6, "ignore_eos": True})
        assert e.stop_profile() == path
        assert len(_step_ranges(path)) >= 6  # a range per step (the prefill and each decode)
        with pytest.raises(ValueError, match="no profile is running"):
            e.stop_profile()
        path = e.start_profile(output_dir=str(tmp_path), num_steps=3, profile_prefix="short")
        e.generate("hello", {"max_new_tokens": 8, "ignore_eos": True})
        assert len(_step_ranges(path)) == 3  # it stopped itself
        with pytest.raises(ValueError, match="no profile is running"):
            e.stop_profile()
        bad_fields = ({"num_steps": 0}, {"activities": ["TPU"]}, {"profile_by_stage": True}, {"nope": 1})
        for bad in (*bad_fields, {"dp_rank": -1}, {"dp_rank": True}):
            with pytest.raises(ValueError):
                e.start_profile(output_dir=str(tmp_path), **bad)
        assert e.generate("hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    finally:
        e.shutdown()


def test_under_the_overlap_scheduler_each_step_has_its_own_numbered_range(tiny_llama, tmp_path):
    e = radixrt.Engine(tiny_llama, max_total_tokens=4096, disable_overlap_schedule=False)
    try:
        path = e.start_profile(output_dir=str(tmp_path))
        e.generate("hello", {"max_new_tokens": 12, "ignore_eos": True})
        e.stop_profile()
        ranges = _step_ranges(path)
        assert ranges == [f"radixrt step {i}" for i in range(1, len(ranges) + 1)] and len(ranges) >= 12
    finally:
        e.shutdown()


def test_the_server_routes_need_the_admin_key_and_write_the_trace(tiny_server, tmp_path):
    admin = {"x-api-key": TINY_SERVER_ADMIN_KEY}
    with httpx.Client(base_url=tiny_server.url, headers={"x-api-key": TINY_SERVER_KEY}, timeout=60) as http:
        body = {"output_dir": str(tmp_path), "profile_id": "srv", "with_stack": False, "record_shapes": True}
        assert http.post("/start_profile", json=body).status_code == 403  # a client's key
        r = http.post("/start_profile", json=body, headers=admin)
        assert r.status_code == 200 and "srv-TP-0.trace.json.gz" in r.text, r.text
        assert http.post("/start_profile", json=body, headers=admin).status_code == 400
        r = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200
        r = http.post("/stop_profile", headers=admin)
        assert r.status_code == 200, r.text
        assert len(_step_ranges(str(tmp_path / "srv-TP-0.trace.json.gz"))) >= 4
        r = http.post("/stop_profile", headers=admin)
        assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]
        for bad in ({"num_steps": -1}, {"profile_id": "a/b"}, {"merge_profiles": True}, [1]):
            assert http.post("/start_profile", json=bad, headers=admin).status_code == 400, bad
