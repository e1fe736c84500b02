"""Network helpers shared by the launcher set-up and the SGLang servers."""
from __future__ import annotations

import socket

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
