"""SGLang's ``/start_profile`` and ``/stop_profile``: the torch profiler over the scheduler's steps.

`StepProfiler` is driven from the scheduler's thread; the torch profiler records the thread that
starts it, so it is started, stopped and given its step ranges where the steps run (the launcher's
forward thread under the overlap scheduler: `StepLauncher.between_steps`). `start` begins a
``torch.profiler.profile`` (CPU activity, and CUDA's on a GPU) in which each launched step is a
range ``radixrt step N`` (`launched` closes the last and opens the next); `stop`, or the
``num_steps``-th step, ends it and writes one Chrome trace (Perfetto, ``chrome://tracing``):
``<output_dir>/<prefix>-<profile_id>-TP-<rank>.trace.json.gz`` (``...-TP-<rank>-DP-<dp_rank>...`` for a
replica behind the ``--dp`` router), SGLang's name. The default
``output_dir`` is ``$SGLANG_TORCH_PROFILER_DIR``, else ``$RADIXRT_PROFILE_DIR``, else the system's
temporary folder. A profile stays bounded: without ``num_steps`` it stops itself after
`MAX_PROFILE_STEPS` steps. Writing the trace holds the step loop while it runs, as in SGLang.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from radixrt.requests.messages import ControlReply, ProfileReq

logger = logging.getLogger(__name__)

MAX_PROFILE_STEPS = 10_000
ACTIVITIES = ("CPU", "GPU")  # SGLang's names; "MEM" (memory records) is taken too
Where = Callable[[Callable[[], Any]], Any]  # runs a function where the steps run (a Future back)


@dataclass
class _Running:
    profiler: Any  # torch.profiler.profile, started
    path: str
    steps_left: int
    steps: int = 0
    step_range: Any = None  # the open record_function of the step under way (on the steps' thread)


class StepProfiler:
    def __init__(self, where: Where, rank: int = 0, cuda: bool = False) -> None:
        self.where = where
        self.rank = rank
        self.cuda = cuda
        self._running: Optional[_Running] = None

    def handle(self, msg: ProfileReq) -> ControlReply:
        """Start or stop, as ``msg.action`` says; the reply names the trace's path."""
        try:
            path = self._start(msg) if msg.action == "start" else self._stop()
        except (ValueError, OSError) as e:
            return ControlReply("profile", ok=False, payload={"message": str(e)})
        return ControlReply("profile", payload={"path": path})

    def launched(self) -> None:
        """A step is being launched: it gets its range; past ``num_steps`` the profile ends."""
        run = self._running
        if run is None:
            return
        if run.steps_left <= 0:
            self.close()
            return
        run.steps_left -= 1
        run.steps += 1
        name = f"radixrt step {run.steps}"  # now: under overlap the range opens after later launches
        self.where(lambda: self._next_range(run, name))

    def close(self) -> None:
        """End a running profile, writing its trace (a failed write is logged: the loop goes on)."""
        if self._running is not None:
            try:
                self._stop()
            except OSError:
                logger.exception("the profile's trace could not be written")

    @staticmethod
    def _next_range(run: _Running, name: Optional[str]) -> None:
        import torch.autograd.profiler

        if run.step_range is not None:
            run.step_range.__exit__(None, None, None)
            run.step_range = None
        if name is not None:
            run.step_range = torch.autograd.profiler.record_function(name)
            run.step_range.__enter__()

    def _start(self, msg: ProfileReq) -> str:
        import torch.profiler

        if self._running is not None:
            raise ValueError("a profile is already running; stop it first (/stop_profile).")
        unknown = sorted(set(msg.activities or ()) - {*ACTIVITIES, "MEM"})
        if unknown:
            raise ValueError(f"unknown profiler activities {unknown}; radixrt records {list(ACTIVITIES)} and 'MEM'.")
        wanted = set(msg.activities or ACTIVITIES)
        activities = [torch.profiler.ProfilerActivity.CPU] if "CPU" in wanted else []
        if "GPU" in wanted and self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if not activities:
            raise ValueError("nothing to record: ask for 'CPU' (or 'GPU' on a CUDA device).")
        folder = msg.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR")
        folder = folder or os.environ.get("RADIXRT_PROFILE_DIR") or tempfile.gettempdir()
        os.makedirs(folder, exist_ok=True)
        prefix = f"{msg.profile_prefix}-" if msg.profile_prefix else ""
        dp = "" if msg.dp_rank is None else f"-DP-{msg.dp_rank}"
        path = os.path.join(folder, f"{prefix}{msg.profile_id or time.time()}-TP-{self.rank}{dp}.trace.json.gz")
        profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=bool(msg.record_shapes),
            with_stack=bool(msg.with_stack),
            profile_memory="MEM" in wanted,
        )
        self.where(profiler.start).result()
        self._running = _Running(profiler, path, min(msg.num_steps or MAX_PROFILE_STEPS, MAX_PROFILE_STEPS))
        logger.info("profiling the scheduler's steps into %s", path)
        return path

    def _stop(self) -> str:
        run, self._running = self._running, None
        if run is None:
            raise ValueError("no profile is running; start one with /start_profile.")

        def stop() -> None:
            self._next_range(run, None)
            run.profiler.stop()

        self.where(stop).result()
        run.profiler.export_chrome_trace(run.path)
        logger.info("profile written to %s", run.path)
        return run.path
