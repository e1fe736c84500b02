"""Stops asked for by signal: SIGTERM (a scheduler's preemption, `kill PID`) or SIGINT (Ctrl-C).

The first signal only sets a flag: the loop finishes the step it is in, every rank agrees to stop,
a checkpoint is saved and the run exits non-zero. A second signal exits at once, without saving.

A rank that does not reach the end of its step within STUCK_AFTER_S (20, or $SLIME_STUCK_AFTER_S) of the first
signal is stuck (in a user function that does not return, say, while a launcher stops the job because another
rank failed): it prints where each of its threads is (faulthandler) and exits, rather than waiting for the
launcher's SIGKILL, which would leave no trace of where it hung.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)
# DeepSpeed's launcher and torchrun SIGKILL a rank 30 s after their SIGTERM; a scheduler with a shorter grace
# period wants it shorter
STUCK_AFTER_S = float(os.environ.get("SLIME_STUCK_AFTER_S", 20))


class Stopped(SystemExit):
    """The run's own exit on a stop signal (with the signal's exit code): at start-up at once, in the loop once the
    step's checkpoint is saved."""


def exit_on_interrupt() -> None:
    """Until StopRequest.install: Ctrl-C exits (130) without the KeyboardInterrupt traceback every rank printed
    from wherever its imports were, and SIGTERM with 143 (it killed the process: 241 from run.sh, no word)."""
    def handle(signum, frame):
        os.write(2, f"[rank{os.environ.get('RANK', '0')}] stopped by {signal.Signals(signum).name} during start-up "
                    f"(exit code {128 + signum})\n".encode())
        raise Stopped(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


class StopRequest:
    def __init__(self, stuck_after_s: float = STUCK_AFTER_S) -> None:
        self.signum: int | None = None
        self.stuck_after_s = stuck_after_s
        self.in_loop = False  # before the first step there is nothing to finish or save: a signal exits at once
        self.saved: str | None = None  # the checkpoint the stop saved (a second signal then loses nothing)

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
            if self.saved:  # a launcher passing on another rank's exit code, say
                logger.warning("second signal (%s): exiting now; the checkpoint %s is saved", name, self.saved)
            else:
                logger.error("second signal (%s): exiting now without saving", name)
            logging.shutdown()
            os._exit(128 + signum)
        self.signum = signum
        if not self.in_loop:  # start-up (models loading, servers starting): unwind, so cleanups run (servers)
            logger.warning("%s received during start-up: stopping", name)
            raise Stopped(128 + signum)
        logger.warning("%s received: finishing this step, then saving a checkpoint and stopping (send it again "
                       "to exit at once; if this rank has not finished its step within %g s, it prints the stack "
                       "of each of its threads and exits)", name, self.stuck_after_s)
        faulthandler.dump_traceback_later(self.stuck_after_s, exit=True)

    def step_ended(self) -> None:
        """Every rank reached the end of the step with the stop agreed: the checkpoint takes the time it needs."""
        faulthandler.cancel_dump_traceback_later()


def exit_with_launcher(pid: int | None = None, poll_s: float = 1.0) -> threading.Thread | None:
    """End this rank when `run.sh` (pid $SLIME_RUN_SH_PID) is gone: SIGKILL to its process group (a scheduler's
    hard kill, an OOM killer) leaves the launcher, in a group of its own, and the ranks under it training on as
    orphans, writing to the run dir and holding the port a rerun needs. A thread that looks once a second."""
    pid = pid or int(os.environ.get("SLIME_RUN_SH_PID") or 0)
    if not pid:
        return None

    def alive() -> bool:
        try:  # a killed run.sh stays a zombie until its parent reaps it: gone too
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        logger.error("run.sh (pid %d) is gone, killed without passing a signal on: exiting", pid)
        logging.shutdown()
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-with-run.sh", daemon=True)
    thread.start()
    return thread
