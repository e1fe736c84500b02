"""Stops asked for by signal: SIGTERM (a scheduler's preemption, `kill PID`) or SIGINT (Ctrl-C).

The first signal only sets a flag: the loop finishes the step it is in, every rank agrees to stop,
a checkpoint is saved and the run exits non-zero. A second signal exits at once, without saving.
"""
from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None

    @classmethod
    def install(cls) -> "StopRequest":
        stop = cls()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop._handle)
        return stop

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            logger.error("second signal (%s): exiting now without saving", name)
            os._exit(128 + signum)
        self.signum = signum
        logger.warning("%s received: finishing this step, then saving a checkpoint and stopping (send it again "
                       "to exit at once)", name)
