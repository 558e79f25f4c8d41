"""The tensor-parallel group's join: bounded by SGLang's ``--dist-timeout``."""

import subprocess
import sys
import time

import pytest


@pytest.mark.slow  # a process that imports torch and waits out the timeout (about 4 s)
def test_a_rank_left_alone_gives_up_after_dist_timeout(tmp_path):
    """Rank 0 of two, whose partner never comes, fails the join after ``timeout_s`` seconds
    rather than waiting for the default 7 days (what ``--dist-timeout`` sets for every rank)."""
    code = (
        "from radixrt.executor.parallel.group import TPGroup, keep_gloo_on_loopback\n"
        "keep_gloo_on_loopback('cpu')\n"
        f"TPGroup.join(0, 2, 'file://{tmp_path}/rendezvous', 'cpu', timeout_s=1)\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Wait timeout" in proc.stderr, proc.stderr[-2000:]  # gloo's rendezvous
    assert time.monotonic() - started < 60
