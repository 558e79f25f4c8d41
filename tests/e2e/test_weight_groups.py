"""SGLang's weight-update groups (tiny random Llama): a trainer process (tests/support/trainer.py,
rank 0 of a gloo group made the way RL trainers make theirs) broadcasts new weights to the Engine
and to the server, which serve them (read back by name, and the answers change); refusals are
clear and leave the served weights as they were."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from radixrt.server.local import free_port
from tests.support.engines import greedy, tiny_engine_fixture
from tests.support.servers import TINY_SERVER_ADMIN_KEY

engine = tiny_engine_fixture()
NORM = "model.norm.weight"


def trainer(port: int, name: str, value: float, *shapes: str) -> subprocess.Popen:
    """Rank 0 of a group of two: it waits for the server's rank, then broadcasts ``shapes``."""
    return subprocess.Popen([sys.executable, "-m", "tests.support.trainer", str(port), "2", name, str(value), *shapes])


def test_the_engine_serves_what_a_trainer_broadcasts(engine):
    width = len(engine.get_weights_by_name(NORM))
    before = engine.generate(input_ids=[1, 5, 9], sampling_params=greedy(8))["output_ids"]
    port = free_port()
    sender = trainer(port, "wg", 0.25, str(width))
    ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, "wg")
    assert ok, message
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "wg")[0] is False  # it exists
    ok, message = engine.update_weights_from_distributed([NORM], ["float32"], [[width]], "wg", weight_version="step-3")
    assert ok, message
    assert sender.wait(timeout=60) == 0
    assert engine.get_weights_by_name(NORM) == [0.25] * width and engine.get_weight_version() == "step-3"
    assert engine.generate(input_ids=[1, 5, 9], sampling_params=greedy(8))["output_ids"] != before
    assert engine.destroy_weights_update_group("wg")[0]
    assert engine.destroy_weights_update_group("wg")[0] is False
    ok, message = engine.update_weights_from_distributed([NORM], ["float32"], [[width]], "wg")
    assert not ok and "no weight-update group" in message
    ok, message = engine.update_weights_from_distributed([NORM], ["float32"], [[10**12]], "wg")
    assert not ok and "more than the model's" in message  # refused before anything is allocated
    assert engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "other", backend="nccl")[0] is False


@pytest.mark.slow
def test_the_http_routes(tiny_server):
    admin = {"Authorization": f"Bearer {TINY_SERVER_ADMIN_KEY}"}
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=120) as c:
        width = len(c.post("/get_weights_by_name", json={"name": NORM}, headers=admin).json())
        port = free_port()
        init = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
        }
        assert c.post("/init_weights_update_group", json=init).status_code == 403  # the admin key's
        for bad in ({**init, "rank_offset": 2}, {**init, "master_port": "x"}, {**init, "world_size": True}):
            assert c.post("/init_weights_update_group", json=bad, headers=admin).status_code == 400
        sender = trainer(port, "g", 0.5, str(width))
        try:
            r = c.post("/init_weights_update_group", json=init, headers=admin)
            assert r.status_code == 200 and r.json()["success"], r.text
            bad = {"names": [NORM], "dtypes": ["float32"], "shapes": [[width], [1]], "group_name": "g"}
            assert c.post("/update_weights_from_distributed", json=bad, headers=admin).status_code == 400
            body = {"names": [NORM], "dtypes": ["float32"], "shapes": [[width]], "group_name": "g"}
            r = c.post("/update_weights_from_distributed", json=body, headers=admin)
            assert r.status_code == 200 and r.json()["success"], r.text
            assert sender.wait(timeout=60) == 0
            assert c.post("/get_weights_by_name", json={"name": NORM}, headers=admin).json() == [0.5] * width
            assert c.post("/destroy_weights_update_group", json={"group_name": "g"}, headers=admin).json()["success"]
            r = c.post("/destroy_weights_update_group", json={"group_name": "g"}, headers=admin)
            assert r.status_code == 400 and "no weight-update group" in r.json()["message"]
        finally:
            sender.kill()
            restore = {"model_path": tiny_server.folder, "weight_version": "default"}
            assert c.post("/update_weights_from_disk", json=restore, headers=admin).status_code == 200
