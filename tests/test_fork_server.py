"""tests/fork_server.py against tests/spawn_ranks.py, the reference: a forked job runs its script as `python SCRIPT`
would (argv, __name__, sys.path, environment, exit codes, uncaught exceptions, threads and atexit at the end), the
first failing rank stops the others, a timeout kills the job, a dead server is started again, and a job whose
environment sets a variable read at import is spawned."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conftest
from conftest import REPO, forkable, forked_job, job_env, run_ranks

SCRIPT = r'''
import atexit, json, os, pickle, sys, threading, time
import numpy
out = sys.argv[1]
rank = os.environ["RANK"]
what = sys.argv[2] if rank == os.environ.get("ACT_ON_RANK", rank) else os.environ.get("OTHERS", "ok")
unclosed = open(f"{out}/unclosed{rank}", "w")
unclosed.write("flushed at the end")  # by the interpreter's finalization


class Record:
    pass


def later():
    time.sleep(0.3)
    open(f"{out}/thread{rank}", "w").write("joined")


threading.Thread(target=later).start()  # non-daemon: the interpreter waits for it before atexit


def at_exit():  # __main__ is still the script's: its classes pickle
    open(f"{out}/atexit{rank}", "w").write(f"ran, pickled {type(pickle.loads(pickle.dumps(Record())))}")


atexit.register(at_exit)
json.dump(dict(name=__name__, argv=sys.argv[1:], cwd=os.getcwd(), path0=sys.path[0], file=__file__, pid=os.getpid(),
               numpy=numpy.random.rand(),
               env={k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "SLIME_TEST_X")}),
          open(f"{out}/rank{rank}.json", "w"))
if what == "raise":
    raise ValueError("boom")
if what == "exit_msg":
    sys.exit("a message for the user")
if what == "exit_3":
    sys.exit(3)
if what == "interrupt":
    raise KeyboardInterrupt
if what == "hang":
    time.sleep(600)
'''


def launch(mode: str, tmp_path: Path, what: str, env: dict | None = None, timeout: int = 120):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (tmp_path / "out").mkdir(exist_ok=True)
    args = [str(script), str(tmp_path / "out"), what]
    env = job_env(os.environ, env)
    cmd = [sys.executable, str(REPO / "tests/spawn_ranks.py"), "2", *args]
    if mode == "fork":
        return forked_job(cmd, 2, args, env, tmp_path, timeout)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode", ["spawn", "fork"])
def test_a_job_runs_its_script_as_python_would(mode, tmp_path):
    proc = launch(mode, tmp_path, "ok", env={"SLIME_TEST_X": "x"})
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    script = str(tmp_path / "script.py")
    for r, got in enumerate(ranks):
        assert got["name"] == "__main__" and got["argv"] == [str(out), "ok"] and got["file"] == script
        assert got["cwd"] == str(tmp_path) and got["path0"] == str(tmp_path)
        assert got["env"] == {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_PORT": ranks[0]["env"]["MASTER_PORT"],
                              "SLIME_TEST_X": "x"}
        assert (out / f"thread{r}").read_text() == "joined"
        assert (out / f"atexit{r}").read_text() == "ran, pickled <class '__main__.Record'>"
        assert (out / f"unclosed{r}").read_text() == "flushed at the end"
    assert ranks[0]["pid"] != ranks[1]["pid"] and ranks[0]["numpy"] != ranks[1]["numpy"]  # numpy seeded per process


@pytest.mark.parametrize("mode", ["spawn", "fork"])
@pytest.mark.parametrize("what, code, said", [
    ("raise", 1, "ValueError: boom"), ("exit_msg", 1, "a message for the user"), ("exit_3", 3, ""),
    ("interrupt", 1, "KeyboardInterrupt")])
def test_a_failing_rank_ends_the_job_with_its_code_and_output(mode, what, code, said, tmp_path):
    """Rank 1 fails; rank 0 hangs until the launcher stops it (SIGTERM). An uncaught KeyboardInterrupt kills its
    rank with SIGINT, as CPython does (exit code -2), which the launcher reports as 1. The rank that failed still
    joined its thread and ran its atexit callbacks."""
    proc = launch(mode, tmp_path, what, env={"ACT_ON_RANK": "1", "OTHERS": "hang"})
    assert proc.returncode == code, proc.stderr
    assert said in proc.stderr
    rank1_code = -2 if what == "interrupt" else code
    assert f"rank 1 exited with code {rank1_code}; stopping the others" in proc.stderr
    if what == "raise":
        assert "Traceback (most recent call last)" in proc.stderr
    out = tmp_path / "out"
    assert (out / "thread1").read_text() == "joined" and (out / "atexit1").read_text().startswith("ran")


def test_a_job_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        launch("fork", tmp_path, "hang", timeout=3)
    pids = [json.loads((tmp_path / f"out/rank{r}.json").read_text())["pid"] for r in range(2)]
    for pid in pids:
        for _ in range(200):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                break
            if state == "Z":
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"rank {pid} still runs")


def test_a_dead_server_is_started_again(tmp_path):
    server = conftest.fork_server()
    server["proc"].send_signal(signal.SIGKILL)
    server["proc"].wait()
    assert launch("fork", tmp_path, "ok").returncode == 0
    assert conftest.fork_server()["proc"].poll() is None


@pytest.mark.skipif(not conftest.FORK, reason="SLIME_TEST_FORK=0: run_ranks spawns every job")
def test_run_ranks_forks_the_jobs_it_can(tmp_path):
    """A forked rank starts with DeepSpeed imported (the server's); a spawned one without. Each prints what the
    server's imports printed, as a spawned rank prints it at its own, and draws its own torch seed."""
    script = tmp_path / "imported.py"
    script.write_text("import os, sys, torch\nopen(os.environ['SLIME_TEST_OUT'] + os.environ['RANK'], 'w')"
                      ".write(f\"{'deepspeed' in sys.modules} {torch.initial_seed()}\")\n")
    proc = run_ranks([str(script)], nproc=2, env={"SLIME_TEST_OUT": str(tmp_path / "got"), "SLIME_TEST_X": "1"})
    got = [(tmp_path / f"got{r}").read_text().split() for r in range(2)]
    assert got[0][0] == got[1][0] == "True" and got[0][1] != got[1][1]
    imports_said = (conftest.fork_server()["dir"] / "server.log").read_text().splitlines()
    assert all(proc.stdout.count(line) + proc.stderr.count(line) == 2 for line in imports_said), imports_said


def test_a_job_that_sets_a_variable_read_at_import_is_spawned(tmp_path):
    """The server imported slime.models.onednn with the session's SLIME_ONEDNN_MIN_MACS; a forked rank would
    keep that value. run_ranks spawns the job instead."""
    assert forkable(job_env(os.environ, {"SLIME_TEST_X": "1"}))
    assert not forkable(job_env(os.environ, {"SLIME_ONEDNN_MIN_MACS": "0"}))
    assert not forkable(job_env(os.environ, {"OMP_NUM_THREADS": "2"}))
    script = tmp_path / "print_min_macs.py"
    script.write_text("import os\nfrom slime.models import onednn\n"
                      "open(os.environ['SLIME_TEST_OUT'], 'w').write(str(onednn.MIN_MACS))\n")
    run_ranks([str(script)], nproc=1, env={"SLIME_ONEDNN_MIN_MACS": "7", "SLIME_TEST_OUT": str(tmp_path / "got")})
    assert (tmp_path / "got").read_text() == "7"


def env_reads_at_import(path: Path) -> set[str]:
    """Names of the environment variables a module reads outside its functions' bodies (os.environ.get, os.getenv,
    os.environ[...], `in os.environ`)."""
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for child in [*node.args.defaults, *node.args.kw_defaults, *getattr(node, "decorator_list", [])]:
                if child is not None:
                    visit(child)
            return
        key = None
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "environ.get"):
            key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) in ("os.environ", "environ")
                                                   for c in node.comparators):
            key = node.left
        if key is not None:
            found.add(key.value if isinstance(key, ast.Constant) else ast.unparse(key))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_the_import_time_variables_are_those_slime_reads_at_import():
    found = set().union(*(env_reads_at_import(p) for p in (REPO / "slime").rglob("*.py")))
    assert found == conftest.IMPORT_TIME_VARS
    assert env_reads_at_import(REPO / "run.py") <= conftest.IMPORT_TIME_VARS  # run.py's reads are in functions
