"""A slow HTTP client on a raw socket (slowloris), for the read-timeout tests."""

from __future__ import annotations

import socket
import time


def drip(port: int, head: bytes, trickle: bytes, limit_s: float, interval_s: float = 0.2) -> tuple[float, bytes]:
    """Open a connection to 127.0.0.1:``port``, send ``head``, then one byte of
    ``trickle`` (cycled) every ``interval_s`` until the server closes the
    connection or ``limit_s`` passes. Returns (seconds from the opening until
    the connection was closed, or ``limit_s``; everything the server sent)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(interval_s)
        t0 = time.monotonic()
        if head:
            s.sendall(head)
        received, i = b"", 0
        while time.monotonic() - t0 < limit_s:
            try:
                if trickle:
                    s.sendall(trickle[i % len(trickle) : i % len(trickle) + 1])
                    i += 1
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
        return time.monotonic() - t0, received
