"""DRAFT (wip/fork-server; the suite does not use it unless SLIME_TEST_FORK=1): the test suite's launches spend ~8 of
their ~13 s importing torch, transformers and DeepSpeed in each rank. This server imports them once, then runs each
job's ranks as forks of its clean post-import state (measured: a 1-step tiny job in 3.4 s instead of 12.9 s).

    python tests/fork_server.py SOCKET

Protocol: a client sends one JSON line {"nproc", "args", "env", "cwd", "stdout", "stderr"} (stdout/stderr: files the
job writes); the server forks a job process (the server itself never runs a job), answers {"pid": JOB} (the job
leads its own process group: the client kills it on its timeout), then {"code": CODE} when it ends. The job runs its
ranks as tests/spawn_ranks.py does (the first failure stops the others)."""
from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GRACE_S = 30


def run_rank(rank: int, req: dict, port: int) -> None:
    """In a forked rank: become `python ARGS` with the job's environment, then exit with its code."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(req["nproc"]),
                          LOCAL_WORLD_SIZE=str(req["nproc"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(req["cwd"])
        script = str(Path(req["args"][0]).resolve())
        sys.path[:0] = [os.path.dirname(script), *filter(None, req["env"].get("PYTHONPATH", "").split(os.pathsep))]
        sys.argv = [script, *req["args"][1:]]
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_job(req: dict) -> int:
    from slime.utils.net import reserved_port

    with reserved_port() as port:
        pids = []
        for rank in range(req["nproc"]):
            pid = os.fork()
            if pid == 0:
                run_rank(rank, req, port)
            pids.append(pid)
        codes: dict[int, int] = {}
        failed = None
        while len(codes) < len(pids) and failed is None:
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[rank] = os.waitstatus_to_exitcode(status)
                        if codes[rank] != 0:
                            failed = (rank, codes[rank])
            time.sleep(0.05)
    if failed is None:
        return 0
    rank, code = failed
    print(f"fork_server: rank {rank} exited with code {code}; stopping the others", file=sys.stderr, flush=True)
    deadline = time.monotonic() + GRACE_S
    for r, pid in enumerate(pids):
        if r not in codes:
            os.kill(pid, signal.SIGTERM)
    for r, pid in enumerate(pids):
        while r not in codes and time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
            time.sleep(0.05)
        if r not in codes:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return code if code > 0 else 1


def serve(path: str) -> None:
    from slime.utils.startup import long_lived_imports

    with long_lived_imports():
        import deepspeed  # noqa: F401
        from slime.trainer.loop import run  # noqa: F401
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rw") as f:
            req = json.loads(f.readline())
            job = os.fork()
            if job == 0:
                srv.close()
                os.setsid()
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    os.dup2(os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                code = 1
                try:
                    code = run_job(req)
                finally:
                    os._exit(code)
            f.write(json.dumps({"pid": job}) + "\n")
            f.flush()
            code = os.waitstatus_to_exitcode(os.waitpid(job, 0)[1])
            try:
                f.write(json.dumps({"code": code}) + "\n")
                f.flush()
            except OSError:
                pass


if __name__ == "__main__":
    serve(sys.argv[1])
