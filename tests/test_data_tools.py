import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "make_arithmetic", ROOT / "data_tools" / "make_arithmetic.py")
arith = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arith)

_PLAIN = re.compile(r"(\d+)([-+*])(\d+)=")
_CHAT = re.compile(r"What is (\d+)([-+*])(\d+)\? Put the answer in <answer></answer>\.")


def _expression(prompt: str, fmt: str) -> str:
    m = (_PLAIN if fmt == "plain" else _CHAT).fullmatch(prompt)
    assert m, f"prompt {prompt!r} is not in the {fmt} form"
    return "".join(m.groups())


@pytest.mark.parametrize("fmt", ["plain", "chat"])
def test_labels_are_correct(fmt):
    train, eval_ = arith.make_split(n_train=400, n_eval=100, seed=3, min_digits=1, max_digits=3,
                                    ops="+-*", fmt=fmt)
    assert len(train) == 400 and len(eval_) == 100
    for row in train + eval_:
        expr = _expression(row["prompt"], fmt)
        assert row["label"] == str(eval(expr, {"__builtins__": {}}))  # only digits and one op
        assert int(row["label"]) >= 0
        meta = row["metadata"]
        assert f"{meta['a']}{meta['op']}{meta['b']}" == expr
        a, b = (int(x) for x in re.split(r"[-+*]", expr))
        assert all(1 <= len(str(x)) <= 3 for x in (a, b))
    assert {r["metadata"]["op"] for r in train} == {"+", "-", "*"}


def test_no_overlap_and_no_duplicates():
    # 1-digit '+' has exactly 100 problems: asking for all of them forces heavy collisions.
    train, eval_ = arith.make_split(n_train=80, n_eval=20, seed=0, max_digits=1, ops="+")
    prompts = [r["prompt"] for r in train + eval_]
    assert len(set(prompts)) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}


def test_determinism_by_seed():
    kw = dict(n_train=200, n_eval=50, max_digits=2, ops="+-")
    assert arith.make_split(seed=7, **kw) == arith.make_split(seed=7, **kw)
    assert arith.make_split(seed=7, **kw) != arith.make_split(seed=8, **kw)


def test_eval_split_independent_of_n_train():
    _, eval_small = arith.make_split(n_train=10, n_eval=50, seed=1)
    _, eval_big = arith.make_split(n_train=1000, n_eval=50, seed=1)
    assert eval_small == eval_big


@pytest.mark.parametrize("kw,match", [
    (dict(n_train=90, n_eval=20, max_digits=1, ops="+"), "only 100 distinct problems"),
    (dict(n_train=1, n_eval=1, ops="+/"), "ops"),
    (dict(n_train=1, n_eval=1, min_digits=3, max_digits=2), "min_digits"),
    (dict(n_train=1, n_eval=1, fmt="markdown"), "format"),
    (dict(n_train=0, n_eval=5), "n_train >= 1"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        arith.make_split(**kw)


def test_cli_writes_jsonl(tmp_path):
    cmd = [sys.executable, str(ROOT / "data_tools" / "make_arithmetic.py"), "--n-train", "30",
           "--n-eval", "10", "--seed", "0", "--min-digits", "1", "--max-digits", "2", "--ops", "+-"]
    for out in ("a", "b"):
        subprocess.run(cmd + ["--out-dir", str(tmp_path / out)], check=True, capture_output=True)
    for split, n in (("train", 30), ("eval", 10)):
        text = (tmp_path / "a" / f"{split}.jsonl").read_text()
        assert text == (tmp_path / "b" / f"{split}.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines()]
        assert len(rows) == n
        assert all(set(r) == {"prompt", "label", "metadata"} for r in rows)
    bad = subprocess.run(cmd[:-2] + ["--ops", "/", "--out-dir", str(tmp_path / "c")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "ops" in bad.stderr
    subprocess.run(cmd[:4] + ["--n-eval", "0", "--out-dir", str(tmp_path / "d")], check=True, capture_output=True)
    assert (tmp_path / "d" / "train.jsonl").is_file() and not (tmp_path / "d" / "eval.jsonl").exists()


def test_gguf_to_hf_names_a_missing_file_without_a_traceback(tmp_path, monkeypatch, capsys):
    """Each mistake ends in argparse's exit 2 with one line (in-process: any other exception fails the test, as a
    traceback would; a subprocess per case cost ~7 s of imports)."""
    sys.path.insert(0, str(ROOT))
    from data_tools import gguf_to_hf

    (tmp_path / "not.gguf").write_bytes(b"not a gguf file at all")  # a ValueError traceback before
    for gguf, words in [(tmp_path / "none.gguf", f"GGUF file {tmp_path / 'none.gguf'} does not exist"),
                        (tmp_path, f"GGUF file {tmp_path} is a directory"),
                        (tmp_path / "not.gguf", f"could not convert {tmp_path / 'not.gguf'}: ")]:
        monkeypatch.setattr(sys, "argv", ["gguf_to_hf.py", "--out", str(tmp_path / "o"), "--gguf", str(gguf)])
        with pytest.raises(SystemExit) as exit_:
            gguf_to_hf.main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err, err[-2000:]


def test_make_vl_task_refuses_counts_it_cannot_honour_and_writes_no_empty_eval_file(tmp_path):
    """--n-eval 0 wrote an empty eval.jsonl, which the trainer refuses; a negative --n-eval wrote fewer train rows
    than the summary said."""
    tool = [sys.executable, str(ROOT / "data_tools" / "make_vl_task.py"), "--out-dir"]
    done = subprocess.run(tool + [str(tmp_path / "a"), "--n-train", "3", "--n-eval", "0"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and "(no eval split)" in done.stdout, done.stderr
    assert len((tmp_path / "a" / "train.jsonl").read_text().splitlines()) == 3
    assert not (tmp_path / "a" / "eval.jsonl").exists()
    for n_train, n_eval in (("4", "-2"), ("0", "1")):
        bad = subprocess.run(tool + [str(tmp_path / "b"), "--n-train", n_train, "--n-eval", n_eval],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and "--n-train must be >= 1 and --n-eval >= 0" in bad.stderr


@pytest.mark.parametrize("tool, sizes", [("make_vl_task.py", ("3", "2")), ("make_arithmetic.py", ("6", "2"))])
def test_no_eval_split_over_an_earlier_one_removes_its_file(tmp_path, tool, sizes):
    """--n-eval 0 into a folder of an earlier run left its eval.jsonl, whose rows (drawn first) are now the start
    of the new train split: a run reading the folder's eval.jsonl evaluated on training data."""
    run = [sys.executable, str(ROOT / "data_tools" / tool), "--out-dir", str(tmp_path)]
    subprocess.run(run + ["--n-train", sizes[0], "--n-eval", sizes[1]], check=True, capture_output=True)
    stale = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    done = subprocess.run(run + ["--n-train", sizes[0], "--n-eval", "0"], capture_output=True, text=True)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert any(row["label"] == old["label"] for row in train for old in stale)  # why it must go
    assert done.returncode == 0 and not (tmp_path / "eval.jsonl").exists()
    assert "removed" in done.stdout and "eval.jsonl of an earlier run" in done.stdout


def test_tools_that_replace_a_folder_refuse_one_holding_other_files(tmp_path):
    """gguf_to_hf and the tiny-model builds replace --out (and --work-dir): a mistyped path to a folder of the
    user's own files is refused before anything is deleted; an empty folder, a model folder, or the build's own
    init/ and sft/ are replaced."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    sys.path.insert(0, str(ROOT))
    from data_tools import check_replaceable
    from data_tools.gguf_to_hf import gguf_to_hf

    with pytest.raises(SystemExit, match=r"--out .*data holds files this tool did not write \(train.jsonl\)"):
        gguf_to_hf(fake, data, overwrite=True)
    assert (data / "train.jsonl").is_file()
    work = tmp_path / "work"
    (work / "init").mkdir(parents=True)
    (work / "sft").mkdir()
    check_replaceable(work, "--work-dir", ours=("init", "sft"))
    check_replaceable(tmp_path / "absent", "--out")
    (work / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"--work-dir .*work holds files this tool did not write \(init, notes.txt"):
        check_replaceable(work, "--work-dir", ours=("init", "sft"))
    out = subprocess.run([sys.executable, str(ROOT / "data_tools" / "build_tiny_arith.py"), "--out", str(data),
                          "--data-dir", str(tmp_path / "d"), "--work-dir", str(tmp_path / "w")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "holds files this tool did not write" in out.stderr
    assert (data / "train.jsonl").is_file() and not (tmp_path / "d").exists()


@pytest.mark.parametrize("args, words", [
    (["--hidden", "30"], "--hidden 30 must be a positive multiple of 8"),  # wrote a model whose forward failed
    (["--hidden", "0"], "--hidden 0 must be a positive multiple of 8"),  # a ZeroDivisionError
    (["--layers", "0"], "--layers 0 must be >= 1"),
])
def test_make_tiny_model_refuses_sizes_it_cannot_build(tmp_path, args, words):
    proc = subprocess.run([sys.executable, str(ROOT / "data_tools/make_tiny_model.py"), "--out", str(tmp_path / "m"),
                           *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and words in proc.stderr and not (tmp_path / "m").exists()


def test_the_tiny_model_builds_take_relative_paths_from_the_callers_folder(tmp_path, monkeypatch):
    """The data and the init were written relative to the caller's folder, then the SFT job (run in the repository)
    read model.path=w/init relative to the repository: it failed, after making a stray w/sft folder there."""
    sys.path.insert(0, str(ROOT))
    from data_tools import build_tiny_arith

    seen = {}
    monkeypatch.setattr(build_tiny_arith.subprocess, "run", lambda cmd, **kw: seen.update(cmd=cmd, **kw))
    monkeypatch.chdir(tmp_path)
    build_tiny_arith.run_sft(init=Path("w/init"), data_dir=Path("d"), run_dir=Path("w/sft"), nproc=1, overrides=[])
    assert seen["cwd"] == ROOT
    for arg in (f"model.path={tmp_path / 'w/init'}", f"data.path={tmp_path / 'd/train.jsonl'}",
                f"eval.path={tmp_path / 'd/eval.jsonl'}", f"log.run_dir={tmp_path / 'w/sft'}"):
        assert arg in seen["cmd"]
