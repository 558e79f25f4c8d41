"""EngineConfig switches whose default depends on the device."""
import argparse

import pytest

from radixrt.config import EngineConfig


@pytest.mark.parametrize("device,flag,overlap", [
    ("cpu", None, False), ("cuda", None, True),  # unset: overlap on CUDA only
    ("cpu", False, True), ("cuda", True, False),  # set: as asked
])
def test_overlap_schedule_follows_the_device_unless_set(device, flag, overlap):
    assert EngineConfig(device=device, disable_overlap_schedule=flag).overlap_schedule is overlap


@pytest.mark.parametrize("argv,value", [
    ([], None), (["--disable-overlap-schedule"], True), (["--no-disable-overlap-schedule"], False),
])
def test_overlap_cli_flag_is_three_way(argv, value):
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(argv)).disable_overlap_schedule is value
