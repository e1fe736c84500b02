"""The sglang rollout engine.

Always run: the engine plan, the weight payload format, the HTTP client's error paths, and a server
that dies at start. With a real SGLang (SLIME_SGLANG_PYTHON, see docs/sglang.md) on a tiny model
saved here: generation matches the hf engine from the same ids; abort; weight pushes (colocated
tensor buckets and a gloo update group) from a 2-rank ZeRO-3 trainer make the server's greedy output
equal the trainer's, with the version advancing and sleep/wake in order; a killed server is reported
with its log; a 2-rank GRPO run on the engine; and no server process outlives the tests.
One server is shared by the module (started once) and the GRPO run starts one more.
"""
from __future__ import annotations

import base64
import concurrent.futures
import http.server
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_ranks
from slime.config import ModelConfig, SGLangConfig
from slime.rollout.engine import SamplingParams
from slime.rollout.sglang_engine import SGLangEngine, plan_engines, server_args
from slime.rollout.sglang_server import SGLangClient, SGLangServer, SGLangServerError, free_port
from slime.rollout.sglang_weights import FlatBucket, SharedBuffers, serialize_flat_bucket, split_by_dtype
from one_rank import OneRank

SGLANG_PYTHON = os.environ.get("SLIME_SGLANG_PYTHON", "")
needs_sglang = pytest.mark.skipif(
    not (SGLANG_PYTHON and Path(SGLANG_PYTHON).is_file()),
    reason="no SGLang environment: set SLIME_SGLANG_PYTHON to the python of a venv built with "
           "../shared/sglang-cpu/setup.sh (and SLIME_SGLANG_PYTHONPATH to its stubs/); see docs/sglang.md")
CPU_ARGS = ["--max-total-tokens", "4096", "--skip-server-warmup", "--random-seed", "0"]


def chat_ids(tokenizer, question: str) -> list[int]:
    """Prompt ids as the data path makes them: chat template as text, then tokenized."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def server_env(marker: str) -> dict:
    """`marker` is inherited by every process of the server, whatever it renames itself to."""
    env = {"SLIME_SGLANG_TEST": marker, **({"SGLANG_USE_CPU_ENGINE": "1"} if not torch.cuda.is_available() else {})}
    if os.environ.get("SLIME_SGLANG_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["SLIME_SGLANG_PYTHONPATH"]
    return env


def group_processes(pgid: int) -> list[int]:
    """Live pids of process group `pgid` (a launched server's: start_new_session). SGLang's scheduler and
    detokenizer rename themselves (setproctitle), which overwrites the environment that server_processes reads."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def launched_by(pid: int) -> int:
    """The process that group leader `pid` (slime/rollout/group_leader.py) runs: the server itself."""
    return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])


def server_processes(marker: str) -> list[int]:
    """Live pids started with SLIME_SGLANG_TEST=`marker` in their environment."""
    pids, needle = [], f"SLIME_SGLANG_TEST={marker}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


# -- without SGLang ---------------------------------------------------------------------------------

def test_plan_engines_colocated_and_disaggregated():
    plan = plan_engines(SGLangConfig(tp_size=2), world_size=4)
    assert plan.engine_of_rank == (0, 0, 1, 1) and plan.owner_of_engine == (0, 2)
    assert plan.ranks_of_engine == ((0, 1), (2, 3))
    plan = plan_engines(SGLangConfig(ranks_per_engine=2), world_size=2)
    assert plan.num_engines == 1 and plan.owner_of_engine == (0,)
    plan = plan_engines(SGLangConfig(mode="disaggregated", num_engines=2), world_size=4)
    assert plan.engine_of_rank == (0, 1, 0, 1) and plan.owner_of_engine == (0, 0)
    assert plan.imbalance() is None and plan_engines(SGLangConfig(tp_size=2), world_size=4).imbalance() is None
    uneven = plan_engines(SGLangConfig(mode="disaggregated", num_engines=2), world_size=3).imbalance()
    assert "engines [0] take 2 ranks' prompts, the others 1" in uneven and "divides the world size" in uneven
    with pytest.raises(ValueError, match=r"4 SGLang engines but 2 trainer rank\(s\).*engines 2..3 would generate"):
        plan_engines(SGLangConfig(mode="disaggregated", num_engines=4), world_size=2)
    with pytest.raises(ValueError, match="must divide the world size"):
        plan_engines(SGLangConfig(tp_size=2), world_size=3)
    with pytest.raises(ValueError, match="needs 2"):
        plan_engines(SGLangConfig(urls=["http://127.0.0.1:1"]), world_size=2)
    with pytest.raises(ValueError, match="multiple of tp_size"):
        SGLangConfig(tp_size=2, ranks_per_engine=3)


def test_server_args_cpu_path_and_extra_args_last():
    args = server_args(SGLangConfig(extra_args=["--max-total-tokens", 64], mem_fraction=0.5), dtype=torch.bfloat16,
                       gpu_id=None, colocated=True)
    assert args[args.index("--device") + 1] == "cpu" and args[args.index("--dtype") + 1] == "bfloat16"
    assert "--enable-memory-saver" not in args  # needs CUDA
    assert "--sleep-on-idle" in args  # an idle scheduler would spin a core the trainer needs
    assert args[-2:] == ["--max-total-tokens", "64"] and args[args.index("--mem-fraction-static") + 1] == "0.5"
    gpu = server_args(SGLangConfig(), dtype=torch.bfloat16, gpu_id=3, colocated=True)
    assert gpu[gpu.index("--base-gpu-id") + 1] == "3" and "--enable-memory-saver" in gpu and "--device" not in gpu


def test_flat_bucket_payload_rebuilds_every_tensor():
    """What the server unpickles: a uint8 tensor plus slice records that rebuild each tensor exactly."""
    g = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(3, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).bfloat16()),
             ("c.weight", torch.randn(2, 2, 2, generator=g))]
    flats = split_by_dtype(named)
    assert [f.dtype for f in flats] == [torch.float32, torch.bfloat16] and [len(f.names) for f in flats] == [2, 1]
    rebuilt = {}
    for flat in flats:
        obj = pickle.loads(base64.b64decode(serialize_flat_bucket(flat)))  # as the server does, minus its allowlist
        for m in obj["metadata"]:
            rebuilt[m.name] = obj["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
    assert set(rebuilt) == {n for n, _ in named}
    for name, t in named:
        assert rebuilt[name].dtype == t.dtype and torch.equal(rebuilt[name], t), name
    assert FlatBucket(named[:1]).nbytes == 15 * 4


def test_kept_shared_buffers_carry_each_bucket_to_another_process():
    """CPU colocated pushes refill one shared-memory buffer per dtype: each bucket lands in the same memory (a
    larger one grows it), and a separate process (as the server) unpickling the payload reads that bucket."""
    reader = ("import base64, pickle, sys, torch, torch.multiprocessing\n"
              "obj = pickle.loads(base64.b64decode(sys.stdin.read()))\n"
              "print(obj['flattened_tensor'].numel(), [obj['flattened_tensor'][m.start_idx:m.end_idx].view(m.dtype)"
              ".reshape(m.shape).tolist() for m in obj['metadata']])")

    def served(flat: FlatBucket) -> list:  # what the server loads, read before the next bucket is laid in
        size, values = subprocess.run([sys.executable, "-c", reader], input=serialize_flat_bucket(flat), text=True,
                                      capture_output=True, check=True).stdout.split(" ", 1)
        assert int(size) == flat.nbytes
        return json.loads(values)

    g = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(3, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).bfloat16())]
    buffers = SharedBuffers()
    first = split_by_dtype(named, buffers)
    assert torch.tensor(served(first[0])[0]).equal(named[0][1])
    second = split_by_dtype([(n, t * 2 + 1) for n, t in named], buffers)
    assert [f.flat.data_ptr() for f in second] == [f.flat.data_ptr() for f in first]
    assert all(f.flat.is_shared() for f in second) and buffers.nbytes == 15 * 4 + 7 * 2
    assert torch.tensor(served(second[0])[0]).equal(named[0][1] * 2 + 1)
    smaller = split_by_dtype([("c.weight", -torch.ones(2, 2))], buffers)[0]
    assert smaller.flat.data_ptr() == first[0].flat.data_ptr() and smaller.nbytes == 4 * 4
    assert torch.tensor(served(smaller)[0]).equal(-torch.ones(2, 2))
    larger = split_by_dtype([("d.weight", torch.ones(4, 5))], buffers)[0]  # beyond the buffer: a new, larger one
    assert larger.flat.data_ptr() != first[0].flat.data_ptr() and buffers.nbytes == 20 * 4 + 7 * 2
    assert torch.tensor(served(larger)[0]).equal(torch.ones(4, 5))


class _Flaky(http.server.BaseHTTPRequestHandler):
    failures = 2

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        code, body = (503, b"busy") if _Flaky.failures > 0 else (200, b'{"ok": true}')
        _Flaky.failures -= 1
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if code == 200 else "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # /health
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_client_retries_while_alive_and_reports_a_dead_server(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert SGLangClient(url, timeout=5, max_retries=2).post("/x", {}) == {"ok": True}
        _Flaky.failures = 5
        with pytest.raises(SGLangServerError, match="after 2 attempt"):
            SGLangClient(url, timeout=5, max_retries=1).post("/x", {})
    finally:
        httpd.shutdown()
    log = tmp_path / "dead.log"
    log.write_text("line 1\nCUDA out of memory (the last words)\n")
    with pytest.raises(SGLangServerError, match="(?s)does not answer /health.*the last words"):
        SGLangClient(f"http://127.0.0.1:{free_port()}", timeout=5, max_retries=3, log_path=str(log)).post("/generate")


def test_a_request_that_outlives_its_timeout_on_a_live_server_names_the_setting():
    """A generation longer than request_timeout on a server that answers /health: each attempt started it over and
    timed out again (max_retries + 1 times request_timeout, past the other ranks' collective timeout), and the
    message named only ReadTimeout. Not retried now, and the setting is named."""
    posts = []
    class Slow(_Flaky):
        def do_POST(self):
            posts.append(self.path)
            time.sleep(1.5)  # past the client's timeout: what it would answer does not matter
            self.send_response(200)
            self.end_headers()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = SGLangClient(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=0.5, max_retries=1)
        with pytest.raises(SGLangServerError, match=r"POST http://127.0.0.1:\d+/generate took longer than 0.5 s "
                                                    r"\(rollout.sglang.request_timeout\) on a server that answers "
                                                    r"/health: raise it"):
            client.post("/generate", {})
    finally:
        httpd.shutdown()
    assert posts == ["/generate"]


def test_a_launched_server_that_stopped_answering_is_reported_at_once(tmp_path):
    """A server of ours whose process runs but does not answer (SIGSTOP, a hang): each request waited
    request_timeout and was retried while the process ran (218 s at request_timeout=15). /health decides."""
    port = free_port()
    server = SGLangServer(sys.executable, "m", port=port, args=[], env={}, log_path=tmp_path / "s.log")
    server.cmd = [sys.executable, "-c", f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); "
                  "s.listen(); print('listening', flush=True); time.sleep(600)"]  # connects, never answers
    server.start()
    try:
        while "listening\n" not in server.log_path.read_text():
            assert server.alive
            time.sleep(0.1)
        client = SGLangClient(server.url, timeout=1, max_retries=3, server=server)
        client.HEALTH_TIMEOUT = 1
        with pytest.raises(SGLangServerError, match=r"(?s)POST /generate failed \(ReadTimeout.*is running but does "
                                                    r"not answer /health within 1s \(stopped, or hung\).*listening"):
            client.post("/generate")
    finally:
        server.kill(grace=1)


class _Loading(http.server.BaseHTTPRequestHandler):
    """A server still loading its model: /health answers 503 twice, then 200."""
    polls = 0

    def do_GET(self):
        _Loading.polls += 1
        self.send_response(200 if self.path == "/health" and _Loading.polls > 2 else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_servers_given_by_url_are_waited_for_and_an_address_that_never_answers_is_an_error(tmp_path):
    """rollout.sglang.urls: a server still loading is waited for (rollout.sglang.startup_timeout); an address
    that accepts connections but never answers passed start-up and failed at the first weight push."""
    import types

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Loading)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    tokenizer = types.SimpleNamespace(eos_token_id=0)
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        engine = SGLangEngine(SGLangConfig(urls=[url], startup_timeout=60), None, tokenizer, OneRank())
        assert _Loading.polls >= 3 and engine.client.url == url
        engine.shutdown()
        hung = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(SGLangServerError, match=rf"rank 0: rollout.sglang.urls\[0\] = {hung} did not answer "
                                                    r"/health within 1s \(rollout.sglang.startup_timeout; last: "
                                                    r"ReadTimeout\): check the address"):
            SGLangEngine(SGLangConfig(urls=[hung], startup_timeout=1), None, tokenizer, OneRank())
    finally:
        httpd.shutdown()
        silent.close()


def test_a_server_given_by_url_that_serves_another_size_of_the_family_is_refused(tmp_path):
    """Two sizes of one family passed the family check: where the served model's config.json can be read here,
    its sizes must be the trained model's (a VL model's text_config's too); a hub id or a path on another machine
    is not checked, nor a server of the trainer's own path."""
    from slime.rollout.sglang_server import check_served_family

    def model(name, **sizes):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "qwen3", **sizes}))
        return str(tmp_path / name)

    small = model("small", hidden_size=1024, num_hidden_layers=28, vocab_size=151936)
    large = model("large", hidden_size=2560, num_hidden_layers=36, vocab_size=151936)
    same = model("copy", hidden_size=1024, num_hidden_layers=28, vocab_size=151936)
    vl = model("vl", text_config={"hidden_size": 1024, "num_hidden_layers": 24}, vocab_size=151936)
    served = {"path": small}

    class ModelInfo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"model_type": "qwen3", "model_path": served["path"]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ModelInfo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(SGLangServerError, match=rf"rollout.sglang.urls\[0\] = {url} serves {small}, a model of "
                                                    r"another size than model.path=.*large \(hidden_size 1024 "
                                                    r"against 2560, num_hidden_layers 28 against 36\).*--model-path"):
            check_served_family(url, "rollout.sglang.urls[0]", large, "qwen3")
        with pytest.raises(SGLangServerError, match=r"num_hidden_layers 28 against 24"):
            check_served_family(url, "rollout.sglang.urls[0]", vl, "qwen3")
        for trained in (small, same):  # its own path, another copy of the same model
            check_served_family(url, "rollout.sglang.urls[0]", trained, "qwen3")
        served["path"] = "Qwen/Qwen3-0.6B"  # a hub id: nothing here to read
        check_served_family(url, "rollout.sglang.urls[0]", large, "qwen3")
    finally:
        httpd.shutdown()


def test_a_colocated_engine_on_another_machine_is_warned_naming_the_mode(caplog):
    """Colocated weight pushes go by shared memory (CUDA IPC on GPUs), which a server on another host cannot
    open: a url that is no address of this machine (192.0.2.1 is one for documentation) is warned at start, not
    found at the first push (a warning: a container's bridge address may still be this machine)."""
    import types

    from slime.utils.net import is_this_machine

    assert is_this_machine("127.0.0.1") and is_this_machine("localhost") and not is_this_machine("192.0.2.1")
    tokenizer = types.SimpleNamespace(eos_token_id=0)
    with caplog.at_level("WARNING", logger="slime.rollout.sglang_engine"), \
            pytest.raises(SGLangServerError, match=r"urls\[0\] = http://192.0.2.1:30000 did not answer"):
        SGLangEngine(SGLangConfig(urls=["http://192.0.2.1:30000"], startup_timeout=1), None, tokenizer, OneRank())
    assert "http://192.0.2.1:30000, this rank's engine, is not an address of this machine" in caplog.text
    assert "rollout.sglang.mode=disaggregated" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="slime.rollout.sglang_engine"), pytest.raises(SGLangServerError):
        SGLangEngine(SGLangConfig(urls=["http://192.0.2.1:30000"], mode="disaggregated", startup_timeout=1), None,
                     tokenizer, OneRank())
    assert "not an address of this machine" not in caplog.text


def test_a_python_without_sglang_is_named_before_any_server_starts(tmp_path):
    """rollout.engine=sglang where SGLang is not installed: each server died on its import, and the cause came
    four times inside tracebacks, with no word of what to install or set."""
    without = tmp_path / "python"
    without.write_text("#!/bin/sh\nexit 1\n")  # find_spec('sglang') is None
    without.chmod(0o755)
    server = SGLangServer(str(without), "m", port=free_port(), args=[], env={}, log_path=tmp_path / "s.log")
    with pytest.raises(SGLangServerError, match=r"python cannot import sglang\. Install it .*rollout.sglang.python"):
        server.check_installed()
    server = SGLangServer(str(tmp_path / "nope"), "m", port=free_port(), args=[], env={}, log_path=tmp_path / "s.log")
    with pytest.raises(SGLangServerError, match=r"cannot run the Python for the SGLang servers, .*nope"):
        server.check_installed()
    (tmp_path / "sglang").mkdir()  # a package of that name on the server's PYTHONPATH: found
    (tmp_path / "sglang" / "__init__.py").write_text("")
    SGLangServer(sys.executable, "m", port=free_port(), args=[], env={"PYTHONPATH": str(tmp_path)},
                 log_path=tmp_path / "s.log").check_installed()


def test_server_that_exits_at_start_is_reported_with_its_log(tmp_path):
    """A stand-in for the server's python that fails at start: the error carries its exit code and last words."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"loading $4\"\n"
                      "echo 'RuntimeError: not enough memory for the KV cache' >&2\nexit 3\n")
    python.chmod(0o755)
    server = SGLangServer(str(python), str(tmp_path / "model"), port=free_port(), args=[], env={},
                          log_path=tmp_path / "server.log")
    server.start()
    with pytest.raises(SGLangServerError, match="(?s)exited with code 3.*loading .*model.*not enough memory"):
        server.wait_ready(timeout=60)
    server.kill()
    assert not server.alive


def test_a_trainer_killed_hard_takes_the_whole_server_with_it(tmp_path):
    """SIGKILL of the trainer while a server starts: SGLang's scheduler and detokenizer ask for a parent-death
    signal only once they run, so those started just before were left running. The server's group leader kills
    the group. The stand-in server starts a child that never asks for that signal."""
    log = tmp_path / "server.log"
    script = tmp_path / "trainer.py"
    script.write_text(f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from slime.rollout.sglang_server import SGLangServer
server = SGLangServer(sys.executable, "m", port=1, args=[], env={{}}, log_path=Path({str(log)!r}))
server.cmd = [sys.executable, "-c", "import subprocess, sys, time; child = subprocess.Popen(['sleep', '600']); "
              "print('pid of child:', child.pid, flush=True); time.sleep(600)"]
server.start()
print(server.proc.pid, flush=True)
time.sleep(600)
""")
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    leader = int(trainer.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while "pid of child: " not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(log.read_text().split("pid of child: ")[1].split()[0])
        assert child in group_processes(leader)
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 30
        while group_processes(leader) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_processes(leader)
    finally:
        trainer.kill()
        try:
            os.killpg(leader, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_group_leader_ends_as_the_server_did(tmp_path):
    """The server's exit code, or its death by a signal, is what the trainer reads (and reports)."""
    for body, code in (("sys.exit(3)", 3), ("os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL)):
        server = SGLangServer(sys.executable, "m", port=1, args=[], env={}, log_path=tmp_path / "s.log")
        server.cmd = [sys.executable, "-c", f"import os, signal, sys; {body}"]
        server.start()
        assert server.proc.wait(timeout=60) == code
        server.kill()
        assert f"exited with code {code}" in server.death_report()


# -- against a real SGLang server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    if not (SGLANG_PYTHON and Path(SGLANG_PYTHON).is_file()):
        pytest.skip("no SGLang environment (SLIME_SGLANG_PYTHON)")
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    srv = SGLangServer(SGLANG_PYTHON, str(tiny_model), port=free_port(), env=server_env("module"), log_path=log,
                       args=server_args(SGLangConfig(extra_args=CPU_ARGS[:-2]), dtype=torch.float32, gpu_id=None,
                                        colocated=True, seed=4321))  # the seed from server_args, not CPU_ARGS
    srv.start()
    try:
        srv.wait_ready(timeout=900)
        yield srv
    finally:
        srv.kill()
    assert not server_processes("module") and not group_processes(srv.proc.pid), \
        "an SGLang server process outlived the tests"


@pytest.fixture(scope="module")
def engines(server, tiny_model):
    from slime.models.loading import load_tokenizer
    from slime.rollout.hf_engine import HFEngine

    model_cfg = ModelConfig(path=str(tiny_model), dtype="float32")
    tokenizer = load_tokenizer(model_cfg)
    ours = SGLangEngine(SGLangConfig(urls=[server.url], max_concurrency=8), model_cfg, tokenizer, OneRank())
    ours.clients[0].server = server  # as on the launching rank: liveness from the process itself
    prompts = [chat_ids(tokenizer, q)
               for q in ("1+1=", "name a colour", "7*8", "abc")]
    yield ours, HFEngine(model_cfg, tokenizer, device=torch.device("cpu")), prompts
    ours.shutdown()


@needs_sglang
def test_the_server_runs_with_the_seed_it_was_given(server):
    assert SGLangClient(server.url, timeout=30, max_retries=0).get("/server_info")["random_seed"] == 4321


@needs_sglang
def test_a_server_given_by_url_that_serves_another_family_is_refused(server, engines, tiny_model, tmp_path):
    """SGLang loads pushed tensors whose names match, from whatever model: a server of another family trained
    nothing. (The `engines` fixture is the same check passing: the server's own model.)"""
    import transformers

    transformers.LlamaConfig().save_pretrained(tmp_path / "llama")
    eos = engines[0].eos_id
    with pytest.raises(SGLangServerError, match=rf"rollout.sglang.urls\[0\] = {server.url} serves a '\w+' model "
                                                rf"\({tiny_model}\), but the trainer trains model.path=.*llama "
                                                r"\('llama'\).*--model-path"):
        SGLangEngine(SGLangConfig(urls=[server.url]), ModelConfig(path=str(tmp_path / "llama")),
                     types.SimpleNamespace(eos_token_id=eos), OneRank())


@needs_sglang
def test_greedy_generation_matches_hf_engine_from_the_same_ids(engines):
    ours, hf, prompts = engines
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    got, want = ours.generate(prompts, params), hf.generate(prompts, params)
    for g, w in zip(got, want):
        assert g[0].response_ids == w[0].response_ids
        assert g[0].finish_reason == w[0].finish_reason
        assert max(abs(a - b) for a, b in zip(g[0].logprobs, w[0].logprobs)) < 1e-3
    assert ours.metrics()["sglang/gen_tokens_per_s"] > 0


@needs_sglang
def test_the_real_server_ends_a_response_2_positions_short_of_the_context(engines, tiny_model):
    """What the engine's check of a cut response tolerates: at prompt + max_new_tokens = the model's context,
    SGLang's scheduler caps max_new_tokens at context - 1 - prompt - 1. Such a response is at its limit (finish
    reason length), not cut by the server's KV pool, which is an error (the fake server's test above)."""
    ours, _, prompts = engines
    context = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    fits = SamplingParams(max_new_tokens=context - len(prompts[0]) - 8, temperature=0.0, ignore_eos=True)
    assert len(ours.generate(prompts[:1], fits)[0][0].response_ids) == fits.max_new_tokens
    full = SamplingParams(max_new_tokens=context - len(prompts[0]), temperature=0.0, ignore_eos=True)
    gen = ours.generate(prompts[:1], full)[0][0]
    assert (len(prompts[0]) + len(gen.response_ids), gen.finish_reason) == (context - 2, "length")


@needs_sglang
def test_sampled_logprobs_are_those_of_the_temperature_scaled_policy(engines):
    """Teacher-force the sampled tokens through the HF model: log_softmax(logits / T) must agree."""
    ours, hf, prompts = engines
    params = SamplingParams(max_new_tokens=12, temperature=0.7, n=3)
    out = ours.generate(prompts[:2], params)
    assert [len(g) for g in out] == [3, 3]
    for prompt, gens in zip(prompts, out):
        for gen in gens:
            assert 1 <= len(gen.response_ids) <= 12 and len(gen.logprobs) == len(gen.response_ids)
            ids = torch.tensor([prompt + gen.response_ids])
            with torch.no_grad():
                logits = hf.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            want = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=2e-3, rtol=0)


@needs_sglang
def test_a_sampled_evaluation_on_the_real_server_scores_each_prompts_own_answers(engines, tiny_model):
    """eval.n_samples_per_prompt answers per prompt from SGLang (n in one request): eval/pass@k and the accuracy
    equal those computed here from the very answers the server returned, grouped by their prompts."""
    from slime.config import load_config
    from slime.data.prompts import Prompt
    from slime.models.loading import load_tokenizer
    from slime.rollout.rewards import make_reward_fn
    from slime.trainer.evaluate import EvalSet, evaluate, pass_at_k_sums

    ours, _, prompts = engines
    returned = []

    class Recorded:  # the real engine; its answers kept as they come back
        def __getattr__(self, name):
            return getattr(ours, name)

        def generate(self, ids, params, **kw):
            out = ours.generate(ids, params, **kw)
            returned.extend(zip(ids, out))
            return out

    tokenizer = load_tokenizer(ModelConfig(path=str(tiny_model)))
    cfg = load_config(None, ["model.path=m", "data.path=d.jsonl", "eval.path=e.jsonl", "eval.n_samples_per_prompt=4",
                             "eval.temperature=1.0", "rollout.max_response_len=8", "eval.accuracy_threshold=0.1"])
    evalset = EvalSet([Prompt(prompt_ids=ids, prompt_text="", label=None, metadata={}, index=i, source=f"e:{i + 1}")
                       for i, ids in enumerate(prompts)], {})
    out = evaluate(Recorded(), evalset, cfg, tokenizer, make_reward_fn("e2e_rewards:digit_fraction"), OneRank())
    assert [ids for ids, _ in returned] == prompts and all(len(gens) == 4 for _, gens in returned)
    texts = [[tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in gens] for _, gens in returned]
    assert any(len(set(t)) > 1 for t in texts), texts  # sampled answers, not four greedy copies
    correct = [[sum(c.isdigit() for c in t) / max(len(t), 1) >= 0.1 for t in group] for group in texts]
    assert out["eval/num_samples"] == 16
    assert out["eval/accuracy"] == pytest.approx(sum(map(sum, correct)) / 16)
    for k, (total, count) in zip([1, 2, 4], pass_at_k_sums(correct, [1, 2, 4])):
        assert out[f"eval/pass@{k}"] == pytest.approx(total / count)


@needs_sglang
@pytest.mark.parametrize("fn", ["two_turns", "two_turns_async"])
def test_multi_turn_generate_fn_on_sglang(engines, fn, tiny_model):
    """A generate function on the SGLang engine (one thread per prompt for the sync one): observation ids
    are appended as given, and every generated token's logprob is the HF model's given all before it."""
    from custom_rollouts import OBSERVATION
    from slime.data.prompts import Prompt
    from slime.models.loading import load_tokenizer
    from slime.rollout.rewards import make_reward_fn
    from slime.rollout.rollout import generate_rollout

    from slime.models.loading import load_tokenizer

    ours, hf, prompts = engines
    tokenizer = load_tokenizer(ModelConfig(path=str(tiny_model)))
    rows = [Prompt(prompt_ids=p, prompt_text=tokenizer.decode(p), label=None, metadata={}, index=i)
            for i, p in enumerate(prompts)]
    samples = generate_rollout(ours, rows, SamplingParams(max_new_tokens=12, temperature=1.0, n=2), tokenizer,
                               make_reward_fn("e2e_rewards:digit_fraction"), first_group_id=0,
                               generate_fn=f"custom_rollouts:{fn}")
    obs = tokenizer(OBSERVATION, add_special_tokens=False).input_ids
    assert len(samples) == 8
    for s in samples:
        first = s.response_mask.index(0)
        assert s.response_ids[first:first + len(obs)] == obs and s.metadata["turns"] == 2
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = hf.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids):, None]).squeeze(-1)
        gen = torch.tensor(s.response_mask) == 1
        torch.testing.assert_close(s.rollout_logprobs[gen], want[gen], atol=2e-3, rtol=0)


@needs_sglang
def test_abort_returns_partial_generations(engines):
    """Responses cannot end before max_new_tokens (ignore_eos) and 8 x 480 decode steps take seconds
    here, so an abort sent once requests are in flight always finds work to cut short; a slower
    machine only widens that margin."""
    ours, _, prompts = engines
    limit = 480  # the tiny model's context is 512 tokens
    params = SamplingParams(max_new_tokens=limit, temperature=1.0, n=2, ignore_eos=True)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", ours.generate(prompts, params)))
    worker.start()
    deadline = time.monotonic() + 60
    while not any(call.inflight for call in list(ours._calls)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ours.abort()  # perhaps before the requests reach the server: those are aborted again once there
    worker.join(timeout=300)
    assert not worker.is_alive()
    gens = [g for group in result["out"] for g in group]
    assert len(gens) == 8 and any(g.finish_reason == "abort" for g in gens)
    assert all(len(g.response_ids) < limit for g in gens if g.finish_reason == "abort")
    assert all(len(g.response_ids) == limit for g in gens if g.finish_reason != "abort")  # ignore_eos held
    assert ours.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0))[0][0].finish_reason != "abort"


@needs_sglang
def test_an_idle_server_does_not_spin_a_core(engines, server):
    """Between requests (all of a colocated trainer's step) the server's processes sleep: SGLang's scheduler
    busy-polls without --sleep-on-idle, which takes a whole core of the trainer's machine (a core per engine
    on a GPU node). CPU time over 3 idle seconds: ~3 s spinning, a few ms asleep."""
    ours, _, prompts = engines
    ours.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0))  # a request has come and gone

    def cpu_seconds() -> float:
        total = 0
        for pid in group_processes(server.proc.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")

    titles = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in group_processes(server.proc.pid)]
    assert any(b"scheduler" in t for t in titles), titles  # what spins: none found would pass vacuously
    ours.sleep()  # on CPU nothing to release: no call (SGLang's would cost a garbage-collection pass)
    ours.wake()
    assert not ours.releases and not any(op in ("release", "resume") for op, *_ in ours.events)
    time.sleep(1.0)  # let the scheduler reach its idle path
    before = cpu_seconds()
    time.sleep(3.0)
    assert cpu_seconds() - before < 0.5


@needs_sglang
def test_weight_pushes_from_a_two_rank_trainer(server, tiny_model, tmp_path):
    run_ranks([str(REPO / "tests/dist/sglang_checks.py"), str(tiny_model), str(tmp_path), server.url], timeout=900)
    per_rank = json.loads((tmp_path / "result.json").read_text())
    for rank, result in enumerate(per_rank):
        for stage, version in (("initial", 1), ("tensor", 2), ("distributed", 3)):
            r = result[stage]
            assert r["ours"] == r["theirs"], (rank, stage)  # the server serves the trainer's weights
            assert r["logprob_diff"] is not None and r["logprob_diff"] < 1e-3, (rank, stage)
            assert r["served_version"] == str(version) and r["engine_version"] == version
        # training moved the model: the pushes were not no-ops
        assert result["initial"]["ours"] != result["tensor"]["ours"] != result["distributed"]["ours"], rank
        n = len(result["initial"]["ours"])
        assert result["colocated_events"] == [
            ["update", 1], ["generate", n], ["release", ["weights", "kv_cache"]],
            ["resume", ["weights"]], ["update", 2],  # weights back before the push ...
            ["resume", ["kv_cache"]],  # ... the cache only after it
            ["generate", n], ["release", ["weights", "kv_cache"]], ["resume", ["weights", "kv_cache"]]]
        # rank 0 alone forms the group with the server's rank (world 2) and broadcasts
        group = [["init_group", 2]] if rank == 0 else []
        assert result["disaggregated_events"] == group + [["update", 3], ["generate", n]]
        # rank 0 sends; rank 1 only takes part in the gathers
        assert (result["metrics"].get("sglang/sync_gb_per_s", 0) > 0) == (rank == 0)


@needs_sglang
def test_two_rank_grpo_run_on_sglang(tiny_model, task_dir, tmp_path):
    run_dir = tmp_path / "run"
    marker = f"grpo-{os.getpid()}"
    proc = run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
                      f"model.path={tiny_model}", f"data.path={task_dir / 'train.jsonl'}", f"log.run_dir={run_dir}",
                      "rollout.reward.fn=e2e_rewards:digit_fraction", "rollout.batch_size=4",
                      "rollout.n_samples_per_prompt=4",
                      "rollout.max_response_len=6", "train.lr=5e-3", "train.max_tokens_per_gpu=64", "train.num_steps=3",
                      "checkpoint.export_hf=false", "checkpoint.save_final=false", "eval.path=null", "rollout.engine=sglang",
                      "rollout.sglang.ranks_per_engine=2", f"rollout.sglang.python={SGLANG_PYTHON}",
                      f"rollout.sglang.extra_args={json.dumps(CPU_ARGS)}",
                      f"rollout.sglang.env={json.dumps(server_env(marker))}"],
                     timeout=1200)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and "sglang engine (colocated): 1 server(s)" in proc.stdout
    assert all(r["rollout/response_len"] > 0 for r in rows)
    # each step generates on the weights just pushed: a radix cache left over from the old weights (the
    # chat template's prefix is shared by every prompt) would show here
    assert all(r["rollout/train_logprob_abs_diff"] < 1e-3 for r in rows), [r["rollout/train_logprob_abs_diff"] for r in rows]
    assert "sglang/asleep_s" not in rows[0]  # on CPU the engine releases nothing (rollout.sglang.release_memory)
    assert any(r["train/grad_norm"] > 0 for r in rows)
    assert not server_processes(marker), "the run left SGLang server processes behind"


@needs_sglang
def test_two_node_run_with_a_disaggregated_engine(tiny_model, task_dir, tmp_path):
    """Two torchrun nodes of one rank, the rendezvous at this machine's network address (not loopback): node
    0 launches the server on that address, node 1 generates on it, weights go over a group hosted there."""
    from test_multi_node import two_nodes
    from slime.utils.net import address_toward, is_loopback

    address = address_toward("10.255.255.255")  # the address of the default route's interface
    if is_loopback(address):
        pytest.skip("this machine has no non-loopback address")
    run_dir, marker = tmp_path / "run", f"nodes-{os.getpid()}"
    outs = two_nodes([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
                      f"model.path={tiny_model}", f"data.path={task_dir / 'train.jsonl'}", f"log.run_dir={run_dir}",
                      "rollout.reward.fn=e2e_rewards:digit_fraction", "rollout.batch_size=4",
                      "rollout.n_samples_per_prompt=4", "rollout.max_response_len=6", "train.lr=5e-3",
                      "train.max_tokens_per_gpu=64", "train.num_steps=2", "checkpoint.export_hf=false",
                      "eval.path=null", "rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                      f"rollout.sglang.python={SGLANG_PYTHON}", f"rollout.sglang.extra_args={json.dumps(CPU_ARGS)}",
                      f"rollout.sglang.env={json.dumps(server_env(marker))}"], master_addr=address, timeout=1200)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert f"server(s) ['http://{address}:" in outs[0] and len(rows) == 2
    assert rows[1]["rollout/train_logprob_abs_diff"] < 1e-3  # node 1 generated on the weights pushed after step 1
    assert not server_processes(marker), "the run left SGLang server processes behind"


@needs_sglang
def test_one_step_off_rollout_on_a_disaggregated_engine(tiny_model, task_dir, tmp_path):
    """rollout.one_step_off with SGLang servers of their own: generation of step k+1 overlaps step k's training,
    weight pushes happen between batches, and the samples lag the trainer by one update from step 2 on."""
    run_dir, marker = tmp_path / "run", f"async-{os.getpid()}"
    run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
               f"model.path={tiny_model}", f"data.path={task_dir / 'train.jsonl'}", f"log.run_dir={run_dir}",
               "rollout.reward.fn=e2e_rewards:digit_fraction", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
               "rollout.max_response_len=6", "train.lr=5e-3", "train.max_tokens_per_gpu=64", "train.num_steps=3",
               "checkpoint.export_hf=false", "checkpoint.save_final=false", "eval.path=null", "rollout.engine=sglang",
               "rollout.sglang.mode=disaggregated", "rollout.one_step_off=true", "algo.tis.level=token",
               f"rollout.sglang.python={SGLANG_PYTHON}", f"rollout.sglang.extra_args={json.dumps(CPU_ARGS)}",
               f"rollout.sglang.env={json.dumps(server_env(marker))}"], timeout=1200)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert "sglang/sync_gb_per_s" not in rows[0] and all("sglang/sync_gb_per_s" in r for r in rows[1:])
    assert rows[0]["rollout/train_logprob_abs_diff"] < 1e-3 < rows[1]["rollout/train_logprob_abs_diff"]
    assert not server_processes(marker), "the run left SGLang server processes behind"


@needs_sglang
def test_two_engines_on_one_server_and_a_push_that_failed_part_way(server, engines, tiny_model):
    """Two engines (two jobs on the servers of rollout.sglang.urls) generate at once: their request ids were both
    slime-r0-<n>, and the server refused the second of each as a duplicate (400, both calls failed). A push whose
    buckets raise after its session began left the session open, and the server refused every later push."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from slime.models.loading import load_tokenizer

    ours, hf, prompts = engines
    model_cfg = ModelConfig(path=str(tiny_model), dtype="float32")
    other = SGLangEngine(SGLangConfig(urls=[server.url], max_concurrency=8), model_cfg, load_tokenizer(model_cfg),
                         OneRank())
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(e.generate, prompts, params) for e in (ours, other)]
            a, b = (r.result() for r in runs)
    finally:
        other.shutdown()
    assert [g[0].response_ids for g in a] == [g[0].response_ids for g in b]
    # the checkpoint's weights (earlier tests pushed trained ones): the hf engine's
    weights = sorted(load_file(str(tiny_model / "model.safetensors")).items())

    def failing():
        yield weights[:2]
        raise RuntimeError("gather failed (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        ours.update_weights(failing(), version=ours.weight_version + 1)
    ours.update_weights([weights], version=ours.weight_version + 2)
    assert ours.client.get("/model_info")["weight_version"] == str(ours.weight_version)
    assert [g[0].response_ids for g in ours.generate(prompts, params)] == \
        [g[0].response_ids for g in hf.generate(prompts, params)]


@needs_sglang
def test_killed_server_is_detected_and_reported(server, engines):
    """Runs last: kills the module's server (SIGKILL to its main process, as an OOM killer would)."""
    ours, _, prompts = engines
    os.kill(launched_by(server.proc.pid), signal.SIGKILL)  # the server, not its group leader
    server.proc.wait(timeout=30)
    with pytest.raises(SGLangServerError, match=rf"(?s)exited with code -9.*{server.log_path.name}.*\n.*\S"):
        ours.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0.0))
    server.kill()  # the scheduler and detokenizer in its process group go too
    assert not server_processes("module")


@needs_sglang
def test_image_text_generation_matches_hf_engine(tmp_path):
    """tests/gpu/sglang_vl.py's check on the CPU build; skipped, with the failing piece named, where that
    build cannot load Qwen2-VL (checked by starting it, so a build that can runs the test)."""
    from gpu.sglang_vl import CPU_LIMIT, CPU_LIMIT_MARK, run_check

    try:
        result = run_check(SGLANG_PYTHON, env=server_env("vl"), log_dir=tmp_path, extra_args=CPU_ARGS)
    except SGLangServerError as e:
        if CPU_LIMIT_MARK in str(e):
            pytest.skip(CPU_LIMIT)
        raise
    assert all(result["same_tokens"]), result
    assert result["logprob_diff"] < 1e-3


@needs_sglang
def test_moe_weight_pushes_from_an_expert_parallel_trainer(tmp_path):
    """A tiny Qwen3-MoE trained with parallel.ep=2 (each rank holds half the experts): every push gives the
    server all experts under checkpoint names, and its greedy output equals an hf engine holding the
    trainer's weights (the CPU build's torch-native MoE path was checked against HF first, as the
    project's notes require for a new family)."""
    from data_tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=0)
    srv = SGLangServer(SGLANG_PYTHON, str(model), port=free_port(), env=server_env("moe"), log_path=tmp_path / "s.log",
                       args=server_args(SGLangConfig(extra_args=CPU_ARGS[:-2]), dtype=torch.float32, gpu_id=None,
                                        colocated=True, seed=4321))  # the seed from server_args, not CPU_ARGS
    srv.start()
    try:
        srv.wait_ready(timeout=900)
        run_ranks([str(REPO / "tests/dist/sglang_checks.py"), str(model), str(tmp_path), srv.url, "parallel.ep=2"],
                  timeout=900)
    finally:
        srv.kill()
    for rank, result in enumerate(json.loads((tmp_path / "result.json").read_text())):
        for stage, version in (("initial", 1), ("tensor", 2), ("distributed", 3)):
            r = result[stage]
            assert r["ours"] == r["theirs"], (rank, stage)
            assert r["logprob_diff"] is not None and r["logprob_diff"] < 1e-3, (rank, stage)
            assert r["served_version"] == str(version)
        assert result["initial"]["ours"] != result["tensor"]["ours"], rank  # the experts did move
    assert not server_processes("moe")


def bare_engine(client) -> SGLangEngine:
    """An engine without servers: only what generate() and abort() read, talking to `client`."""
    import collections
    import itertools
    import types
    from concurrent.futures import ThreadPoolExecutor

    engine = object.__new__(SGLangEngine)
    engine.client, engine._rid, engine._lock, engine._calls = client, itertools.count(), threading.Lock(), set()
    engine._rid_tag = "e1"
    engine.dims, engine.eos_id, engine.context = types.SimpleNamespace(rank=0), None, None
    engine.seed, engine._version, engine._calls_made = 0, 0, (0, 0)
    engine._pool, engine.events, engine._stats = ThreadPoolExecutor(8), collections.deque(), collections.Counter()
    return engine


def test_each_request_carries_a_seed_of_the_run_the_version_the_call_and_the_sample():
    """SGLang samples by a request's sampling_seed under --enable-deterministic-inference: a rerun (or a resumed
    run, at the same weight version) sends the same seeds, while no two samples of a step share one."""
    def seeds(seed: int, version: int, calls: int = 1) -> list[dict]:
        sent = []

        class Client:
            url = "http://127.0.0.1:30000"

            def post(self, path, body, **kw):
                sent[-1].setdefault(tuple(body["input_ids"]), set()).add(body["sampling_params"]["sampling_seed"])
                return generation([5, 6])

        engine = bare_engine(Client())
        engine.seed, engine._version = seed, version
        for _ in range(calls):
            sent.append({})
            engine.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=2, n=2))
        return sent

    first = seeds(7, version=3, calls=2)
    assert first == seeds(7, version=3, calls=2)  # reproducible, whatever order the requests went out in
    all_seeds = [x for call in first for per_prompt in call.values() for x in per_prompt]
    assert len(all_seeds) == len(set(all_seeds)) == 8  # 2 calls x 2 prompts x n=2, no seed twice
    assert all(0 <= x < 2**63 for x in all_seeds)
    assert seeds(8, version=3)[0] != first[0] and seeds(7, version=4)[0] != first[0]


def test_launched_servers_get_the_runs_seed():
    args = server_args(SGLangConfig(), dtype=torch.float32, gpu_id=None, colocated=True, seed=1235)
    assert args[args.index("--random-seed") + 1] == "1235"
    assert "--random-seed" not in server_args(SGLangConfig(), dtype=torch.float32, gpu_id=None, colocated=True)


def test_released_weights_are_marked_until_the_next_push():
    """SGLang keeps no copy of released weights (no --enable-weights-cpu-backup): a resume brings back buffers only.
    The loop's evaluation put the engine to sleep after the step's push, and the next rollout generated on what
    was left of them (GPU, colocated). The engine now marks them, and the loop pushes again before generating."""
    import types

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            return {}

    engine = bare_engine(Client())
    engine.releases, engine.owned, engine._asleep, engine._since = True, [engine.client], set(), 0.0
    engine.weights_released = False
    engine.dims = types.SimpleNamespace(rank=0, barrier=lambda: None)
    engine._all_gather = lambda obj: [obj]
    engine.sleep()
    assert engine.weights_released and engine._asleep == {"weights", "kv_cache"}
    engine.wake()
    assert engine.weights_released and not engine._asleep  # awake, but on released weights: the loop pushes
    engine.sleep(["kv_cache"])
    engine.weights_released = False  # as a push leaves it
    engine.sleep()
    assert engine.weights_released


def test_the_requests_of_an_abort_are_aborted_at_once():
    """One after another, a server that had stopped answering held an abort 10 s per request in flight (64 at the
    defaults: over 10 minutes). The 6 aborts here must all be in flight together to pass the barrier."""
    met = threading.Barrier(6, timeout=30)
    aborted = []

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            met.wait()  # sent one after another, the first would wait here alone until the barrier broke
            aborted.append(body["rid"])
            return {}

    engine = bare_engine(Client())
    engine._abort_rids({f"r{k}": engine.client for k in range(6)})
    assert sorted(aborted) == [f"r{k}" for k in range(6)] and not met.broken


def generation(ids, reason="length"):
    return {"output_ids": ids, "meta_info": {"prompt_tokens": 3, "finish_reason": {"type": reason},
                                             "output_token_logprobs": [[-0.1, t, None] for t in ids]}}


def test_a_generation_the_server_ended_on_its_own_is_an_error_naming_it():
    """finish_reason abort without an abort of ours (the server ran out of KV cache, refused the request, ...)
    would otherwise be trained on as a short response."""
    from slime.rollout.sglang_engine import _Call

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            out = generation([5, 6], "abort")
            out["meta_info"]["finish_reason"]["message"] = "KV cache pool is full"
            return out

    engine = bare_engine(Client())
    with pytest.raises(SGLangServerError, match="ended request slime-e1-r0-0 .* after 2 tokens .*KV cache pool is full"):
        engine._generate_one(_Call(), [1, 2, 3], {})
    assert engine._generate_one(_Call(aborted=True), [1, 2, 3], {}).finish_reason == "abort"  # ours: as asked
    ours = _Call()
    ours.aborted = True  # aborted while the request ran: a partial generation
    engine.client.post = lambda path, body, **kw: generation([5], "abort")
    assert engine._generate_one(ours, [1, 2, 3], {}).finish_reason == "abort"


def test_a_response_the_server_cut_below_the_length_asked_for_is_an_error_naming_the_fix():
    """SGLang lowers max_new_tokens, in silence, to what its context and KV pool leave: responses ended at
    "length" before rollout.max_response_len, trained on as if the limit had been reached."""
    from slime.rollout.sglang_engine import _Call

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            return generation([5, 6, 7])

    engine = bare_engine(Client())
    with pytest.raises(SGLangServerError, match=r"ended request slime-e1-r0-0 \(a prompt of 3 tokens\) at its length "
                                                r"limit after 3 of the 8 new tokens asked for.*--max-total-tokens.*"
                                                r"rollout.max_response_len \(in an evaluation: "
                                                r"eval.max_response_len\)"):
        engine._generate_one(_Call(), [1, 2, 3], {"max_new_tokens": 8})
    assert engine._generate_one(_Call(), [1, 2, 3], {"max_new_tokens": 3}).finish_reason == "length"
    engine.context = 8  # SGLang ends 2 positions short of the context: 3 + 3 tokens reach it, a response at its limit
    assert engine._generate_one(_Call(), [1, 2, 3], {"max_new_tokens": 5}).finish_reason == "length"
    engine.context = 9
    with pytest.raises(SGLangServerError, match="after 3 of the 5 new tokens"):
        engine._generate_one(_Call(), [1, 2, 3], {"max_new_tokens": 5})


def test_an_answer_that_is_not_a_generation_names_the_server():
    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            return "<html>a proxy's login page</html>"

    with pytest.raises(SGLangServerError, match="answered request slime-e1-r0-0 with something that is not an SGLang "
                                                "generation .*login page.*rollout.sglang.urls"):
        bare_engine(Client()).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))


def test_a_failed_generate_call_does_not_cut_another_threads_generations():
    """thread_safe generate functions call generate() from many threads: one call's failure aborts its own
    requests only; another call's running request finishes normally (it came back as a silent 'abort')."""
    running, aborted = {}, set()

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            if path == "/abort_request":
                aborted.add(body["rid"])
                running.get(body["rid"], threading.Event()).set()
                return {}
            if body["input_ids"] == [1]:  # this call's request fails once the other one runs
                assert started.wait(5)
                raise SGLangServerError("boom")
            running[body["rid"]] = done = threading.Event()
            started.set()
            cut = done.wait(2)  # until aborted, or a normal end
            return generation([7] if cut else [7, 8, 9], "abort" if cut else "length")

    started = threading.Event()
    engine = bare_engine(Client())
    results = {}

    def call(prompt):
        try:
            results[prompt[0]] = engine.generate([prompt], SamplingParams(max_new_tokens=3))
        except SGLangServerError as e:
            results[prompt[0]] = e

    threads = [threading.Thread(target=call, args=([p],)) for p in (2, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert isinstance(results[1], SGLangServerError)
    assert results[2][0][0].response_ids == [7, 8, 9] and results[2][0][0].finish_reason == "length"
    assert not aborted & set(running)  # the other call's request was not aborted
    engine.abort()  # nothing running: nothing to do


def test_an_abort_that_overtakes_its_request_is_sent_again():
    """The abort goes out on a connection of its own and here reaches the server before the request it names:
    the server ignores an id it does not hold (as SGLang does), so one abort would leave that request running its
    whole length (20 s here). The aborted call aborts its requests still in flight again until they end."""
    running, first_abort, sent = {}, threading.Event(), threading.Event()

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            if path == "/abort_request":
                first_abort.set()
                if body["rid"] in running:
                    running[body["rid"]].set()
                return {}
            sent.set()
            assert first_abort.wait(5)  # the request arrives after the abort that names it
            running[body["rid"]] = cut = threading.Event()
            return generation([7], "abort") if cut.wait(20) else generation(list(range(30)))

    engine, result = bare_engine(Client()), {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "out", engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=30))))
    worker.start()
    assert sent.wait(5)
    engine.abort()
    worker.join(10)
    assert not worker.is_alive(), "the request outlived its abort"
    assert result["out"][0][0].finish_reason == "abort" and result["out"][0][0].response_ids == [7]


def test_a_retried_generation_takes_a_new_request_id_and_aborts_the_old_one():
    """SGLang notices a dropped connection only at its next poll, and until then refuses the same id as a
    duplicate (HTTP 400, not retried): a retry after a reset must not reuse it."""
    live, seen, aborted = set(), [], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/abort_request":
                aborted.append(body["rid"])
                out, code = b"{}", 200
            elif body["rid"] in live:
                out, code = json.dumps({"error": f"Duplicate request ID detected: {body['rid']}"}).encode(), 400
            else:
                seen.append(body["rid"])
                live.add(body["rid"])
                if len(seen) == 1:  # the first attempt's connection drops (the id stays live on the server)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                out, code = json.dumps(generation([4, 5])).encode(), 200
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            except OSError:
                pass

        def do_GET(self):  # /health
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = SGLangClient(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=1.0, max_retries=3)
        gens = bare_engine(client).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    finally:
        httpd.shutdown()
    assert gens[0][0].response_ids == [4, 5]
    assert len(seen) >= 2 and len(set(seen)) == len(seen)  # every attempt its own id
    assert seen[0] in aborted  # the timed-out attempt was aborted on the server


def test_a_stop_signal_leaves_the_servers_to_the_graceful_stop(tmp_path):
    """SIGTERM with the trainer's stop handler installed: the step still needs the servers (generation, the
    weight push), so they stay up; with no handler of ours the servers go and the process dies by the signal."""
    script = tmp_path / "stop.py"
    script.write_text(f"""
import os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from slime.rollout import sglang_server
from slime.rollout.sglang_server import SGLangServer
graceful = sys.argv[1] == "graceful"
stopped = []
if graceful:
    signal.signal(signal.SIGTERM, lambda *a: stopped.append(1))
fake = Path({str(tmp_path)!r}) / "fakepy"
fake.write_text("#!/bin/sh\\nexec sleep 60\\n")
fake.chmod(0o755)
server = SGLangServer(str(fake), "m", port=1, args=[], env={{}}, log_path=Path({str(tmp_path)!r}) / "s.log")
server.start()
print("pid", server.proc.pid, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("stop requested:", bool(stopped), "server alive:", server.alive, flush=True)
server.kill(grace=1)
""")
    graceful = subprocess.run([sys.executable, str(script), "graceful"], capture_output=True, text=True, timeout=60)
    assert graceful.returncode == 0, graceful.stderr
    assert "stop requested: True server alive: True" in graceful.stdout
    plain = subprocess.run([sys.executable, str(script), "plain"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == -signal.SIGTERM and "stop requested" not in plain.stdout
    pid = int(plain.stdout.split()[1])

    def gone() -> bool:
        try:
            return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone()  # the server went with the process


def test_abandon_drops_queued_requests_and_aborts_the_running_one():
    """A rank that fails must not wait for its rollout: the pool's threads are joined at exit after every queued
    request. abandon() cancels the queued ones and aborts the running one, without waiting."""
    from concurrent.futures import ThreadPoolExecutor

    running, started, posted = {}, threading.Event(), []

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            posted.append((path, body["rid"]))
            if path == "/abort_request":
                running[body["rid"]].set()
                return {}
            running[body["rid"]] = done = threading.Event()
            started.set()
            cut = done.wait(30)
            return generation([7] if cut else [7, 8], "abort" if cut else "length")

    engine = bare_engine(Client())
    engine._pool, engine._servers = ThreadPoolExecutor(1), []
    out = {}

    def call():
        try:
            out["gens"] = engine.generate([[1], [2], [3]], SamplingParams(2))
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    caller = threading.Thread(target=call)
    caller.start()
    assert started.wait(10)
    engine.abandon()
    caller.join(30)
    assert not caller.is_alive()  # the running request waits 30 s for its abort, the queued ones longer
    assert [p for p, _ in posted] == ["/generate", "/abort_request"]  # the two queued requests never went out
    assert type(out["error"]).__name__ == "CancelledError"  # the call fails: its queued requests were dropped
    # abandon() may land while generate() is still queuing (the first request can start before the last is
    # queued): a call that queues on the abandoned engine fails the same way, not with the pool's RuntimeError.
    with pytest.raises(concurrent.futures.CancelledError, match="abandoned"):
        engine.generate([[4]], SamplingParams(2))


def session_engine(client, group_dims=None) -> SGLangEngine:
    """A bare engine that pushes to `client` (colocated: /update_weights_from_tensor), as rank 0 of one."""
    engine = bare_engine(client)
    engine.cfg = SGLangConfig(urls=[client.url], request_timeout=600)
    engine.owned, engine.colocated, engine._asleep, engine._version = [client], True, set(), 0
    engine._host_buffers, engine._group, engine._control = None, None, None
    engine.dims = group_dims or OneRank()
    return engine


class SessionServer:
    """What SGLang 0.5.23 answers about weight-update sessions (one open at a time), and the version served."""
    url = "http://127.0.0.1:30000"

    def __init__(self):
        self.open, self.version, self.calls = False, None, []

    def post(self, path, body, **kw):
        self.calls.append(path)
        if path == "/begin_weight_update":
            if self.open:
                raise SGLangServerError(f"{self.url}{path} answered 400: a weight-update session is already open; "
                                        "call end_weight_update() first")
            self.open = True
        elif path == "/end_weight_update":
            if not self.open:
                raise SGLangServerError(f"{self.url}{path} answered 400: no weight-update session is open")
            self.open = False
        elif path == "/update_weights_from_tensor":
            self.version = body["weight_version"]
        return {"success": True}

    def get(self, path, **kw):
        return {"weight_version": self.version}


def test_a_push_that_fails_part_way_ends_its_session_and_a_stale_one_is_ended(caplog):
    """A push whose buckets raise after begin (a ZeRO gather that failed) left the server's session open, and
    SGLang refused every later push (the servers of rollout.sglang.urls outlive the run: a resumed run could not
    push). The session is ended on the way out; one found open at begin (another run's) is ended and begun again."""
    import logging

    server = SessionServer()
    engine = session_engine(server)
    weights = [("w", torch.ones(4))]

    def failing():
        yield weights
        raise RuntimeError("gather failed (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        engine.update_weights(failing(), version=1)
    assert not server.open and server.calls[-1] == "/end_weight_update"
    engine.update_weights([weights], version=2)
    assert server.version == "2" and not server.open
    server.open = True  # left open by a run that died mid-push
    with caplog.at_level(logging.WARNING):
        engine.update_weights([weights], version=3)
    assert server.version == "3" and not server.open
    assert "had a weight-update session open" in caplog.text


def test_a_server_that_refuses_to_join_the_update_group_is_reported_at_once():
    """Disaggregated: init_weights_update_group answers only once every engine rank has joined the group, and the
    trainer waits in the group's rendezvous. A server that refuses at once left the trainer waiting out
    request_timeout (600 s by default), then reporting a store timeout instead of the server's reason."""
    from concurrent.futures import ThreadPoolExecutor

    class Refusing:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            raise SGLangServerError(f"{self.url}{path} answered 400: Failed to init group: no route (fake)")

    joined = threading.Event()

    class Dims(OneRank):
        def new_external_group(self, **kw):  # the rendezvous: the engines never come
            if not joined.wait(kw["timeout_s"]):
                raise RuntimeError(f"wait timeout after {kw['timeout_s']} s")

    engine = session_engine(Refusing(), Dims())
    engine.colocated, engine._control = False, ThreadPoolExecutor(1)
    try:
        with pytest.raises(SGLangServerError, match=r"Failed to init group: no route \(fake\)"):
            engine._ensure_group()
    finally:
        joined.set()
    assert engine._group is None


def test_an_abort_before_a_request_registers_cuts_it():
    """abort() marks the calls running and aborts their registered requests: a request of an aborted call that
    had not registered yet was sent anyway and ran its whole length. It is not sent."""
    from slime.rollout.sglang_engine import _Call

    posted = []

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            posted.append(path)
            return generation([7, 8])

    class AbortWhileNumbering:  # the abort comes while the request takes its number: after any check before it
        def __next__(self):
            engine.abort()
            return 0

    engine = bare_engine(Client())
    engine._rid = AbortWhileNumbering()
    call = _Call()
    with engine._lock:
        engine._calls.add(call)
    assert engine._generate_one(call, [1, 2, 3], {}).finish_reason == "abort" and posted == []


def test_a_generate_functions_requests_waiting_in_the_engines_pool_are_not_its_time():
    """rollout.generate_fn_timeout left out the wait for the hf engine only: with SGLang, requests queued behind
    rollout.sglang.max_concurrency counted against it, and a batch larger than the pool timed out with a message
    blaming the function. The wait is counted on the prompt's queue clock now."""
    from concurrent.futures import ThreadPoolExecutor

    from slime.data.prompts import Prompt
    from slime.rollout.custom import RolloutContext

    started, release = threading.Event(), threading.Event()

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            started.set()
            release.wait(60)
            return generation([5, 6])

    engine = bare_engine(Client())
    engine._pool = ThreadPoolExecutor(1)  # rollout.sglang.max_concurrency=1
    ctx = RolloutContext(Prompt([1, 2], "q", None, {}, 0), SamplingParams(max_new_tokens=2), None, engine)
    first = threading.Thread(target=ctx.generate, args=([1, 2],), kwargs={"max_new_tokens": 2})
    first.start()
    assert started.wait(60)  # the pool's one thread is taken
    second = threading.Thread(target=ctx.generate, args=([1, 2],), kwargs={"max_new_tokens": 2})
    second.start()
    deadline = time.monotonic() + 60
    while ctx.queue._waiting != 1 and time.monotonic() < deadline:  # the second request queues
        time.sleep(0.01)
    waiting = ctx.queue._waiting
    release.set()
    first.join(60)
    second.join(60)
    assert waiting == 1 and ctx.queue._waiting == 0 and ctx.queue.seconds() > 0


def test_no_abort_is_sent_once_the_engine_is_abandoned():
    """After an error, abandon() killed the servers while the other generate() calls went on re-sending their aborts
    every 0.5 s: each waited on the dead server and logged that it "does not answer /health (stopped, or hung)",
    beside the real error, and held the exit ~5 s."""
    from slime.rollout.sglang_engine import _Call

    posts = []

    class Client:
        url = "http://127.0.0.1:30000"

        def post(self, path, body, **kw):
            posts.append(path)

    for launched in (True, False):
        posts.clear()
        engine = bare_engine(Client())
        engine._servers = [types.SimpleNamespace(kill=lambda: None)] if launched else []  # or given by url
        call = _Call()
        call.inflight["r1"] = engine.client
        engine._calls.add(call)
        engine.abandon()
        assert posts == ["/abort_request"] and call.aborted  # aborted while the servers were up
        engine._abort_again(call)  # what the waiting call does every ABORT_AGAIN_S
        # a server of rollout.sglang.urls lives on: a request the first abort missed would run its whole length
        assert posts == ["/abort_request"] * (1 if launched else 2)
