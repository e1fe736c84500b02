"""Shared fixtures: a tiny model and task written to a temp dir (no downloads), and a 2-rank launcher."""
from __future__ import annotations

import atexit
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from spawn_ranks import die_with_parent  # noqa: E402  (tests/, on sys.path under pytest)


def make_task(out_dir: Path, n_train: int = 400, n_eval: int = 50) -> Path:
    from data_tools.make_arithmetic import make_split

    train, evals = make_split(n_train=n_train, n_eval=n_eval, seed=0, min_digits=1, max_digits=2)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from data_tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory) -> Path:
    return make_task(tmp_path_factory.mktemp("data") / "arith")


def run_ranks(args: list[str], nproc: int = 2, timeout: int = 600, cwd: Path = REPO,
              env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Launch `args` (a script and its arguments) on `nproc` CPU ranks over gloo (the launch DeepSpeed's launcher
    makes, without torchrun's start-up): as forks of tests/fork_server.py's post-import process where the job's
    environment allows (see `forkable`), else as processes of tests/spawn_ranks.py. `env` adds variables to this
    process's environment. `check`: a failed job raises with its output (else the caller reads the returncode)."""
    env = job_env(os.environ, env)
    cmd = [sys.executable, str(REPO / "tests/spawn_ranks.py"), str(nproc), *args]
    spawn_for = import_time_changes(env) if FORK else ["SLIME_TEST_FORK=0"]
    _launches[", ".join(spawn_for) or "forked"] += 1
    if not spawn_for:
        proc = forked_job(cmd, nproc, args, env, cwd, timeout)
    else:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def job_env(base, extra: dict | None) -> dict:
    env = dict(base, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# The fork server (tests/fork_server.py): on unless SLIME_TEST_FORK=0. Its environment is this session's at its
# start (conftest's import), as run_ranks would pass it; a job may differ from it only in RUN_TIME_VARS and in
# SLIME_* variables that slime reads at run time. IMPORT_TIME_VARS: those slime reads when imported
# (tests/test_fork_server.py checks the list against slime's source).
FORK = os.environ.get("SLIME_TEST_FORK", "1") != "0" and sys.platform == "linux"
IMPORT_TIME_VARS = {"SLIME_ONEDNN_MIN_MACS", "SLIME_STUCK_AFTER_S"}
# The launcher's (each rank gets its own), pytest's, PYTHONPATH (the fork puts it on sys.path), and those that
# libraries set in this process when in-process tests use them, each read at run time: slime's world of one
# (RANK ... MASTER_PORT), inductor's cache folder and its loader's pointer (set again before each use), torch's
# CUDA check, wandb's service (the server does not import wandb).
RUN_TIME_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "PYTEST_CURRENT_TEST", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR",
                 "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "PYTORCH_NVML_BASED_CUDA_CHECK", "WANDB_SERVICE"}
SERVER_ENV = job_env(os.environ, None)
_server: dict = {}
_server_lock = threading.Lock()
_launches: collections.Counter = collections.Counter()  # "forked", or the variables a spawned job was spawned for


def pytest_terminal_summary(terminalreporter) -> None:
    if _launches:
        spawned = ", ".join(f"{n} for {why}" for why, n in _launches.items() if why != "forked")
        terminalreporter.write_line(f"run_ranks: {_launches['forked']} jobs forked from tests/fork_server.py; "
                                    f"spawned: {spawned or 'none'}")


def import_time_changes(env: dict) -> list[str]:
    """The variables in which `env` differs from the server's and that may have been read at its imports."""
    changed = {k for k in env.keys() | SERVER_ENV.keys() if env.get(k) != SERVER_ENV.get(k)}
    return sorted(k for k in changed
                  if k not in RUN_TIME_VARS and (not k.startswith("SLIME_") or k in IMPORT_TIME_VARS))


def forkable(env: dict) -> bool:
    return not import_time_changes(env)


def fork_server(start_timeout: float = 300) -> dict:
    """The running server, started (or started again, if it died) here; its output goes to a log file."""
    with _server_lock:
        if _server and _server["proc"].poll() is None:
            return _server
        if _server:  # it died: its folder goes with it
            shutil.rmtree(_server["dir"], ignore_errors=True)
        d = Path(tempfile.mkdtemp(prefix="slime-forksrv-"))
        with open(d / "server.log", "w") as log:
            proc = subprocess.Popen([sys.executable, str(REPO / "tests/fork_server.py"), str(d / "socket")], cwd=REPO,
                                    env=SERVER_ENV, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=die_with_parent)
        deadline = time.monotonic() + start_timeout
        while not (d / "socket").exists():  # it names the socket once it listens, after its imports
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log = (d / "server.log").read_text()[-4000:]
                shutil.rmtree(d, ignore_errors=True)
                raise RuntimeError(f"tests/fork_server.py was not ready within {start_timeout:g} s (exit code "
                                   f"{proc.returncode}); its output:\n{log}\n(SLIME_TEST_FORK=0 spawns every job)")
            time.sleep(0.05)
        if not _server:
            atexit.register(stop_fork_server)
        _server.update(proc=proc, dir=d)
        return _server


def stop_fork_server() -> None:
    _server["proc"].kill()
    _server["proc"].wait()
    shutil.rmtree(_server["dir"], ignore_errors=True)


def forked_job(cmd, nproc, args, env, cwd, timeout) -> subprocess.CompletedProcess:
    server = fork_server()
    d = Path(tempfile.mkdtemp(dir=server["dir"]))
    output = lambda name: (d / name).read_text(errors="replace") if (d / name).exists() else ""  # noqa: E731
    req = dict(nproc=nproc, args=[str(a) for a in args], env=env, cwd=str(cwd), stdout=str(d / "out"),
               stderr=str(d / "err"))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(server["dir"] / "socket"))
            s.settimeout(timeout)
            f = s.makefile("rw")
            f.write(json.dumps(req) + "\n")
            f.flush()
            pid = None
            try:
                pid = json.loads(f.readline())["pid"]
                code = json.loads(f.readline())["code"]
            except (TimeoutError, socket.timeout):
                if pid is not None:
                    os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout, output("out"), output("err")) from None
            except json.JSONDecodeError:  # the connection closed without an answer: the job or the server was killed
                raise RuntimeError(f"the fork server's job {pid} ended without an exit code (killed?); server log:\n"
                                   f"{(server['dir'] / 'server.log').read_text()[-4000:]}\njob stderr:\n"
                                   f"{output('err')[-4000:]}") from None
        return subprocess.CompletedProcess(cmd, code, (d / "out").read_text(), (d / "err").read_text())
    finally:
        shutil.rmtree(d, ignore_errors=True)


def stable_adam_ds_config(out_dir: Path) -> Path:
    """ds_configs/zero3.json with Adam eps 1e-3, for comparing parameters after one step across layouts.

    Adam's first step is g / (|g| + eps): with eps 1e-8, gradients that are zero in exact arithmetic (a key
    bias: softmax ignores a shift shared by all keys) turn float noise into full-size steps. A larger eps
    keeps the parameter comparison about the gradients (which the tests also compare directly)."""
    ds = json.loads((REPO / "ds_configs/zero3.json").read_text())
    ds["optimizer"]["params"]["eps"] = 1e-3
    path = out_dir / "ds_stable_adam.json"
    path.write_text(json.dumps(ds))
    return path


def assert_params_close(got: dict, want: dict, rel: float = 1e-6, floor: float = 1e-9) -> None:
    """Per tensor, `rel` relative in norm; biases that start at zero are ~1e-5 after one step, hence a floor."""
    assert sorted(got) == sorted(want)
    for name, p in want.items():
        err = (got[name] - p).norm().item()
        assert err <= rel * p.norm().item() + floor, (name, err, p.norm().item())
