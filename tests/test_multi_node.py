"""Multi-node launch, on one machine: two torchrun "nodes" of one rank each (LOCAL_RANK 0 on both, a rendezvous
over TCP) run the same job as one node of two ranks, step for step."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_ranks
from slime.utils.net import reserved_port

TIME_KEYS = ("time/", "perf/")
JOB = ["--config", str(REPO / "examples/cpu_tiny_grpo.yaml"), "rollout.reward.fn=e2e_rewards:digit_fraction",
       "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=6", "train.lr=5e-3",
       "train.max_tokens_per_gpu=64", "eval.path=null", "train.num_steps=2", "checkpoint.export_hf=false"]


def two_nodes(args: list[str], master_addr: str = "127.0.0.1", timeout: int = 600, extra=((), ()),
              check: bool = True) -> list[str]:
    """`torchrun --nnodes 2 --nproc_per_node 1 --node_rank k` for k = 0, 1, as on two hosts (the master address
    is the first node's), node k with `extra[k]` after `args`; with `check` both must exit 0. Returns their
    output."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    with reserved_port() as port:  # held until the job ends: node 0's store listens on it
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                                   "1", "--node_rank", str(k), "--master_addr", master_addr, "--master_port", str(port),
                                   *args, *extra[k]], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  text=True)
                 for k in range(2)]
        try:
            outs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
    for k, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 or not check, f"node {k} exited {p.returncode}:\n{out[-6000:]}"
    return outs


def metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIME_KEYS)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_of_one_rank_run_the_job_of_one_node_with_two(tiny_model, task_dir, tmp_path):
    common = [f"model.path={tiny_model}", f"data.path={task_dir / 'train.jsonl'}"]
    run_ranks([str(REPO / "run.py"), *JOB, *common, f"log.run_dir={tmp_path / 'one_node'}"])
    outs = two_nodes([str(REPO / "run.py"), *JOB, *common, f"log.run_dir={tmp_path / 'two_nodes'}"])
    want, got = metrics(tmp_path / "one_node"), metrics(tmp_path / "two_nodes")
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got):
        assert sorted(a) == sorted(b)
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert "step 2/2" in outs[0] and "step 2/2" not in outs[1]  # rank 0 logs; the other node's rank does not
    assert (tmp_path / "two_nodes/checkpoints/step_2").is_dir()


def test_nodes_started_with_other_settings_are_refused_naming_them(tiny_model, task_dir, tmp_path):
    """Two nodes with another train.lr trained together to the end, exit 0, their updates diverging in silence.
    Paths may differ (each node's own copy of the model)."""
    copy = tmp_path / "model_copy"
    shutil.copytree(tiny_model, copy)
    outs = two_nodes([str(REPO / "run.py"), *JOB, f"data.path={task_dir / 'train.jsonl'}",
                      f"log.run_dir={tmp_path / 'run'}"], extra=([f"model.path={tiny_model}"],
                                                               [f"model.path={copy}", "train.lr=1e-3"]), check=False)
    assert all("the ranks were started with different configs (1 key(s) differ: train.lr: rank 0 0.005, rank 1 "
               "0.001); start every node with the same config file and overrides" in out for out in outs), outs[0]
    # compared before the process groups, whose layout parallel.sp sets (they would wait out the timeout)
    outs = two_nodes([str(REPO / "run.py"), *JOB, f"data.path={task_dir / 'train.jsonl'}", f"model.path={tiny_model}",
                      f"log.run_dir={tmp_path / 'run2'}"], extra=([], ["parallel.sp=2"]), check=False, timeout=300)
    assert all("parallel.sp: rank 0 1, rank 1 2" in out for out in outs), outs[0]


def test_node_addresses_and_engine_placement(monkeypatch):
    from slime.config import SGLangConfig
    from slime.rollout.sglang_engine import plan_engines
    from slime.utils.net import address_toward, is_loopback, node_address, url_host

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert node_address(8) == "127.0.0.1"  # one node: servers stay on loopback
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert node_address(8) == "127.0.0.1"  # two nodes whose rendezvous is this machine
    assert address_toward("127.0.0.1") == "127.0.0.1" and is_loopback("localhost") and not is_loopback("10.0.0.1")
    assert url_host("http://10.1.2.3:30000/generate") == "10.1.2.3"
    assert plan_engines(SGLangConfig(ranks_per_engine=4), 8, ranks_per_node=4).num_engines == 2
    with pytest.raises(ValueError, match=r"must divide the ranks per node \(4\)"):
        plan_engines(SGLangConfig(ranks_per_engine=8), 8, ranks_per_node=4)


def test_a_reserved_port_is_held_from_others_but_open_to_the_rendezvous_store():
    """spawn_ranks and two_nodes pick MASTER_PORT and hold it until the job ends: between the pick and rank 0's
    store listening on it (seconds of imports), a test's other sockets must not get it."""
    import datetime
    import errno
    import socket

    import torch.distributed as dist

    with reserved_port() as port:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("k", "v")
        assert dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=10)).get("k") == b"v"


def test_ranks_per_node_under_deepspeeds_launcher(tmp_path):
    """A hostfile launch (deepspeed --hostfile) runs DeepSpeed's launcher on every node, which sets LOCAL_SIZE, not
    torchrun's LOCAL_WORLD_SIZE: the job counted as one node (disaggregated servers on 127.0.0.1, unreachable from
    the other node; the default --base-gpu-id past the node's GPUs). Node 1 of two with 2 ranks each, as launched."""
    import base64

    script = tmp_path / "probe.py"
    script.write_text("import os, pathlib\nfrom slime.utils.net import node_address, single_node\n"
                      "ws = int(os.environ['WORLD_SIZE'])\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'rank' + os.environ['RANK']).write_text("
                      "f'one node {single_node(ws)}, address {node_address(ws)}')\n")
    world = base64.urlsafe_b64encode(json.dumps({"node1": [0, 1], "node2": [0, 1]}).encode()).decode()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world}", "--node_rank=1",
                          "--master_addr=10.0.0.1", "--master_port=29511", str(script)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    said = [(tmp_path / f"rank{r}").read_text() for r in (2, 3)]
    assert all(line.startswith("one node False, address ") for line in said), said
    assert not any(line.endswith(" 127.0.0.1") for line in said)  # the route toward the master's node


def test_each_rank_takes_its_gpu_before_the_first_collective(tmp_path):
    """On a GPU node, NCCL runs a collective on the current device: the config-agreement check (and DeepSpeed's
    init) ran before torch.cuda.set_device, every rank on cuda:0, and a multi-GPU launch failed at start. Run with
    gloo and a recorded set_device (tests/dist/device_order_checks.py)."""
    run_ranks([str(REPO / "tests/dist/device_order_checks.py"), str(tmp_path)])
    for rank in (0, 1):
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert events == [f"set_device({rank})", f"init_distributed on cuda:{rank}", f"agree on cuda:{rank}"]


def test_the_engines_weight_group_does_not_split_the_trainer_worlds_communicator():
    """On GPUs the trainer world is bound to each rank's device, and torch made the external weight-update group
    by splitting the world's NCCL communicator, which only rank 0 enters: the disaggregated weight push hung on
    more than one GPU. The group is made with the world unbound (tests/dist/external_group_checks.py)."""
    proc = run_ranks([str(REPO / "tests/dist/external_group_checks.py")], nproc=1)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {"split_sources_consulted": 0, "bound": "cpu:0", "broadcast": [1.0, 1.0, 1.0]}


def test_deepspeeds_shared_memory_files_are_removed_once_every_rank_has_mapped_them(tmp_path):
    """DeepSpeed's CPU all-reduce (all ranks on one node: LOCAL_SIZE, set by its launcher) maps a 66 MB file per
    rank in /dev/shm and never deletes it: every run on a new port left 132 MB of RAM behind (4 GB after a day of
    test runs). The names go once every rank has opened them; the all-reduce through them still sums."""
    run_ranks([str(REPO / "tests/dist/shm_checks.py"), str(tmp_path)], env={"LOCAL_SIZE": "2"})
    for r in (0, 1):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == {"left": [False, False], "sum": [3.0] * 4}
