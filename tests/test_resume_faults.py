"""Resume faults, by direct calls: checkpoint pruning after a fallback, damaged manifests, a torn or
unreadable metrics.jsonl, and a fresh start in a run directory that already holds metrics."""
from __future__ import annotations

import json
import os
import shutil
import logging
from pathlib import Path

import pytest

from conftest import REPO, run_ranks
from slime.config import LogConfig
from slime.trainer.checkpoint import check_resume_early, find_checkpoint, save_checkpoint
from slime.utils.metrics import MetricsLogger


class FakeDeepSpeed:
    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        (Path(save_dir) / tag).mkdir()
        (Path(save_dir) / tag / "model_states.pt").write_bytes(b"weights of step %d" % client_state["step"])


class FakeEngine:
    engine = FakeDeepSpeed()

    def parameters_finite(self):
        return True


class OneRank:
    is_main, rank, world_size, world_group = True, 0, 1, None

    def barrier(self):
        pass

    def on_main(self, what, fn):
        fn()

    def all_gather_objects(self, obj, group=None):
        return [obj]


def save(ckpt: Path, step: int, keep: int, abandoned=()) -> Path:
    return save_checkpoint({"actor": FakeEngine()}, ckpt, step=step, loop_state={"data": {}}, dims=OneRank(),
                           identity={"optim": {}}, keep=keep, abandoned=abandoned)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content (and not UTF-8 any more)
    path.write_bytes(bytes(data))


def step_dirs(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.glob("step_*"))


# -- checkpoints -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep,left", [(1, ["step_5"]), (2, ["step_4", "step_5"])])
def test_a_save_after_a_fallback_removes_the_newer_stale_checkpoints_and_keeps_itself(tmp_path, caplog, keep, left):
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save(ckpt, step, keep=3)
    flip_byte(ckpt / "step_6" / "actor" / "model_states.pt")
    path, notes = find_checkpoint(ckpt)
    assert path == ckpt / "step_4" and "step_6: actor/model_states.pt does not match its checksum" in notes[0]
    with caplog.at_level(logging.INFO, logger="slime.trainer.checkpoint"):
        save(ckpt, 5, keep=keep)  # the resumed run, one step on
    assert step_dirs(ckpt) == left  # the corrupt step_6 is gone, the one just saved is not
    assert (ckpt / "latest").read_text() == "step_5"
    assert find_checkpoint(ckpt) == (ckpt / "step_5", [])
    assert "removing checkpoints a run skipped as unusable when it resumed from an older one: step_6" in caplog.text


@pytest.mark.parametrize("first_save", [8, 6])
def test_a_save_past_a_checkpoint_the_resume_skipped_removes_it_and_keeps_the_good_ones(tmp_path, first_save):
    """Resumed from step_4 past a corrupt step_6, the run's first save at step 8 counted step_6 among the newest
    `keep` and removed step_4: no good fallback was left. (Its first save at step 6 writes over it.)"""
    from slime.trainer.checkpoint import newer_than

    ckpt = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save(ckpt, step, keep=3)
    flip_byte(ckpt / "step_6" / "actor" / "model_states.pt")
    path, _ = find_checkpoint(ckpt)
    assert path == ckpt / "step_4" and newer_than(ckpt, 4) == ["step_6"]
    save(ckpt, first_save, keep=2, abandoned=newer_than(ckpt, 4))
    assert step_dirs(ckpt) == ["step_4", f"step_{first_save}"]
    assert find_checkpoint(ckpt) == (ckpt / f"step_{first_save}", [])
    flip_byte(ckpt / f"step_{first_save}" / "actor" / "model_states.pt")
    assert find_checkpoint(ckpt)[0] == ckpt / "step_4"  # a fallback that verifies


def rename_bytes_key(manifest: dict) -> None:
    for meta in manifest["files"].values():
        meta["size"] = meta.pop("bytes")


@pytest.mark.parametrize("damage,problem", [
    ("flip", "UnicodeDecodeError"),
    ("null", "TypeError"),
    (rename_bytes_key, "KeyError: 'bytes'"),
    (lambda m: m.update(files=list(m["files"])), "AttributeError"),
    (lambda m: m["files"].update({"actor/model_states.pt": 7}), "TypeError"),
    (lambda m: m.pop("loop_state"), "ValueError: no integer 'step' or no 'loop_state'"),
])
def test_a_damaged_manifest_makes_its_checkpoint_unusable_and_the_older_one_is_found(tmp_path, damage, problem):
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4):
        save(ckpt, step, keep=2)
    manifest = ckpt / "step_4" / "manifest.json"
    if damage == "flip":
        flip_byte(manifest)
    elif damage == "null":
        manifest.write_text("null")
    else:
        content = json.loads(manifest.read_text())
        damage(content)
        manifest.write_text(json.dumps(content))
    path, notes = find_checkpoint(ckpt)
    assert path == ckpt / "step_2"
    assert len(notes) == 1 and f"step_4: manifest.json is unreadable or malformed ({problem}" in notes[0]
    # the check before the models load passes over it as the resume does (it crashed on rank 0, the others waiting)
    check_resume_early(ckpt, {"optim": {}, "zero_stage": 3}, OneRank())
    with pytest.raises(ValueError, match=r"step_2 holds ZeRO-3 states but train.ds_config sets ZeRO stage 2"):
        check_resume_early(ckpt, {"optim": {}, "zero_stage": 2}, OneRank())


# -- metrics.jsonl -----------------------------------------------------------------------------------------

def record(step: int, **extra) -> bytes:
    return json.dumps({"step": step, "train/loss": 1.0 / step, **extra}).encode() + b"\n"


def logger_at(run_dir: Path, resume_step) -> MetricsLogger:
    return MetricsLogger(LogConfig(run_dir=str(run_dir)), run_config={}, enabled=True, total_steps=4,
                         resume_step=resume_step)


@pytest.mark.parametrize("tail", [record(3)[:10], b'{"step": 3, "train/lo\xe9s": 0.5}\n'],
                         ids=["torn", "not_utf8"])
def test_an_unreadable_line_past_the_resume_step_is_dropped_with_a_warning(tmp_path, caplog, tail):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(record(1) + record(2) + tail)  # a kill or a full disk while step 3 was written
    log = logger_at(tmp_path, resume_step=2)
    log.close()
    assert metrics.read_bytes() == record(1) + record(2)
    assert "metrics.jsonl:3: dropped an unreadable line after step 2" in caplog.text


@pytest.mark.parametrize("lines", [[record(1), record(2)[:10], record(2, again=1.0)], [record(1), record(2)[:10]]],
                         ids=["in_the_middle", "the_resumed_step_torn"])
def test_an_unreadable_line_at_or_before_the_resume_step_is_an_error_naming_file_and_line(tmp_path, lines):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: unreadable line .* resumed step 2.*repair or delete"):
        logger_at(tmp_path, resume_step=2)
    assert metrics.read_bytes() == b"".join(lines)  # left as it was


@pytest.mark.parametrize("resume_step", [0, None])
def test_a_fresh_start_moves_an_earlier_history_aside(tmp_path, caplog, resume_step):
    metrics, old = tmp_path / "metrics.jsonl", record(1) + record(2)
    metrics.write_bytes(old)
    (tmp_path / "config.json").write_text('{"the": "earlier run\'s settings"}')
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"earlier events")
    (tmp_path / "metrics.png").write_bytes(b"\x89PNG the earlier run's curves")
    (tmp_path / "metrics.jsonl.1.bak").write_text("an even earlier run\n")
    log = logger_at(tmp_path, resume_step)  # checkpoint.resume found no checkpoint
    log.log(1, {"train/loss": 0.5})
    log.close()
    assert (tmp_path / "metrics.jsonl.2.bak").read_bytes() == old  # the first free number
    assert (tmp_path / "config.json.2.bak").read_text() == '{"the": "earlier run\'s settings"}'  # beside it
    assert json.loads((tmp_path / "config.json").read_text()) != {"the": "earlier run's settings"}
    assert (tmp_path / "tensorboard.2.bak" / "events.out.tfevents.1").read_bytes() == b"earlier events"
    assert not (tmp_path / "tensorboard").exists()  # this run's events start afresh
    assert (tmp_path / "metrics.png.2.bak").read_bytes() == b"\x89PNG the earlier run's curves"
    assert not (tmp_path / "metrics.png").exists()  # a kill before this run's plot left the old one beside it
    assert (tmp_path / "metrics.jsonl.1.bak").read_text() == "an even earlier run\n"
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == [{"step": 1, "train/loss": 0.5}]
    assert f"{metrics} holds metrics of an earlier run" in caplog.text and f"moved it to {metrics}.2.bak" in caplog.text


def test_a_fresh_start_with_an_empty_metrics_file_moves_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    logger_at(tmp_path, resume_step=0).close()
    assert not list(tmp_path.glob("*.bak"))


def test_a_resume_with_another_mini_batch_count_keeps_the_schedule_at_its_step(caplog):
    """The schedule counts optimizer updates: 5 of 10 steps at 4 mini-batches is update 20 of 40. Resumed with 1
    mini-batch, the next update is step 6 of 10 on a schedule of 10 updates, not update 20 of 10 (past the end:
    min_lr, here 0, for the rest of the run)."""
    import types

    import torch

    from slime.config import load_config
    from slime.trainer.policy_engine import PolicyEngine, lr_lambda

    cfg = load_config(None, ["model.path=m", "data.path=d.jsonl", "train.num_steps=10", "train.lr=1e-3",
                             "train.warmup_steps=0", "train.min_lr=0", "train.lr_schedule=cosine",
                             "train.num_mini_batches=1"])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    fn = lr_lambda(cfg.train, cfg.train.num_steps * cfg.train.num_mini_batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    scheduler.last_epoch = 5 * 4  # as the checkpoint restores it
    actor = object.__new__(PolicyEngine)
    actor.role, actor.engine = "actor", types.SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer,
                                                              optimizer_params=lambda: {})
    actor.apply_optim_settings(cfg, changed={"train.num_mini_batches": (4, 1)})
    assert scheduler.last_epoch == 5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * fn(5)) and fn(5) > 0.3
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * fn(6))


def test_a_kill_between_the_rename_and_latest_resumes_from_the_new_folder_but_a_rollback_is_kept(tmp_path):
    """step_5 was renamed into place but the save died before `latest` moved on from step_3: step_5 is tried
    first. A `latest` written after step_5 was published (a user rolling back) is still tried first."""
    ckpt = tmp_path / "checkpoints"
    save(ckpt, 3, keep=3)
    save(ckpt, 5, keep=3)
    published = (ckpt / "step_5").stat().st_ctime
    (ckpt / "latest").write_text("step_3")  # as the killed save left it: pointing at the previous checkpoint ...
    os.utime(ckpt / "latest", (published - 60, published - 60))  # ... written before step_5's rename
    assert find_checkpoint(ckpt) == (ckpt / "step_5", [])
    os.utime(ckpt / "latest", (published + 60, published + 60))  # a rollback, written after step_5 was published
    assert find_checkpoint(ckpt) == (ckpt / "step_3", [])
    flip_byte(ckpt / "step_5" / "actor" / "model_states.pt")  # and a damaged newer folder is still skipped
    os.utime(ckpt / "latest", (published - 60, published - 60))
    path, notes = find_checkpoint(ckpt)
    assert path == ckpt / "step_3" and len(notes) == 1 and "step_5" in notes[0]


def test_an_empty_or_damaged_latest_is_ignored_and_named(tmp_path, caplog):
    """An empty `latest` was tried as the tag "", i.e. the checkpoints folder itself ("no manifest.json")."""
    ckpt = tmp_path / "checkpoints"
    save(ckpt, 3, keep=3)
    save(ckpt, 5, keep=3)
    for text in ("", "\x00\x00garbage"):
        (ckpt / "latest").write_text(text)
        with caplog.at_level("ERROR"):
            assert find_checkpoint(ckpt) == (ckpt / "step_5", [])
        assert "not a step_N tag: ignored" in caplog.text


def test_a_save_clears_what_killed_saves_of_other_steps_left(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (3, 7):  # two saves killed mid-way (a stop's save cut off by the launcher's SIGKILL)
        (ckpt / ".partial" / f"step_{step}" / "actor").mkdir(parents=True)
        (ckpt / ".partial" / f"step_{step}" / "actor" / "model_states.pt").write_bytes(b"half a model")
    save(ckpt, 5, keep=2)
    assert not (ckpt / ".partial").exists() or not any((ckpt / ".partial").iterdir())
    assert step_dirs(ckpt) == ["step_5"]


def test_a_resume_drops_the_tensorboard_events_after_its_checkpoint(tmp_path):
    """metrics.jsonl is cut back to the resumed step; the TensorBoard events must be too, or the steps between the
    checkpoint and the kill show twice."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def run(resume_step, steps, value):
        log = MetricsLogger(LogConfig(run_dir=str(tmp_path), tensorboard=True), run_config={}, enabled=True,
                            total_steps=4, resume_step=resume_step)
        for step in steps:
            log.log(step, {"train/loss": value + step})
        log.close()

    run(0, [1, 2, 3], 0.0)  # killed after step 3; the checkpoint is of step 2
    run(2, [3, 4], 10.0)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_a_resume_keeps_the_evaluation_of_its_step_once(tmp_path):
    """The first run evaluated the checkpoint's step: the resumed run keeps that record (and does not evaluate the
    step again: the loop asks `evaluated_at_resume`), and TensorBoard shows each point once, the step's training
    record included."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def logger(resume_step):
        return MetricsLogger(LogConfig(run_dir=str(tmp_path), tensorboard=True), run_config={}, enabled=True,
                             total_steps=4, resume_step=resume_step)

    log = logger(0)  # evaluation every 2 steps, a checkpoint at 2, killed after 3
    assert not log.evaluated_at_resume
    log.log(0, {"eval/accuracy": 0.5})
    for step in (1, 2, 3):
        log.log(step, {"train/loss": float(step)})
        if step == 2:
            log.log(2, {"eval/accuracy": 0.25})
    log.close()
    log = logger(2)
    assert log.evaluated_at_resume
    for step in (3, 4):
        log.log(step, {"train/loss": 10.0 + step})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("eval/accuracy")) for r in records if "eval/accuracy" in r] == [(0, 0.5), (2, 0.25)]
    assert not logger(3).evaluated_at_resume  # step 3 was not evaluated: a resume there evaluates where it is due


def test_a_save_puts_every_file_and_folder_on_disk_before_the_renames_publish_them(tmp_path, monkeypatch):
    """A rename can reach the disk before the data it publishes (ext4's delayed allocation, a power loss): every
    file and folder of the checkpoint is fsynced before the folder is renamed into place, `latest.tmp` before it
    replaces `latest`, and the checkpoints folder after."""
    import os

    import slime.trainer.checkpoint as checkpoint

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                            real_fsync(fd))[1])
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b))[1])
    ckpt = tmp_path / "checkpoints"
    final = save(ckpt, step=3, keep=2)
    staging = str(ckpt / ".partial" / "step_3")
    renamed = events.index(("replace", staging))
    synced = {path for op, path in events[:renamed] if op == "fsync"}
    published = {str(p).replace(str(final), staging) for p in final.rglob("*")} | {staging}
    assert published - synced == set(), "files or folders renamed into place before they were on disk"
    assert {str(final / "manifest.json").replace(str(final), staging), staging + "/actor"} <= synced
    latest = events.index(("replace", str(ckpt / "latest.tmp")))
    assert ("fsync", str(ckpt / "latest.tmp")) in events[renamed:latest]
    assert ("fsync", str(ckpt)) in events[latest:]


def test_a_save_on_ranks_that_see_different_folders_stops_on_every_rank(tiny_model, tmp_path):
    """Two ranks saving to folders of their own (nodes with node-local checkpoint disks) would each hold half a
    checkpoint: the save stops on both with the reason; one shared folder saves and verifies."""
    run_ranks([str(REPO / "tests/dist/ckpt_checks.py"), str(tiny_model), str(tmp_path)])
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert result["shared"] is None  # verifies
        assert result["error"] and "must be on a file system every rank sees" in result["error"]
        assert "rank 1 sees other files there than rank 0" in result["error"]
        assert not result["published"]


def test_a_save_that_fails_to_write_names_the_checkpoint_the_free_space_and_what_is_kept(tmp_path):
    """torch's zip writer on a full disk says only 'unexpected pos N vs M'."""
    import types

    from one_rank import OneRank
    from slime.trainer.checkpoint import save_checkpoint

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 433536 vs 433424")

    actor = types.SimpleNamespace(parameters_finite=lambda: True,
                                  engine=types.SimpleNamespace(save_checkpoint=full_disk))
    (tmp_path / "latest").write_text("step_3")
    with pytest.raises(RuntimeError, match=r"saving checkpoint step_4 into .*step_4 failed on rank 0: .*unexpected "
                                           r"pos .* GiB free on that file system \(a full disk, a quota\?\); the last "
                                           r"complete one \(step_3\) is untouched"):
        save_checkpoint({"actor": actor}, tmp_path, step=4, loop_state={}, dims=OneRank(), identity={})
    # the staging folder cannot be made (a file in its place; a full disk): the raw NotADirectoryError was all
    shutil.rmtree(tmp_path / ".partial")
    (tmp_path / ".partial").write_text("not a folder")
    with pytest.raises(RuntimeError, match=r"saving checkpoint step_4 into .*step_4 failed on rank 0: \[Errno 20\] "
                                           r"Not a directory: .* GiB free on that file system"):
        save_checkpoint({"actor": actor}, tmp_path, step=4, loop_state={}, dims=OneRank(), identity={})


def test_a_zero2_resume_takes_this_runs_clipping_and_adam_eps_and_decay_spares_norms(tiny_model, tmp_path):
    """ZeRO-1/2's optimizer saves its clipping with its states, and the restored param groups held the checkpoint's
    eps: a resume clipped at the old value, while the log said train.grad_clip's new one was applied."""
    proc = run_ranks([str(REPO / "tests/dist/optim_resume_checks.py"), str(tiny_model), str(tmp_path)], nproc=1)
    assert "train.grad_clip 1.0 -> 0.0001, train.ds_config optimizer.params.eps 1e-08 -> 0.001" in proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert {k: result[k] for k in ("clip", "eps")} == {"clip": 0.0001, "eps": [0.001]}
    # weight decay: matrices x (1 - 0.1 * 0.5), every norm gain (and bias) untouched (they were decayed too)
    assert result["decayed"] and result["flat_kept"] and result["flat"] >= 5


def test_a_checkpoint_without_the_critic_this_run_trains_is_refused_and_an_unused_critic_is_said(tmp_path, caplog):
    """A GRPO checkpoint resumed with GAE died in DeepSpeed's bare `assert len(self.ckpt_list) > 0`; a GAE one
    resumed with GRPO dropped the critic's states without a word."""
    import types

    from one_rank import OneRank as FullRank
    from slime.trainer.checkpoint import load_checkpoint

    loads = []
    loader = types.SimpleNamespace(lr_scheduler=None,
                                   load_checkpoint=lambda path, tag, **kw: loads.append(tag) or (path, {}))
    identity = {"optim": {}, "zero_stage": 3}
    save_checkpoint({"actor": FakeEngine()}, tmp_path / "grpo", step=2, loop_state={}, dims=OneRank(),
                    identity=identity)
    with pytest.raises(ValueError, match=r"step_2 holds no critic states: it was written by a run without a critic "
                                         r"\(another algo.advantage_estimator\?\)"):
        load_checkpoint({"actor": loader, "critic": loader}, tmp_path / "grpo", dims=FullRank(), identity=identity)
    assert loads == []
    save_checkpoint({"actor": FakeEngine(), "critic": FakeEngine()}, tmp_path / "gae", step=2, loop_state={},
                    dims=OneRank(), identity=identity)
    assert load_checkpoint({"actor": loader}, tmp_path / "gae", dims=FullRank(), identity=identity)["step"] == 2
    assert loads == ["actor"] and "holds critic states this run does not train" in caplog.text


def test_a_resume_keeps_its_checkpoints_parameter_grouping(tmp_path):
    """Weight decay > 0 puts norm gains and biases in a group of their own; a checkpoint with one group (written
    without decay, or before the groups) was refused, its run lost. The run builds its optimizer as the newest
    checkpoint's manifest says; one of the other grouping (a newer one skipped as unusable) is refused."""
    from one_rank import OneRank as FullRank
    from slime.trainer.checkpoint import load_checkpoint, saved_decay_groups

    assert saved_decay_groups(tmp_path / "none") is None
    save_checkpoint({"actor": FakeEngine()}, tmp_path, step=2, loop_state={}, dims=OneRank(),
                    identity={"optim": {"train.weight_decay": 0.1}, "zero_stage": 3})  # as before: no record
    assert saved_decay_groups(tmp_path) is False
    save_checkpoint({"actor": FakeEngine()}, tmp_path, step=3, loop_state={}, dims=OneRank(),
                    identity={"optim": {"train.weight_decay": 0.1}, "zero_stage": 3, "decay_groups": True})
    assert saved_decay_groups(tmp_path) is True
    (tmp_path / "step_3" / "manifest.json").write_text("{")  # the newest unusable: step_2 is read, the fallback
    assert saved_decay_groups(tmp_path) is False
    (tmp_path / "step_3" / "manifest.json").write_text("null")  # JSON, not a manifest: it crashed every rank
    assert saved_decay_groups(tmp_path) is False
    decayed = {"optim": {"train.weight_decay": 0.1}, "zero_stage": 3, "decay_groups": True}
    with pytest.raises(ValueError, match=r"step_2 holds optimizer states of one, but this run's optimizer has two "
                                         r"\(built as a newer checkpoint, skipped as unusable, says"):
        load_checkpoint({"actor": None}, tmp_path, dims=FullRank(), identity=decayed)


def test_a_checkpoint_of_another_precision_or_critic_model_is_refused_naming_the_setting(tmp_path):
    """Another model.dtype failed in DeepSpeed with a FileNotFoundError for one of its files (as a torn checkpoint
    would: a GPU run's checkpoint resumed on CPU, model.dtype auto); a critic of another model failed on a tensor
    size, or, of the same shapes, was replaced by the checkpoint's without a word."""
    from one_rank import OneRank as FullRank
    from slime.trainer.checkpoint import load_checkpoint

    saved = {"optim": {}, "zero_stage": 3, "dtype": "torch.bfloat16", "critic_path": "/models/critic",
             "critic_config_sha256": "aa"}
    save_checkpoint({"actor": FakeEngine()}, tmp_path, step=2, loop_state={}, dims=OneRank(), identity=saved)
    with pytest.raises(ValueError, match=r"written in torch.bfloat16, this run trains in torch.float32 \(model.dtype; "
                                         r"auto is .*Resume with model.dtype=bfloat16"):
        load_checkpoint({"actor": None}, tmp_path, dims=FullRank(), identity={**saved, "dtype": "torch.float32"})
    for key, value in (("critic_path", "/models/other"), ("critic_config_sha256", "bb")):
        with pytest.raises(ValueError, match=rf"written for {key}=.* but this run has '{value}'.*algo.critic.path"):
            load_checkpoint({"actor": None}, tmp_path, dims=FullRank(), identity={**saved, key: value})
