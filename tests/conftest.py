"""Shared fixtures: a tiny model and task written to a temp dir (no downloads), and a 2-rank launcher."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


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
    """Launch `args` (a script and its arguments) on `nproc` CPU ranks over gloo (tests/spawn_ranks.py: the
    launch DeepSpeed's launcher makes, without torchrun's start-up); `env` adds variables to this process's
    environment. `check`: a failed job raises with its output (else the caller reads the returncode)."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(REPO / "tests/spawn_ranks.py"), str(nproc), *args]
    if os.environ.get("SLIME_TEST_FORK") == "1":  # DRAFT: tests/fork_server.py
        proc = forked_job(cmd, nproc, args, env, cwd, timeout)
    else:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


_server = {}


def forked_job(cmd, nproc, args, env, cwd, timeout) -> subprocess.CompletedProcess:
    """DRAFT: the job's ranks as forks of tests/fork_server.py's post-import state (started at the first job)."""
    import signal
    import socket
    import tempfile

    if not _server:
        d = Path(tempfile.mkdtemp(prefix="forksrv"))
        proc = subprocess.Popen([sys.executable, str(REPO / "tests/fork_server.py"), str(d / "s")],
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        while (line := proc.stdout.readline()) and line.strip() != "ready":  # DeepSpeed's import prints first
            pass
        assert line, "tests/fork_server.py ended before it was ready"
        _server.update(proc=proc, dir=d)
    d = Path(tempfile.mkdtemp(dir=_server["dir"]))
    req = dict(nproc=nproc, args=[str(a) for a in args], env=env, cwd=str(cwd), stdout=str(d / "out"),
               stderr=str(d / "err"))
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(_server["dir"] / "s"))
        s.settimeout(timeout)
        f = s.makefile("rw")
        f.write(json.dumps(req) + "\n")
        f.flush()
        pid = json.loads(f.readline())["pid"]
        try:
            code = json.loads(f.readline())["code"]
        except (TimeoutError, socket.timeout):
            os.killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(cmd, timeout)
    return subprocess.CompletedProcess(cmd, code, (d / "out").read_text(), (d / "err").read_text())


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
