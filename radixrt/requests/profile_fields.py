"""The fields of SGLang's ``/start_profile`` (and ``Engine.start_profile``) checked into a `ProfileReq`.

Taken: ``output_dir``, ``num_steps``, ``activities``, ``with_stack``, ``record_shapes``,
``profile_id``, ``profile_prefix`` (radixrt/scheduler/profiler.py says what each does), and
``dp_rank``, which the router in front of ``--dp`` replicas sets for each (the trace's name
then ends in SGLang's ``-DP-<rank>``). SGLang's
options for its multi-stage and multi-rank runs (``start_step``, ``profile_by_stage``,
``merge_profiles``, ``profile_stages``, ``detailed_annotations``) are taken unset or false and
refused set; any other name is refused.
"""

from __future__ import annotations

from typing import Any

from radixrt.requests.errors import RequestError
from radixrt.requests.messages import ProfileReq

MAX_NAME_CHARS = 256
_UNSUPPORTED = ("start_step", "profile_by_stage", "merge_profiles", "profile_stages", "detailed_annotations")


def _text(fields: dict[str, Any], name: str) -> Any:
    value = fields.get(name)
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 4096):
        raise RequestError(f"'{name}' must be a non-empty string.", name)
    if value is not None and name != "output_dir" and (len(value) > MAX_NAME_CHARS or "/" in value or "\0" in value):
        raise RequestError(f"'{name}' must be at most {MAX_NAME_CHARS} characters, without '/'.", name)
    return value


def profile_request(fields: dict[str, Any]) -> ProfileReq:
    """The start message ``fields`` ask for; RequestError naming the first bad field."""
    known = {"output_dir", "num_steps", "activities", "with_stack", "record_shapes", "profile_id", "profile_prefix"}
    known.add("dp_rank")
    for name, value in fields.items():
        if name in _UNSUPPORTED:
            if value not in (None, False):
                raise RequestError(f"'{name}' is not supported by radixrt; leave it unset.", name)
        elif name not in known:
            raise RequestError(f"Unknown field {name!r}.", name)
    steps, activities = fields.get("num_steps"), fields.get("activities")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise RequestError("'num_steps' must be a positive integer.", "num_steps")
    if activities is not None and not (isinstance(activities, list) and all(isinstance(a, str) for a in activities)):
        raise RequestError("'activities' must be a list of strings ('CPU', 'GPU', 'MEM').", "activities")
    rank = fields.get("dp_rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 16):
        raise RequestError("'dp_rank' must be a non-negative integer.", "dp_rank")
    for flag in ("with_stack", "record_shapes"):
        if fields.get(flag) is not None and not isinstance(fields[flag], bool):
            raise RequestError(f"'{flag}' must be a boolean.", flag)
    return ProfileReq(
        "start",
        output_dir=_text(fields, "output_dir"),
        num_steps=steps,
        activities=activities,
        with_stack=fields.get("with_stack"),
        record_shapes=fields.get("record_shapes"),
        profile_id=_text(fields, "profile_id"),
        profile_prefix=_text(fields, "profile_prefix"),
        dp_rank=rank,
    )
