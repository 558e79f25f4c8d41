"""EngineConfig: switches whose default depends on the device; flags that need another."""
import argparse
import dataclasses

import pytest

from radixrt.cli import serve_router_defaults, serve_router_needs
from radixrt.config import EngineConfig
from radixrt.config_deps import ENGINE_INDEPENDENT, ENGINE_NEEDS, Need, apply_needs


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


# ---------------------------------------------------------------- flags that need another (radixrt/config_deps.py)
def _met(need: Need) -> dict:
    """``need``'s flag set, with every need of that flag met."""
    kw = {need.flag: need.example}
    kw.update({n.needs: n.met for n in ENGINE_NEEDS if n.flag == need.flag})
    return kw


@pytest.mark.parametrize("need", ENGINE_NEEDS, ids=lambda n: f"{n.flag}->{n.needs}")
def test_every_dependent_flag_is_implied_or_refused(need):
    ok = EngineConfig(**_met(need))  # met: taken as given
    assert getattr(ok, need.flag) == need.example and getattr(ok, need.needs) == need.met
    unmet = {**_met(need), need.needs: need.unmet}
    if need.imply:
        assert getattr(EngineConfig(**unmet), need.needs) == need.met
    else:
        with pytest.raises(ValueError) as e:
            EngineConfig(**unmet)
        assert need.flag_text(need.example) in str(e.value) and f"needs {need.wants}" in str(e.value)
    default = dataclasses.fields(EngineConfig)[[f.name for f in dataclasses.fields(EngineConfig)].index(need.flag)]
    assert not need.is_set(default.default, default.default)  # a flag left at its default needs nothing


def test_every_field_is_in_the_table_or_reviewed_as_needing_nothing():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    flags = {n.flag for n in ENGINE_NEEDS}
    assert fields - flags - ENGINE_INDEPENDENT == set(), "add the new field to ENGINE_NEEDS or ENGINE_INDEPENDENT"
    assert flags & ENGINE_INDEPENDENT == set()
    assert (flags | {n.needs for n in ENGINE_NEEDS} | ENGINE_INDEPENDENT) <= fields


def test_host_tier_size_turns_the_tier_on_and_the_implied_tier_is_checked_too():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    c = EngineConfig.from_cli_args(parser.parse_args(["--host-kv-size", "20000"]))
    assert c.enable_hierarchical_cache and c.host_kv_size == 20000
    assert EngineConfig(**dataclasses.asdict(c)) == c  # the Engine rebuilds it from the CLI's fields
    with pytest.raises(ValueError, match=r"\(implied by host_kv_size, --host-kv-size\) needs tp_size=1"):
        EngineConfig(host_kv_size=20000, tp_size=2)
    assert not EngineConfig().enable_hierarchical_cache


@pytest.mark.parametrize("need", serve_router_needs(), ids=lambda n: n.cli)
def test_serve_router_flags_need_dp(need):
    defaults = serve_router_defaults()
    args = argparse.Namespace(**defaults, dp=1)
    apply_needs(args, serve_router_needs(), defaults)  # at their defaults: nothing needed
    setattr(args, need.flag, need.example)
    with pytest.raises(ValueError, match=f"{need.cli} .*needs --dp 2 or more"):
        apply_needs(args, serve_router_needs(), defaults)
    args.dp = 2
    apply_needs(args, serve_router_needs(), defaults)
