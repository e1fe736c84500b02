"""Atomic, verified checkpoints: DeepSpeed engine states, loop state and per-rank RNG.

A checkpoint is written into `checkpoints/.partial/step_N/` and becomes visible only when it is whole:
every rank has written its engine files and RNG state, rank 0 has written `manifest.json` (size and
SHA-256 of every file, the step, the model it came from and the optimisation settings), the folder
has been renamed to `checkpoints/step_N/`, and then `checkpoints/latest` is replaced atomically. Files and
folders are synced to disk (fsync) before each rename publishes them. A kill at any moment leaves a whole
checkpoint to resume from: the previous one, or the new one when only `latest` was left to replace. Only the newest `checkpoint.keep` up to the saved step
survive; newer ones, left by a run that resumed from an older checkpoint, are removed.

Resuming verifies the manifest of `latest`; a torn or corrupt checkpoint is reported and the newest
older one that verifies is used. A checkpoint of another model is refused; changed optimisation
settings are applied to the restored optimizer and scheduler and said so.

Layout: step_N/<role>/ (DeepSpeed's files for the actor and, with PPO, the critic), step_N/rng_rank{r}.pt,
step_N/manifest.json, and with a one-step-off rollout the batch in flight, step_N/ahead_rank{r}.pt. Like
DeepSpeed's own, checkpoints need a file system every rank sees; a save checks that every rank sees the same files
and otherwise stops, on every rank, saying so.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from slime.utils.fs import fsync_path

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PARTIAL = ".partial"


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sha256(path: Path, sync: bool = False) -> str:
    """The file's SHA-256; `sync`: and its data on disk (fsync) before the hash is returned."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _step_of(tag: str) -> int:
    return int(tag.removeprefix("step_")) if tag.startswith("step_") and tag[5:].isdigit() else -1


def newer_than(ckpt_dir: Path, step: int) -> list[str]:
    """The step folders in `ckpt_dir` past `step`: after a resume from `step`, those it skipped as unusable."""
    return sorted(p.name for p in ckpt_dir.glob("step_*") if _step_of(p.name) > step)


def save_checkpoint(engines: dict, ckpt_dir: Path, *, step: int, loop_state: dict, dims, identity: dict,
                    keep: int = 2, abandoned: Iterable[str] = (), rank_files: dict[str, bytes] | None = None) -> Path:
    """Collective. `engines`: role -> PolicyEngine. `step` is the number of completed steps (resuming
    starts there); `identity` (model and optimisation settings) is recorded in the manifest. `abandoned`: step
    folders the resume skipped as unusable (`newer_than`), removed with this save (give them to the first save
    after the resume only: a later one may be this run's own of the same step). `rank_files`: name -> bytes this
    rank writes as well (every rank the same names: `rank_file_name`), verified with the rest."""
    if not all(e.parameters_finite() for e in engines.values()):
        raise RuntimeError(f"not saving step {step}: parameters are not finite (a checkpoint must never hold them)")
    tag = f"step_{step}"
    staging = ckpt_dir / PARTIAL / tag

    def failed(e: BaseException) -> RuntimeError:
        existing = next((p for p in (staging, *staging.parents) if p.exists()), None)
        free = shutil.disk_usage(existing).free if existing is not None else None
        latest = ckpt_dir / "latest"
        kept = f"the last complete one ({latest.read_text().strip()}) is untouched" if latest.is_file() else \
            "no earlier checkpoint exists"
        return RuntimeError(f"saving checkpoint {tag} into {staging} failed on rank {dims.rank}: {e}. "
                            f"{'?' if free is None else f'{free / 2**30:.2f} GiB'} free on that file system (a "
                            f"full disk, a quota?); {kept}. Free space under log.run_dir, or lower checkpoint.keep")

    def clear() -> None:
        # What killed saves left behind, of any step (a stop saves at whatever step the signal came): one
        # save runs at a time, so nothing in there is in use, and each would hold a model's worth of disk.
        shutil.rmtree(ckpt_dir / PARTIAL, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
        except OSError as e:  # a full disk, or a file where the folder goes: said as the save's other failures
            raise failed(e) from e

    dims.on_main(f"clearing {ckpt_dir / PARTIAL}", clear)
    try:
        for role, engine in engines.items():
            engine.engine.save_checkpoint(str(staging), tag=role, client_state={"step": step, **loop_state},
                                          save_latest=False)
        torch.save(_rng_state(), staging / f"rng_rank{dims.rank}.pt")
        for name, blob in (rank_files or {}).items():
            (staging / rank_file_name(name, dims.rank)).write_bytes(blob)
    except (OSError, RuntimeError) as e:  # a full disk reads "unexpected pos N vs M" from torch's zip writer
        raise failed(e) from e
    dims.barrier()  # every rank's files are complete
    final = ckpt_dir / tag
    # Every rank hashes its share of the files (a large model's checkpoint, hashed by one rank, outlasts the
    # others' wait in the next collective) and puts them on disk (fsync: the renames below must not become
    # durable before the data they publish, or a power loss could leave a `latest` naming empty files); rank 0
    # writes the manifest of them all.
    everything = sorted(p for p in staging.rglob("*") if p.is_file())
    _check_same_files(staging, [str(p.relative_to(staging)) for p in everything], dims)
    mine = {str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": _sha256(p, sync=True)}
            for p in everything[dims.rank::dims.world_size]}
    shares = dims.all_gather_objects(mine, group=dims.world_group) if dims.world_size > 1 else [mine]

    def publish() -> None:  # rank 0 alone: the others wait outside the collectives' timeout (dims.on_main)
        files = dict(sorted((name, meta) for share in shares for name, meta in share.items()))
        manifest = {"step": step, "loop_state": loop_state, "world_size": dims.world_size, **identity,
                    "files": files}
        _write_durably(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for folder in sorted({p.parent for p in everything} | {staging}, key=lambda p: -len(p.parts)):
            fsync_path(folder)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _write_durably(ckpt_dir / "latest.tmp", tag)
        os.replace(ckpt_dir / "latest.tmp", ckpt_dir / "latest")
        fsync_path(ckpt_dir)
        saved = sorted((p for p in ckpt_dir.glob("step_*") if _step_of(p.name) >= 0), key=lambda p: _step_of(p.name))
        # Folders the resume fell back past (unusable: torn, corrupt) are of an abandoned timeline: left in place
        # they would count among the newest kept and push out a good one, or the one just written. Those above
        # `step` are of one as well, whoever left them.
        skipped = set(abandoned)
        stale = [p for p in saved if _step_of(p.name) > step or (p.name in skipped and p != final)]
        if stale:
            logger.warning("removing checkpoints a run skipped as unusable when it resumed from an older one: %s",
                           ", ".join(p.name for p in stale))
        for old in stale + [p for p in saved if p not in stale][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s (%d files)", final, len(files))

    # the manifest, the renames and the pruning of old checkpoints (a large model's, on a network file system)
    dims.on_main(f"publishing checkpoint {tag}", publish)
    return final


def rank_file_name(name: str, rank: int) -> str:
    """The file of `save_checkpoint(rank_files={name: ...})` that `rank` wrote."""
    return f"{name}_rank{rank}.pt"


def _check_same_files(staging: Path, names: list[str], dims) -> None:
    """Collective: every rank must see the same files in the staging folder once all have written theirs. Ranks
    on nodes whose `log.run_dir` is a disk of their own (not one file system) each see only their node's share;
    such a checkpoint could never be resumed, so the save stops here, on every rank alike, saying why."""
    if dims.world_size == 1:
        return
    listings = dims.all_gather_objects(names, group=dims.world_group)
    differ = [r for r, seen in enumerate(listings) if seen != listings[0]]
    if differ:
        r = differ[0]
        only_0, only_r = sorted(set(listings[0]) - set(listings[r])), sorted(set(listings[r]) - set(listings[0]))
        raise RuntimeError(
            f"checkpoint {staging}: rank {r} sees other files there than rank 0 ({len(only_0)} only rank 0 sees, "
            f"e.g. {only_0[:2]}; {len(only_r)} only rank {r} sees, e.g. {only_r[:2]}; ranks that differ: {differ}). "
            "log.run_dir (where checkpoints go) must be on a file system every rank sees (on several nodes: a shared "
            "mount, not a node-local disk), or each node would hold only its part of the checkpoint")


MANIFEST_DAMAGE = (OSError, ValueError, KeyError, TypeError, AttributeError)


def read_manifest(path: Path) -> tuple[dict, dict]:
    """The manifest of the checkpoint at `path` and its files' (bytes, sha256); one of MANIFEST_DAMAGE if it is
    unreadable or malformed."""
    content = json.loads((path / MANIFEST).read_bytes())
    files = {name: (meta["bytes"], meta["sha256"]) for name, meta in content["files"].items()}
    if not isinstance(content.get("step"), int) or not isinstance(content.get("loop_state"), dict):
        raise ValueError("no integer 'step' or no 'loop_state'")  # load_checkpoint reads both
    return content, files


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """None if the checkpoint at `path` is whole and unchanged, else what is wrong with it. `share` = (k, n):
    check only every n-th file from the k-th (n ranks check a checkpoint together)."""
    if not path.is_dir():
        return "its folder does not exist"
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (an incomplete or pre-manifest checkpoint)"
    try:  # any damage (a flipped byte, a lost key, a wrong type) makes the checkpoint unusable, not the resume
        files = read_manifest(path)[1]
    except MANIFEST_DAMAGE as e:
        return f"manifest.json is unreadable or malformed ({type(e).__name__}: {e})"
    for name, (size, sha256) in sorted(files.items())[share[0]::share[1]]:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size} (truncated?)"
        if _sha256(f) != sha256:
            return f"{name} does not match its checksum (overwritten or corrupt)"
    return None


def candidates(ckpt_dir: Path) -> list[str]:
    """Checkpoint tags to try, `latest` first, then the step folders newest first. A step folder published after
    `latest` was last written (its rename, which sets the folder's ctime, is newer than the file) and of a later
    step comes before it: a kill between a save's rename and its `latest` lost only the pointer. A `latest` a
    user wrote afterwards, to roll back, is newer than every folder and still comes first."""
    latest = ckpt_dir / "latest"
    folders = [p.name for p in sorted(ckpt_dir.glob("step_*"), key=lambda p: -_step_of(p.name))]
    if not latest.is_file():
        return folders
    tag = latest.read_bytes().decode("utf-8", "replace").strip()  # damage: the fallback finds older ones
    if not re.fullmatch(r"step_\d+", tag):  # empty or damaged: "" would name the checkpoints folder itself
        logger.error("checkpoint pointer %s holds %r, not a step_N tag: ignored", latest, tag[:80])
        return folders
    written = latest.stat().st_mtime
    later = [t for t in folders if _step_of(t) > _step_of(tag) and (ckpt_dir / t).stat().st_ctime > written]
    return later + [tag] + [t for t in folders if t != tag and t not in later]


def saved_decay_groups(ckpt_dir: Path) -> bool | None:
    """Whether the newest checkpoint with a well-formed manifest keeps weight decay off norm gains and biases (its
    optimizer has two parameter groups); False for one written before that was recorded; None where there is none."""
    for tag in candidates(ckpt_dir) if ckpt_dir.is_dir() else []:
        try:
            return bool(read_manifest(ckpt_dir / tag)[0].get("decay_groups", False))
        except MANIFEST_DAMAGE:  # a damaged one (JSON null: it crashed every rank) is passed over, as the resume does
            continue
    return None


def find_checkpoint(ckpt_dir: Path, verify=verify, tags: list[str] | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies (of `tags`, default `candidates`), and a note for each one skipped."""
    notes: list[str] = []
    for tag in candidates(ckpt_dir) if tags is None else tags:
        problem = verify(ckpt_dir / tag)
        if problem is None:
            return ckpt_dir / tag, notes
        notes.append(f"{ckpt_dir / tag}: {problem}")
    return None, notes


def check_manifest(path: Path, manifest: dict, identity: dict, world_size: int) -> None:
    """A checkpoint of another model, or laid out for another precision, ZeRO stage, ep or rank count, is refused
    naming the setting (DeepSpeed's states are per layout: nothing is converted)."""
    for key in ("model_path", "model_config_sha256"):
        if manifest.get(key) != identity.get(key):
            raise ValueError(f"{path} was written for {key}={manifest.get(key)!r} but this run has "
                             f"{identity.get(key)!r}: resuming would load another model's weights. Use a new "
                             "log.run_dir for this model (or move the old run's folder away)")
    for key in ("critic_path", "critic_config_sha256"):  # recorded since they were checked (and only with a critic)
        if key in manifest and key in identity and manifest[key] != identity[key]:
            raise ValueError(f"{path} was written for {key}={manifest[key]!r} but this run has {identity[key]!r}: "
                             "resuming would load another critic's states. Set algo.critic.path as it was, or use a "
                             "new log.run_dir")
    if "dtype" in manifest and manifest["dtype"] != identity.get("dtype"):  # recorded since it was checked
        raise ValueError(f"{path} was written in {manifest['dtype']}, this run trains in {identity.get('dtype')} "
                         "(model.dtype; auto is bfloat16 on a GPU, float32 on CPU): DeepSpeed lays the states out "
                         f"per precision. Resume with model.dtype={str(manifest['dtype']).removeprefix('torch.')}, or "
                         "start a new log.run_dir")
    saved_stage = manifest.get("zero_stage", 3)  # recorded since ZeRO-2 was offered; before, the configs were ZeRO-3
    if saved_stage != identity.get("zero_stage"):
        raise ValueError(f"{path} holds ZeRO-{saved_stage} states but train.ds_config sets ZeRO stage "
                         f"{identity.get('zero_stage')}; DeepSpeed lays the states out per stage, so resume with a "
                         f"ZeRO-{saved_stage} config (or start a new log.run_dir)")
    saved_ep = manifest.get("parallel_ep", 1)  # recorded since resuming at another ep was refused
    if saved_ep != identity.get("parallel_ep", 1):
        raise ValueError(f"{path} was written with parallel.ep={saved_ep}, this run has parallel.ep="
                         f"{identity.get('parallel_ep', 1)}; resume with parallel.ep={saved_ep} (expert parallelism "
                         "lays the experts' modules and states out per ep), or start a new log.run_dir")
    if manifest.get("world_size") != world_size:
        raise ValueError(f"{path} was written by {manifest.get('world_size')} ranks, this run has {world_size}; "
                         "resume with the same number of ranks (DeepSpeed's ZeRO partitions are per rank)")


def check_resume_early(ckpt_dir: Path, identity: dict, dims) -> None:
    """Collective, before any model loads: the newest checkpoint's manifest against this run's model and layout
    (check_manifest), so that a refused resume comes in seconds, not after the models, the engines and the hashes
    of every checkpoint file. The resume checks it again on the checkpoint it picks."""
    problem = None
    if dims.is_main:
        for tag in candidates(ckpt_dir) if ckpt_dir.is_dir() else []:
            try:
                manifest = read_manifest(ckpt_dir / tag)[0]
            except MANIFEST_DAMAGE:
                continue  # unusable: the resume's verification says so, and falls back to an older one
            try:
                check_manifest(ckpt_dir / tag, manifest, identity, dims.world_size)
            except ValueError as e:
                problem = str(e)
            break
    problem = dims.all_gather_objects(problem, group=dims.world_group)[0]  # every rank, whatever rank 0 met
    if problem:
        raise ValueError(problem)


def load_checkpoint(engines: dict, ckpt_dir: Path, *, dims, identity: dict) -> dict | None:
    """Collective. Restore the newest good checkpoint; returns its loop state (with 'step') or None when
    there is none. Raises when checkpoints exist but none verifies, or they are of another model."""
    def together(path: Path) -> str | None:  # every rank checks its share of the files (a collective)
        problems = dims.all_gather_objects(verify(path, (dims.rank, dims.world_size)), group=dims.world_group)
        return next((p for p in problems if p), None)

    # Every rank walks rank 0's candidates, each one collectively, so all take the same number of collectives.
    tags = dims.all_gather_objects(candidates(ckpt_dir) if dims.is_main else None, group=dims.world_group)[0]
    path, notes = find_checkpoint(ckpt_dir, verify=together, tags=tags)
    if dims.is_main:
        for note in notes:
            logger.error("checkpoint not usable, skipped: %s", note)
        if path is not None and notes:
            newer = any(_step_of(t) > _step_of(path.name) and (ckpt_dir / t).is_dir() for t in tags)
            logger.warning("resuming from %s checkpoint %s", "the older" if newer else "the", path)
    if path is None:
        if notes:
            raise ValueError(f"{ckpt_dir} holds checkpoints but none is usable:\n  " + "\n  ".join(notes) +
                             "\nmove the folder away to start over, or set checkpoint.resume=false with a new "
                             "log.run_dir")
        return None
    path = Path(path)
    manifest = read_manifest(path)[0]  # verified above
    check_manifest(path, manifest, identity, dims.world_size)
    saved_groups, groups = manifest.get("decay_groups", False), identity.get("decay_groups", False)
    if saved_groups != groups:  # the run built its optimizer as the newest checkpoint's manifest says
        raise ValueError(f"{path} holds optimizer states of {'two parameter groups' if saved_groups else 'one'}, but "
                         f"this run's optimizer has {'two' if groups else 'one'} (built as a newer checkpoint, "
                         "skipped as unusable, says; weight decay leaves norm gains and biases out in two): the "
                         "states would not fit. Move the unusable checkpoints out of the checkpoints folder and "
                         "rerun")
    saved_roles = {name.split("/", 1)[0] for name in manifest.get("files", {}) if "/" in name}
    missing = [role for role in engines if role not in saved_roles]
    if missing:  # DeepSpeed's own words: a bare AssertionError in its checkpoint list
        raise ValueError(f"{path} holds no {missing[0]} states: it was written by a run without a {missing[0]} "
                         "(another algo.advantage_estimator?). Resume with that run's algorithm, or start a new "
                         "log.run_dir")
    if unused := sorted(saved_roles - set(engines)):
        logger.warning("%s holds %s states this run does not train (another algo.advantage_estimator?): they are "
                       "not loaded, and the checkpoints this run writes will not hold them", path, ", ".join(unused))
    for role, engine in engines.items():
        # A critic saved before it followed the lr schedule holds no scheduler state (its rate was constant)
        unscheduled = role == "critic" and not manifest.get("critic_schedule") and engine.lr_scheduler is not None
        loaded, _ = engine.load_checkpoint(str(path), tag=role, load_lr_scheduler_states=not unscheduled)
        if loaded is None:
            raise RuntimeError(f"{path}/{role}: DeepSpeed could not load the {role}'s states")
        if unscheduled:
            engine.lr_scheduler.last_epoch = manifest["step"] * manifest["optim"].get("train.num_mini_batches", 1)
            logger.warning("%s was saved when the critic's learning rate was constant: from here on it follows the "
                           "schedule (train.warmup_steps, lr_schedule, min_lr) at its step", path)
    _set_rng_state(torch.load(path / f"rng_rank{dims.rank}.pt", weights_only=False))
    changed = {k: (manifest["optim"].get(k), v) for k, v in identity["optim"].items()
               if manifest.get("optim", {}).get(k) != v}
    logger.info("resumed from %s at step %d", path, manifest["step"])
    return {"step": manifest["step"], **manifest["loop_state"], "changed_optim": changed, "path": path}
