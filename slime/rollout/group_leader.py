"""Runs a command inside the caller's new process group and kills the whole group when the caller dies.

    python -I group_leader.py PARENT_PID CMD [ARG ...]

The SGLang server starts its scheduler and detokenizer as children, which ask the kernel for a signal when
their parent dies, but only once they run: a launcher killed in between (SIGKILL while the server starts)
left them running. This process leads the group (the caller starts it with start_new_session) and outlives
the server: when the caller dies, for any reason, it kills every process in the group, itself included.
A SIGTERM to the group reaches the server too; this process then waits for the server and ends as it did
(the same exit code, or death by the same signal). Standard library only: it runs isolated (-I) in the
trainer's Python, whatever the server's environment holds.
"""
import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def kill_group(*_) -> None:
    os.killpg(0, signal.SIGKILL)


def main() -> int:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    signal.signal(signal.SIGHUP, kill_group)  # installed before asking for it, so it cannot come too early
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    except OSError:
        pass  # not Linux: the caller's atexit and SIGTERM handler still stop the group
    if os.getppid() != parent:  # the caller died before the prctl above: no signal will come
        kill_group()
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM is for the server; a handler, not
    # SIG_IGN, so the server does not inherit it
    code = subprocess.Popen(cmd).wait()
    if code < 0:  # the server died by a signal: so does this process, for the caller to read the same status
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
