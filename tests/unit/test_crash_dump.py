"""`CrashDump` (--crash-dump-folder) keeps a bounded window of recent requests; the whole
path, a killed scheduler included, is tests/e2e/test_server.py::test_killed_scheduler_makes_server_exit."""

from __future__ import annotations

import json

from radixrt.requests.crash_dump import CrashDump
from radixrt.requests.intake import RequestSpec
from radixrt.requests.rids import RidEntry
from radixrt.sampling.params import SamplingParams


def _submit(dump: CrashDump, i: int) -> None:
    spec = RequestSpec([i, i + 1], SamplingParams(max_new_tokens=4, n=2))
    dump.on_submit(spec, RidEntry(f"client-{i}", f"id{i}", 2))


def test_only_the_window_and_the_last_requests_are_kept(tmp_path, monkeypatch):
    import radixrt.requests.crash_dump as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "time", lambda: clock[0])
    dump = CrashDump(str(tmp_path / "d"), window_s=60, max_requests=3)
    for i in range(5):  # only the last 3 are kept
        _submit(dump, i)
    clock[0] += 30
    _submit(dump, 5)  # the oldest kept (2) falls out by count, none by age yet
    clock[0] += 45  # 3 and 4 are now 75 s old: out of the 60 s window
    _submit(dump, 6)
    path = dump.write("the scheduler process exited")
    head, *lines = [json.loads(line) for line in open(path)]
    assert head["reason"] == "the scheduler process exited" and head["requests"] == 2
    assert [r["rid"] for r in lines] == ["client-5", "client-6"]
    assert lines[0]["input_ids"] == [5, 6] and lines[0]["sampling_params"] == {"max_new_tokens": 4, "n": 2}
    assert all(r["in_flight"] for r in lines)  # no sample of theirs ended


def test_the_token_ids_kept_are_bounded(tmp_path):
    """A flood of long prompts: the oldest records go once the token ids kept would pass the bound."""
    dump = CrashDump(str(tmp_path), max_tokens=5)
    for i in range(4):  # two ids each
        _submit(dump, i)
    head, *lines = [json.loads(line) for line in open(dump.write("x"))]
    assert [r["input_ids"] for r in lines] == [[2, 3], [3, 4]] and dump._tokens == 4


def test_a_folder_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    dump = CrashDump(str(blocker / "sub"))
    _submit(dump, 0)
    assert dump.write("gone") is None
    assert "could not write the crash dump" in caplog.text
