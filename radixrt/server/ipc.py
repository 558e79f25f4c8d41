"""Messages and ZMQ plumbing between the server's three processes.

    TokenizerManager (main) --GenerateReq/AbortReq/...--> scheduler process
    TokenizerManager (main) --DetokRegister-------------> detokenizer process
    scheduler process       --TokenBatch/ControlReply---> detokenizer process
    detokenizer process     --DetokBatch/ControlReply---> TokenizerManager

Every socket is a PUSH/PULL pair on an ``ipc://`` path inside a private
temporary folder; messages are pickled dataclasses (all processes run the same
code, and nothing outside this machine can reach the sockets).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from radixrt.requests.messages import TokenOutput, token_output_from_row, token_output_row


@dataclass
class DetokRegister:
    """Tells the detokenizer how to turn these rids' tokens into text. Sent by
    the tokenizer manager before the matching GenerateReq goes to the scheduler."""

    rids: list[str]  # the internal ids of the samples of one request
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    stop_regex: list[str] = field(default_factory=list)
    parent: str = ""  # the request's internal id (the one rid when n == 1)
    prompt_tail: list[int] = field(default_factory=list)  # the prompt's last ids (IncrementalDetokenizer's)


@dataclass
class DetokItem:
    rid: str
    text: str  # cumulative text so far
    out: TokenOutput  # the scheduler's delta (token ids, counts, logprobs, finish reason)


def _detok_batch_from_rows(rows: list[tuple[str, str, tuple]]) -> "DetokBatch":
    return DetokBatch([DetokItem(rid, text, token_output_from_row(out)) for rid, text, out in rows])


@dataclass
class DetokBatch:
    items: list[DetokItem]

    def __reduce__(self) -> tuple[Any, tuple[list[tuple[str, str, tuple]]]]:
        """Pickled as rows of plain values, as `TokenBatch` is (one batch per step)."""
        return _detok_batch_from_rows, ([(i.rid, i.text, token_output_row(i.out)) for i in self.items],)


@dataclass
class IpcAddrs:
    folder: str
    scheduler_in: str
    detokenizer_in: str
    tokenizer_in: str

    @classmethod
    def create(cls) -> "IpcAddrs":
        folder = tempfile.mkdtemp(prefix="radixrt-ipc-")
        os.chmod(folder, 0o700)

        def addr(name: str) -> str:
            return f"ipc://{os.path.join(folder, name)}"

        return cls(folder, addr("scheduler"), addr("detokenizer"), addr("tokenizer"))

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def make_socket(ctx: Any, kind: int, addr: str, bind: bool) -> Any:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


def parent_alive(parent_pid: Optional[int]) -> bool:
    """True while the process that started us is still our parent."""
    return parent_pid is None or os.getppid() == parent_pid
