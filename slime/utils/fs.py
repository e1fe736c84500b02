"""File-system helpers for writes that must survive a crash."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Make a file's data, or a folder's entries (files created, renamed or removed in it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
