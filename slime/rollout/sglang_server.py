"""SGLang server processes and the HTTP client that talks to them.

Processes: each server starts in a session of its own, so the server and every process it spawns
(scheduler, detokenizer, resource tracker) are stopped together by one `killpg`. Every server this
process started is stopped by `shutdown`, at interpreter exit, on SIGTERM (what torchrun sends the
surviving ranks when one fails), and, when the launching process dies without cleaning up, by the
group's leader (group_leader.py), which kills the group, children still starting included. A server
listens on 127.0.0.1 unless the job spans nodes (then on the launching node's address, for ranks on
the other nodes).

Client: JSON over HTTP with the standard library (no extra dependency in the trainer's Python).
Every call is bounded: a timeout per attempt and a retry count. A refused or timed-out call first
asks whether the server is still alive (its process running, where this rank started it, and /health
answering); a dead or hung server is reported with the tail of its log.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import requests

from slime.config import SGLANG_HEALTH_TIMEOUT
from slime.utils.net import HOST, free_port  # noqa: F401  (free_port is part of this module's API)

logger = logging.getLogger(__name__)


_LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
                  "CROSS_SIZE", "LOCAL_SIZE"}


class SGLangServerError(RuntimeError):
    """A server died, did not start, or refused a request."""


def log_tail(path: str | Path | None, lines: int = 40) -> str:
    if not path or not Path(path).is_file():
        return "(no log available on this rank)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


_GROUP_LEADER = str(Path(__file__).with_name("group_leader.py"))


class SGLangServer:
    """One `python -m sglang.launch_server` process on `host`:`port`, logging to `log_path`."""

    def __init__(self, python: str, model_path: str, *, port: int, args: list[str], env: dict[str, str],
                 log_path: Path, host: str = HOST):
        self.host, self.port, self.log_path = host, port, Path(log_path)
        self.cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
                    "--port", str(port), *args]
        # The launcher's rendezvous variables would make SGLang's own process group join ours
        # (TORCHELASTIC_USE_AGENT_STORE sends its store lookup to torchrun's store, and hangs).
        inherited = {k: v for k, v in os.environ.items()
                     if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
        self.env = {**inherited, **{k: str(v) for k, v in env.items()}}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def check_installed(self) -> None:
        """SGLang importable by the server's Python, said before a server starts (else each server died on its
        import, reported in tracebacks with its log's tail)."""
        python = self.cmd[0]
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
        try:
            code = subprocess.run([python, "-c", probe], env=self.env, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=120).returncode
        except OSError as e:
            raise SGLangServerError(f"rollout.engine=sglang: cannot run the Python for the SGLang servers, {python} "
                                    f"({e.strerror}); set rollout.sglang.python (or SLIME_SGLANG_PYTHON) to a Python "
                                    "that has SGLang") from None
        if code:
            raise SGLangServerError(f"rollout.engine=sglang: {python} cannot import sglang. Install it (pip install -e "
                                    "\".[gpu]\" on a GPU machine; docs/sglang.md for CPU), point rollout.sglang.python "
                                    "(or SLIME_SGLANG_PYTHON) at a Python that has it, or use rollout.engine=hf")

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-I", _GROUP_LEADER, str(os.getpid()), *self.cmd],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        _LIVE.add(self)
        _install_cleanup()
        logger.info("started SGLang server pid %d on %s, log %s", self.proc.pid, self.url, self.log_path)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def death_report(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        return (f"SGLang server {self.url} exited with code {code}; last lines of {self.log_path}:\n"
                f"{log_tail(self.log_path)}")

    def wait_ready(self, timeout: float) -> None:
        """Poll /health until 200; raise with the log tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise SGLangServerError(self.death_report())
            if _health(self.url, timeout=5):
                return
            time.sleep(1.0)
        self.kill()
        raise SGLangServerError(f"SGLang server {self.url} not ready after {timeout:.0f}s "
                                f"(rollout.sglang.startup_timeout); last lines of {self.log_path}:\n"
                                f"{log_tail(self.log_path)}")

    def kill(self, grace: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL whatever is left after `grace` seconds."""
        _LIVE.discard(self)
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(pgid)):
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("SGLang server pid %d survived SIGKILL", self.proc.pid)


def _health(url: str, *, timeout: float) -> bool:
    return _health_error(url, timeout=timeout) is None


def _health_error(url: str, *, timeout: float) -> str | None:
    """None where `url` answers /health with 200, else what it did."""
    try:
        r = requests.get(url + "/health", timeout=timeout)
    except requests.RequestException as e:
        return type(e).__name__
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


def wait_for_url(url: str, timeout: float, name: str) -> None:
    """A server this job did not start (rollout.sglang.urls): poll /health until it answers, for at most
    `timeout` s (rollout.sglang.startup_timeout: it may still be loading), saying every 30 s what it answered.
    Without this, an address that never answers passed start-up and failed at the first weight push."""
    start = last_said = time.monotonic()
    while (error := _health_error(url, timeout=5)) is not None:
        waited = time.monotonic() - start
        if waited >= timeout:
            raise SGLangServerError(f"{name} = {url} did not answer /health within {timeout:.0f}s "
                                    f"(rollout.sglang.startup_timeout; last: {error}): check the address and "
                                    "that the server is up")
        if time.monotonic() - last_said >= 30:
            logger.info("waiting for %s = %s to answer /health (%.0fs of %.0fs; last: %s)", name, url, waited,
                        timeout, error)
            last_said = time.monotonic()
        time.sleep(1.0)


# The sizes that tell two models of one family apart (Qwen3-0.6B from Qwen3-4B): a push of the one into the other
# fails on a shape deep in the server, or, with fewer layers served, loads the layers both have without a word.
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "num_experts", "moe_intermediate_size")


def _sizes(model_dir: str) -> dict | None:
    """The size settings of the config.json in `model_dir` (a VL model's text_config's too), as the trainer reads
    them; none where there is no such file here (a hub id, a path on another machine), None where it is unreadable."""
    from slime.config import ModelConfig
    from slime.models.loading import text_config_value

    try:
        sizes = {k: text_config_value(ModelConfig(path=model_dir), k) for k in _SIZE_KEYS}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return {k: v for k, v in sizes.items() if v is not None}


def check_served_family(url: str, name: str, model_path: str, family: str) -> None:
    """A server given by url must serve the family the trainer trains, and the same size where its model's
    config.json can be read here: SGLang loads a push of another model's tensors, where their names match,
    without a word. What /model_info does not answer is not checked."""
    try:
        info = requests.get(url + "/model_info", timeout=30).json()
        served = info.get("model_type")
    except (requests.RequestException, ValueError, AttributeError):
        return
    fix = f"weight pushes would load into another model. Start that server with --model-path {model_path}"
    if served and served != family:
        raise SGLangServerError(f"{name} = {url} serves a {served!r} model ({info.get('model_path')}), but the "
                                f"trainer trains model.path={model_path} ({family!r}): {fix}")
    served_path = info.get("model_path")
    if not isinstance(served_path, str) or served_path == model_path or not Path(served_path).is_absolute():
        return  # relative: to the server's working directory, not known here
    theirs, ours = _sizes(served_path), _sizes(model_path)
    if theirs is None or ours is None:
        return
    differ = [f"{k} {theirs[k]} against {ours[k]}" for k in _SIZE_KEYS if k in theirs and k in ours
              and theirs[k] != ours[k]]
    if differ:
        raise SGLangServerError(f"{name} = {url} serves {served_path}, a model of another size than model.path="
                                f"{model_path} ({', '.join(differ)}): {fix}")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


_LIVE: set[SGLangServer] = set()
_cleanup_installed = False


def kill_all_servers() -> None:
    for server in list(_LIVE):
        server.kill(grace=5.0)


def _install_cleanup() -> None:
    global _cleanup_installed
    if _cleanup_installed:
        return
    _cleanup_installed = True
    atexit.register(kill_all_servers)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if callable(previous):
            # The trainer's graceful stop: its step still generates and pushes weights, so the servers stay up
            # until the process exits (atexit; a hard exit takes them down by their group leader).
            previous(signum, frame)
            return
        kill_all_servers()  # default action: die by the signal, as if no handler were installed
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


class SGLangClient:
    """Calls one server over a pooled HTTP session. `server` is set on the rank that launched it (to read
    its exit code). Failed requests are retried only while the server still answers /health."""

    def __init__(self, url: str, *, timeout: float, max_retries: int, server: SGLangServer | None = None,
                 log_path: str | None = None, pool_size: int = 64):
        self.url, self.timeout, self.max_retries = url.rstrip("/"), timeout, max_retries
        self.server, self.log_path = server, log_path or (str(server.log_path) if server else None)
        self.session = requests.Session()
        # One keep-alive connection per concurrent request thread instead of a new TCP connection per call.
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def post(self, path: str, body: dict | None = None, *, timeout: float | None = None,
             retries: int | None = None, before_retry: Callable[[dict], None] | None = None) -> Any:
        """`before_retry(body)` may change the body before each retry (a new request id)."""
        return self._call("POST", path, body or {}, timeout, retries, before_retry)

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        return self._call("GET", path, None, timeout, 0)

    def _call(self, method: str, path: str, body: dict | None, timeout: float | None, retries: int | None,
              before_retry: Callable[[dict], None] | None = None) -> Any:
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                r = self.session.request(method, self.url + path, json=body, timeout=timeout or self.timeout)
                if r.status_code < 400:
                    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
                detail = r.text[:2000]
                if r.status_code < 500:  # the server understood and refused: retrying cannot help
                    raise SGLangServerError(f"{self.url}{path} answered {r.status_code}: {detail}")
                error = f"HTTP {r.status_code}: {detail}"
            except requests.RequestException as e:  # refused, reset, timed out
                error = f"{type(e).__name__}: {e}"
                slow = isinstance(e, requests.exceptions.ReadTimeout)
            else:
                slow = False
            if not self.is_alive():
                raise SGLangServerError(self.death_report(f"{method} {path} failed ({error})")) from None
            if slow:  # a live server still at it: a retry would start the generation over, and time out again
                raise SGLangServerError(
                    f"{method} {self.url}{path} took longer than {timeout or self.timeout:g} s "
                    "(rollout.sglang.request_timeout) on a server that answers /health: raise it for generations "
                    f"that long (with train.dist_timeout_minutes on several ranks)\nlast lines of the server log:\n"
                    f"{log_tail(self.log_path)}")
            if attempt < retries:
                logger.warning("%s %s%s failed (%s); retry %d/%d", method, self.url, path, error, attempt + 1, retries)
                time.sleep(min(2.0 ** attempt, 10.0))
                if before_retry is not None:
                    before_retry(body)
        raise SGLangServerError(f"{method} {self.url}{path} failed after {retries + 1} attempt(s): {error}\n"
                                f"last lines of the server log:\n{log_tail(self.log_path)}")

    HEALTH_TIMEOUT = SGLANG_HEALTH_TIMEOUT

    def is_alive(self) -> bool:
        """Running (where this rank launched it) and answering /health: a stopped or hung server was retried
        for request_timeout per attempt."""
        if self.server is not None and not self.server.alive:
            return False
        return _health(self.url, timeout=self.HEALTH_TIMEOUT)

    def close(self) -> None:
        self.session.close()

    def death_report(self, what: str) -> str:
        if self.server is not None and not self.server.alive:
            return f"{what}: {self.server.death_report()}"
        if self.server is not None:
            return (f"{what}: SGLang server {self.url} is running but does not answer /health within "
                    f"{self.HEALTH_TIMEOUT:.0f}s (stopped, or hung); last lines of {self.log_path}:\n"
                    f"{log_tail(self.log_path)}")
        return (f"{what}: SGLang server {self.url} does not answer /health; last lines of its log:\n"
                f"{log_tail(self.log_path)}")
