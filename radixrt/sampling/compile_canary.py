"""A large grammar's compilation tried first in a child process, under a deadline.

What xgrammar's compilation costs follows a grammar's structure in ways its size does not
bound: a JSON schema of 1,000 optional properties (34,000 characters) compiles in 1.4 s
against a 49,152-token vocabulary, one of 2,500 optional properties (86,000 characters) in
minutes, and a compilation cannot be stopped once started. So `GrammarBackend` compiles a
grammar of more than ``SMALL_GRAMMAR_CHARS`` characters only after `CompileCanary.trial`
compiled it in a child process within ``deadline_s`` (`check`); a trial past it kills the
child (a fresh one starts for the next) and the grammar is refused (`GrammarTooCostly`: a 400). One
request's grammar thus costs at most ``deadline_s`` of a core before it is refused, and a
grammar that passes costs twice its compilation (compiled grammars hold their token-mask
cache: handing one over costs more than compiling it again).

The child imports xgrammar alone, reads the parent's ``TokenizerInfo`` once and then, per
trial, a parsed grammar (xgrammar's JSON serialization, linear in the source), answering
``ok`` or the error. Messages are length-prefixed on its stdin and on a copy of its stdout
(its own stdout goes to stderr, so nothing it prints mixes in). It exits when its stdin
closes (the parent is gone). The child starts at the first trial and stays; its start-up
(about 4 s: xgrammar imports torch) is not counted against the deadline, so the first large
grammar a server sees waits that much longer once.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any, Optional

from radixrt.sampling.grammar_bounds import GrammarTooCostly

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the child's import of xgrammar and reading the vocabulary
_LENGTH = struct.Struct(">I")


class CompileCanary:
    """Trial compilations in a child process (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer_info: Any, deadline_s: float) -> None:
        self.deadline_s = float(deadline_s)
        self._info = tokenizer_info
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self.closed = False
        self._warned = False  # the warning that no child could start, given once

    def trial(self, grammar: Any) -> None:
        """Return once ``grammar`` (an xgrammar ``Grammar``) compiled in the child within the
        deadline; GrammarTooCostly when it did not (the child is killed), ValueError when the
        child's compilation failed or crashed it, RuntimeError when no child could be started."""
        payload = grammar.serialize_json().encode()
        with self._lock:
            proc = self._proc or self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, payload)
                answer = _receive(proc.stdout, time.monotonic() + self.deadline_s)
            except TimeoutError:
                self._stop()
                raise GrammarTooCostly(
                    f"it did not compile within {self.deadline_s:g} s (--grammar-max-compile-s)"
                ) from None
            except (EOFError, OSError):  # the child died compiling it (so would the scheduler have), or was stopped
                self._stop()
                raise ValueError("its compilation crashed the process that tried it") from None
        if answer != b"ok":
            raise ValueError(answer.decode(errors="replace").removeprefix("error: "))

    def check(self, grammar: Any) -> None:
        """`trial`, except that where no child can start the grammar passes, with one warning
        (it then compiles unbounded); once closed, ValueError: nothing compiles any more."""
        try:
            self.trial(grammar)
        except RuntimeError as e:
            if self.closed:
                raise ValueError("the grammar compiler is shut down") from None
            if not self._warned:
                logger.warning("large grammars compile without a time bound: %s", e)
            self._warned = True

    def _start(self) -> subprocess.Popen:
        if self.closed:
            raise RuntimeError("the grammar compiler is shut down")
        code = "from radixrt.sampling.compile_canary import serve; serve()"
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        try:
            _send(proc.stdin, self._info.serialize_json().encode())
            if _receive(proc.stdout, time.monotonic() + START_TIMEOUT_S) != b"ready":
                raise EOFError
        except (TimeoutError, EOFError, OSError):
            self._stop()
            raise RuntimeError("the grammar compilation's child process did not start") from None
        return proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        """Stop the child now, without waiting for a trial under way (it then fails); no child
        starts after this."""
        self.closed = True
        proc = self._proc
        if proc is not None:
            proc.kill()  # a trial reading from it meets the end of its output and cleans up
        with self._lock:
            self._stop()


def _send(pipe: IO[bytes], payload: bytes) -> None:
    pipe.write(_LENGTH.pack(len(payload)) + payload)
    pipe.flush()


def _receive(pipe: IO[bytes], deadline: float) -> bytes:
    """One message, read without blocking past ``deadline`` (TimeoutError); EOFError at the end."""
    fd = pipe.fileno()

    def read(n: int) -> bytes:
        out = b""
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    (n,) = _LENGTH.unpack(read(_LENGTH.size))
    return read(n)


def serve() -> None:
    """The child: compile each grammar it is sent, answer ``ok`` or ``error: <message>``."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the child prints goes to stderr, not into the answers
    source = sys.stdin.buffer

    def message() -> Optional[bytes]:
        head = source.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return None
        return source.read(_LENGTH.unpack(head)[0])

    import xgrammar as xgr

    info = message()
    if info is None:
        return
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.deserialize_json(info.decode()), max_threads=1, cache_enabled=False
    )
    _send(out, b"ready")
    while (grammar := message()) is not None:
        try:
            compiler.compile_grammar(xgr.Grammar.deserialize_json(grammar.decode()))
            _send(out, b"ok")
        except Exception as e:  # noqa: BLE001 - the parent reports it
            _send(out, f"error: {e}".encode())
