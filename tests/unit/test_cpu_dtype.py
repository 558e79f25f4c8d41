"""dtype=auto on the CPU: bfloat16 only with native bf16 instructions and a measured gain."""

import pytest

from radixrt.executor.cpu_dtype import ProbeTimes, choose_cpu_dtype, cpu_flags, measure_linear


def _probe(fp32: dict[int, float], bf16: dict[int, float]):
    calls = []

    def probe() -> ProbeTimes:
        calls.append(1)
        return ProbeTimes(fp32, bf16)

    return probe, calls


def test_without_native_bf16_float32_and_no_measurement():
    probe, calls = _probe({1: 1.0}, {1: 0.1})
    choice = choose_cpu_dtype({"avx2", "fma", "avx512f"}, probe)
    assert choice.dtype == "float32"
    assert "no native bfloat16" in choice.reason
    assert calls == []  # nothing measured where the flags rule bf16 out


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_native_bf16_and_faster_at_every_batch_picks_bfloat16(flag):
    probe, calls = _probe({1: 1.0, 16: 2.0}, {1: 0.5, 16: 1.2})
    choice = choose_cpu_dtype({"avx2", flag}, probe)
    assert choice.dtype == "bfloat16" and calls == [1]
    assert flag in choice.reason and "batch 1: 0.50x" in choice.reason


@pytest.mark.parametrize(
    "bf16",
    [
        {1: 1.3, 16: 1.0},  # loses at batch 1 (the one-conversation case), wins at 16
        {1: 0.5, 16: 2.5},  # wins at batch 1, loses at 16
        {1: 0.95, 16: 1.95},  # within the margin: not worth it
    ],
)
def test_native_bf16_but_not_faster_keeps_float32(bf16):
    probe, _ = _probe({1: 1.0, 16: 2.0}, bf16)
    choice = choose_cpu_dtype({"avx512_bf16", "amx_bf16"}, probe)
    assert choice.dtype == "float32"
    assert "measured no faster" in choice.reason


def test_cpu_flags_parses_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()


def test_measure_linear_times_both_dtypes():
    times = measure_linear(rows=(1, 4), k=64, n=128, reps=3)
    assert set(times.float32_ms) == set(times.bfloat16_ms) == {1, 4}
    assert all(t > 0 for t in [*times.float32_ms.values(), *times.bfloat16_ms.values()])


def test_the_choice_is_pinned_by_the_environment_or_kept_on_disk(monkeypatch, tmp_path):
    from radixrt.executor import cpu_dtype

    monkeypatch.setenv("RADIXRT_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    probes = []

    def probe() -> ProbeTimes:
        probes.append(1)
        return ProbeTimes({1: 1.0, 16: 2.0}, {1: 0.5, 16: 1.0})

    monkeypatch.setattr(cpu_dtype, "measure_linear", probe)
    for pinned in ("float32", "bfloat16"):
        monkeypatch.setenv("RADIXRT_CPU_DTYPE", pinned)
        cpu_dtype.auto_cpu_dtype.cache_clear()
        assert cpu_dtype.auto_cpu_dtype().dtype == pinned and probes == []
    monkeypatch.setenv("RADIXRT_CPU_DTYPE", "float16")
    cpu_dtype.auto_cpu_dtype.cache_clear()
    with pytest.raises(ValueError, match="RADIXRT_CPU_DTYPE"):
        cpu_dtype.auto_cpu_dtype()
    monkeypatch.delenv("RADIXRT_CPU_DTYPE")
    try:
        for _ in range(2):  # measured once, then read back from $RADIXRT_HOME (a new process's view)
            cpu_dtype.auto_cpu_dtype.cache_clear()
            assert cpu_dtype.auto_cpu_dtype().dtype == "bfloat16"
        assert probes == [1] and len(list(tmp_path.glob("cpu_dtype-*.json"))) == 1
        kept = next(tmp_path.glob("cpu_dtype-*.json"))
        kept.write_text('{"dtype": "float16", "reason": "damaged"}')  # not a dtype auto may mean
        cpu_dtype.auto_cpu_dtype.cache_clear()
        assert cpu_dtype.auto_cpu_dtype().dtype == "bfloat16" and probes == [1, 1]
    finally:
        cpu_dtype.auto_cpu_dtype.cache_clear()
