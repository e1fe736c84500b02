"""The test suite's fast launcher: a process that has imported torch, transformers, DeepSpeed and the trainer once
(~8 s of every rank's start on the CI machine, and the suite launches over a hundred jobs) and runs each job's ranks
as forks of that state, each `python SCRIPT ARGS` run as `__main__` (a 1-step tiny job: 3.4 s instead of 12.9 s).
tests/conftest.py's `run_ranks` starts it at the suite's first job, unless SLIME_TEST_FORK=0.

    python tests/fork_server.py SOCKET

Protocol: a client connects to SOCKET and sends one JSON line {"nproc", "args", "env", "cwd", "stdout", "stderr"}
(stdout/stderr: files the job writes). A job process forked for it answers {"pid": ITS_PID} (it leads its own
process group: the client kills the group at its timeout), starts the ranks and stops them as tests/spawn_ranks.py
does (the same `launch`), then answers {"code": EXIT_CODE}.

What a fork does not redo is what the process did before it: the imports. A variable that a library reads when it
is imported (OMP_NUM_THREADS, an HF_* or TORCH* setting, the SLIME_* knobs listed in conftest's IMPORT_TIME_VARS)
comes from the server's start, so the client forks only jobs whose environment differs from the server's in
variables read at run time, and spawns the others; what the imports printed, each rank prints first. A script that
sets a variable or patches a module before its own imports is not seen by modules the server imported already. A
forked rank ends as the interpreter would: it joins non-daemon threads, runs the atexit callbacks, clears and
collects its `__main__`, prints an uncaught exception through sys.excepthook, and dies of SIGINT after an uncaught
KeyboardInterrupt."""
from __future__ import annotations

import atexit
import builtins
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

from spawn_ranks import die_with_parent, launch, rank_env  # noqa: E402  (this folder; it puts the repo on sys.path)
from slime.utils.net import reserved_port  # noqa: E402


class ForkedRank:
    """A rank forked from the job process, with the part of subprocess.Popen that spawn_ranks.launch uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


IMPORT_OUTPUT = {1: b"", 2: b""}  # what the server's imports printed (DeepSpeed's accelerator line): each rank's too


def fork_rank(args: list[str], env: dict[str, str], close: int) -> ForkedRank:
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    code = 1
    try:
        die_with_parent()
        os.close(close)  # the job's connection to the client: a spawned rank has no such file either
        for fd, text in IMPORT_OUTPUT.items():
            os.write(fd, text)
        code = run_as_main(args, env)
    except BaseException:  # noqa: BLE001  (an excepthook that raised, ...): said, not lost
        traceback.print_exc()
    finally:
        os._exit(code & 0xFF)  # what the OS keeps of it (sys.exit(256) is 0 for a spawned rank too)


def run_as_main(args: list[str], env: dict[str, str]) -> int:
    """In a forked process: `python ARGS` with environment `env`, up to the interpreter's exit; returns its code.

    The script runs in a `__main__` module that stays in sys.modules through the end (threads and atexit callbacks
    may pickle its classes); at the end its namespace is cleared and collected, as the interpreter's finalization
    does (files it left open are flushed, __del__ runs). Not redone: the imports (see the module's docstring), and
    the string hash seed (one per server: `PYTHONHASHSEED` differs from a spawned rank's)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's handlers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    reseed()
    script = os.path.abspath(args[0])
    # an empty entry of PYTHONPATH is the working folder, as for the interpreter
    pythonpath = [p or os.getcwd() for p in env["PYTHONPATH"].split(os.pathsep)] if env.get("PYTHONPATH") else []
    sys.path[:0] = [os.path.dirname(os.path.realpath(script)), *pythonpath]
    sys.argv = [script, *args[1:]]
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    code, interrupted = 0, False
    try:
        with open(script, "rb") as f:
            source = f.read()
        exec(compile(source, script, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as e:
        code = exit_code(e)
    except BaseException as e:  # noqa: BLE001  (what the interpreter prints and exits 1 for)
        print_uncaught(e)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    try:
        threading._shutdown()  # what Py_FinalizeEx does first: wait for non-daemon threads, then atexit
    except BaseException as e:  # noqa: BLE001
        code = exit_code(e) if isinstance(e, SystemExit) else 1
    atexit._run_exitfuncs()
    main.__dict__.clear()
    gc.collect()  # the server's objects are frozen: this walks the script's
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as CPython does: die of the signal, so that the parent sees a SIGINT death
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def reseed() -> None:
    """A fresh process draws numpy's global and torch's default seeds from the OS (`random` is reseeded at fork by
    Python itself): two ranks, or two jobs, must not share them."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def print_uncaught(e: BaseException) -> None:
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # without run_as_main's own frame
    try:
        sys.excepthook(type(e), e, tb)
    except BaseException as hook_error:  # noqa: BLE001
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exception(hook_error)
        print("\nOriginal exception was:", file=sys.stderr)
        traceback.print_exception(type(e), e, tb)


def exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def run_job(conn: socket.socket) -> int:
    """In a job process: read the request, answer the pid, run the ranks, answer the exit code."""
    with conn, conn.makefile("rw") as f:
        req = json.loads(f.readline())
        os.chdir(req["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        f.write(json.dumps({"pid": os.getpid()}) + "\n")
        f.flush()
        nproc = req["nproc"]
        with reserved_port() as port:
            code = launch(nproc, lambda rank: fork_rank(
                req["args"], {**req["env"], **rank_env(rank, nproc, port)}, close=conn.fileno()))
        f.write(json.dumps({"code": code}) + "\n")
        f.flush()
    return code


def serve(path: str) -> None:
    from slime.utils.startup import long_lived_imports

    saved = {fd: os.dup(fd) for fd in IMPORT_OUTPUT}
    captured = {fd: tempfile.TemporaryFile() for fd in IMPORT_OUTPUT}
    for fd, f in captured.items():
        os.dup2(f.fileno(), fd)
    with long_lived_imports():
        import deepspeed  # noqa: F401
        from slime.trainer.loop import run  # noqa: F401
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, f in captured.items():
        os.dup2(saved[fd], fd)
        f.seek(0)
        IMPORT_OUTPUT[fd] = f.read()
        os.write(fd, IMPORT_OUTPUT[fd])
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path + ".tmp")
    srv.listen()
    os.rename(path + ".tmp", path)  # the client waits for this name: it connects only to a listening server
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # jobs are reaped by the kernel: the server never waits on one
    while True:
        conn, _ = srv.accept()
        if os.fork() == 0:
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the job waits on its ranks
                srv.close()
                os.setsid()
                die_with_parent()
                code = run_job(conn)
            finally:
                os._exit(code)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
