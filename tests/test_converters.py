"""data_tools converters on tiny fixtures in the public datasets' own column layouts (no downloads), and the
length/packing report on a converted file."""
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from PIL import Image

from data_tools.convert_dataset import convert, last_boxed, load
from slime.config import DataConfig

ROOT = Path(__file__).resolve().parents[1]


def write_parquet(path, columns, features=None):
    datasets.Dataset.from_dict(columns, features=features).to_parquet(path)
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gsm8k(tmp_path):
    src = write_parquet(tmp_path / "train-00000.parquet", {
        "question": ["Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. "
                     "How many clips did she sell altogether?", "A broken row?"],
        "answer": ["In May she sold 48/2 = 24 clips.\nAltogether 48+24 = 72 clips.\n#### 72", "no marker here"]})
    written, skipped, _ = convert("gsm8k", load(str(src), "train"), tmp_path / "out.jsonl")
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert (written, skipped) == (1, {"without a usable answer": 1})
    assert rows[0]["label"] == "72" and rows[0]["prompt"].startswith("Natalia sold clips")
    assert rows[0]["metadata"] == {"source": "gsm8k", "row": 0}


def test_math_takes_the_last_boxed_answer_with_nested_braces(tmp_path):
    assert last_boxed(r"so \boxed{2} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"first \boxed{3} final $\boxed 5$.") == "5"  # the form without braces, when last
    assert last_boxed(r"\boxed 5 then \boxed{6}") == "6"
    assert last_boxed(r"so \boxed{3} and \boxed ") == "3"
    assert last_boxed(r"\boxed 5 and \boxed ") == "5"
    src = write_parquet(tmp_path / "test.parquet", {
        "problem": ["What is $1/2 + 0$?", "No answer"],
        "solution": [r"Adding zero: $\boxed{\frac{1}{2}}$", "none"],
        "level": ["Level 1", "Level 2"], "type": ["Algebra", "Algebra"]})
    written, skipped, _ = convert("math", load(str(src), "test"), tmp_path / "out.jsonl")
    row = read_jsonl(tmp_path / "out.jsonl")[0]
    assert (written, skipped) == (1, {"without a usable answer": 1}) and row["label"] == r"\frac{1}{2}"
    assert row["metadata"]["level"] == "Level 1" and "boxed" in row["prompt"]


def test_dapo_math_keeps_the_chat_prompt(tmp_path):
    src = tmp_path / "dapo.parquet"
    write_parquet(src, {
        "data_source": ["math_dapo"], "ability": ["MATH"],
        "prompt": [[{"role": "user", "content": "Solve 2x=4. Answer: $Answer"}]],
        "reward_model": [{"ground_truth": "2", "style": "rule-lighteval/MATH_v2"}],
        "extra_info": [{"index": "a1"}]})
    convert("dapo_math", load(str(src), "train"), tmp_path / "out.jsonl")
    row = read_jsonl(tmp_path / "out.jsonl")[0]
    assert row["messages"] == [{"role": "user", "content": "Solve 2x=4. Answer: $Answer"}] and row["label"] == "2"


def test_geometry3k_writes_images_and_loads_as_image_text(tmp_path):
    from transformers import AutoTokenizer

    from data_tools.make_tiny_model import make_tiny_model
    from slime.data.prompts import load_prompts
    from slime.multimodal.processor import VLProcessor

    buf = io.BytesIO()
    Image.new("RGB", (80, 60), (255, 255, 255)).save(buf, format="PNG")
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    src = write_parquet(tmp_path / "train.parquet", {
        "images": [[{"bytes": buf.getvalue(), "path": None}], [{"bytes": buf.getvalue(), "path": None}]],
        "problem": ["<image>Find x. Choices: A: 3 B: 4", "Find y."], "answer": ["A", "4"]}, features)
    out = tmp_path / "geo" / "train.jsonl"
    written, _, _ = convert("geometry3k", load(str(src), "train"), out)
    rows = read_jsonl(out)
    assert written == 2 and rows[0]["images"] == ["images/train_00000_0.png"] and rows[0]["label"] == "A"
    # (named after the output file: a test split converted beside it writes images of its own)
    assert rows[1]["prompt"] == "<image>Find y."  # no placeholder in the source: the image goes first
    model = make_tiny_model(tmp_path / "vl", arch="qwen2_vl", seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    prompts, report = load_prompts(DataConfig(path=str(out)), tok, processor=VLProcessor(str(model), tok))
    assert len(prompts) == 2 and not report.skipped


def test_length_report_on_a_converted_file(tmp_path, tiny_model):
    from data_tools.length_report import report

    src = write_parquet(tmp_path / "train.parquet", {
        "question": [f"What is {i} + {i}?" * (1 + i % 5) for i in range(40)],
        "answer": [f"#### {2 * i}" for i in range(40)]})
    convert("gsm8k", load(str(src), "train"), tmp_path / "gsm8k.jsonl")
    r = report(str(tmp_path / "gsm8k.jsonl"), str(tiny_model), max_tokens=512, response_len=64, dp=2, batch=8, n=4)
    assert r["prompts"] == 40 and r["min"] <= r["median"] <= r["p90"] <= r["max"]
    assert r["packed"]["real_token_fraction"] == 1.0 and 0 < r["packed"]["budget_fill"] <= 1.0
    assert r["padded"]["real_token_fraction"] < 1.0  # padding wastes what packing does not


def test_length_report_reads_sft_data_as_sft_does(tmp_path, tiny_model):
    """With algo.policy_loss=sft the tool refused chats ending in the assistant's reply (naming the setting the
    config already had) and reported RL's packing, n samples of random lengths per prompt."""
    from transformers import AutoTokenizer

    from data_tools.length_report import report
    from slime.config import DataConfig

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "3+3="},
                                             {"role": "assistant", "content": "66"}]}) + "\n")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "3+3="}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False).input_ids
    row = len(prompt) + 2  # + "66" + the turn's end, less the last token (a target only)
    r = report(DataConfig(path=str(data)), str(tiny_model), max_tokens=64, response_len=8, dp=1, batch=4, n=4,
               sft=True)
    assert r["packed"]["num_micro_batches"] == 1
    assert r["packed"]["budget_fill"] == pytest.approx(4 * row / 64)  # 4 prompts, one sample each
    tool = [sys.executable, str(ROOT / "data_tools" / "length_report.py"), "--data", str(data), "--model",
            str(tiny_model), "--dp", "1", "--batch", "2", "--n", "1"]
    done = subprocess.run(tool + ["algo.policy_loss=sft"], capture_output=True, text=True)
    assert done.returncode == 0 and "one sample per prompt, its label as the response" in done.stdout, done.stderr


def test_length_report_plans_each_mini_batch_and_shares_prompts_as_the_run(tmp_path, tiny_model):
    """It planned the whole batch at once with every sample's own prompt copy: 3x the micro-batches a CPU run took
    (shared prompts are on there), and no notion of train.num_mini_batches."""
    from transformers import AutoTokenizer

    from data_tools.length_report import report

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+1="}) + "\n" for _ in range(8)))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    length = len(tok(tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False).input_ids)
    kw = dict(max_tokens=4096, response_len=8, dp=1, batch=4, n=4)  # each mini-batch in one micro-batch
    for minis in (1, 2):
        own = report(str(data), str(tiny_model), num_mini_batches=minis, **kw)["packed"]
        shared = report(str(data), str(tiny_model), num_mini_batches=minis, share_prompts=True, **kw)["packed"]
        assert own["num_micro_batches"] == shared["num_micro_batches"] == 1
        # the same draws: each micro-batch carries each of its 4 / minis prompts once instead of 4 times
        assert (own["budget_fill"] - shared["budget_fill"]) * 4096 == pytest.approx(3 * length * 4 / minis)
    with pytest.raises(ValueError, match="train.num_mini_batches=32 is more than the 16 samples a step has"):
        report(str(data), str(tiny_model), num_mini_batches=32, **kw)


def length_report(capsys, *argv):
    """data_tools/length_report.py run in this process (each run of the script as a process imports torch and
    transformers again): its exit code, stdout and stderr."""
    from data_tools.length_report import main

    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_length_report_errors_name_its_own_flags(tmp_path, tiny_model, capsys):
    """The trainer's messages name trainer settings; this tool's say its flags, and come without a traceback."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "one two three four five six seven"}\n')
    tool = ["--dp", "1", "--batch", "2", "--n", "2"]
    code, _, err = length_report(capsys, *tool, "--data", str(data), "--model", str(tiny_model),
                                 "--max-tokens-per-gpu", "4")
    assert code == 2 and "Traceback" not in err, err
    assert "Raise --max-tokens-per-gpu to at least" in err and "--response-len" in err
    code, _, err = length_report(capsys, *tool, "--data", str(data), "--model", str(tmp_path / "nope"))
    assert code == 2 and f"--model={tmp_path / 'nope'} is not a directory" in err


def test_converters_skip_rows_without_a_usable_answer(tmp_path, capsys):
    """Also those whose question is empty (the instruction alone was written as the prompt), and the rows skipped
    are named (only counted before). A row of nulls has no usable answer (a null question beside an answer is an
    error naming the row: the next test)."""
    rows = [{"question": "1+1?", "answer": "so #### 2"}, {"question": "?", "answer": "nothing after ####"},
            {"question": "?", "answer": "no marker"}, {"question": " ", "answer": "#### 5"},
            {"question": None, "answer": None}]
    assert convert("gsm8k", rows, tmp_path / "g.jsonl") == (1, {"without a usable answer": 3,
                                                                "with an empty question": 1}, 0)
    out = capsys.readouterr().out
    assert "skipped 3 row(s) without a usable answer: rows 2, 3, 5" in out and "with an empty question: row 4" in out
    assert convert("math", [{"problem": "", "solution": "\\boxed{1}"}, {"problem": "x?", "solution": "\\boxed{2}"}],
                   tmp_path / "m.jsonl") == (1, {"with an empty problem": 1}, 0)
    dapo = [{"prompt": [{"content": "no role"}], "reward_model": {"ground_truth": "1"}},
            {"prompt": [{"role": "user", "content": "1+0?"}], "reward_model": {"ground_truth": "1"}}]
    assert convert("dapo_math", dapo, tmp_path / "d.jsonl") == (1, {"messages not in role/content form": 1}, 0)
    (tmp_path / "x.png").write_bytes(b"")
    with pytest.raises(SystemExit, match="unsupported file type '.png'"):
        load(str(tmp_path / "x.png"), "train")


def test_a_local_folder_reads_the_split_of_one_subset(tmp_path):
    """A local copy of gsm8k holds main/ and socratic/: --config picks one (reading both wrote every question twice),
    none refuses naming them; the split is a whole name part, and the output file is never read back."""
    for subset in ("main", "socratic"):
        write_parquet(tmp_path / "gsm8k" / subset / "train-00000-of-00001.parquet",
                      {"question": [f"{subset} q{i}" for i in range(2)], "answer": ["#### 1", "#### 2"]})
        write_parquet(tmp_path / "gsm8k" / subset / "test-00000-of-00001.parquet",
                      {"question": ["t"], "answer": ["#### 3"]})
    src = str(tmp_path / "gsm8k")
    assert [r["question"] for r in load(src, "train", "main")] == ["main q0", "main q1"]
    with pytest.raises(SystemExit, match=r"several subsets \(main, socratic\): choose one with --config"):
        load(src, "train")
    with pytest.raises(SystemExit, match="has no subfolder 'mian'.*it has: main, socratic"):
        load(src, "train", "mian")
    flat = tmp_path / "math500"
    write_parquet(flat / "test.parquet", {"problem": ["p"], "solution": [r"\boxed{1}"]})
    write_parquet(flat / "contest.parquet", {"problem": ["other"], "solution": [r"\boxed{2}"]})
    out = flat / "math500_test.jsonl"
    for _ in range(2):  # the second run finds its own output beside the source and leaves it out
        assert convert("math", load(str(flat), "test", exclude=out), out) == (1, {}, 0)
    (flat / "test.jsonl").write_text(json.dumps({"problem": "p", "solution": r"\boxed{1}"}) + "\n")
    with pytest.raises(SystemExit, match="mixes parquet and json files"):
        load(str(flat), "test", exclude=out)


def test_a_source_of_another_kind_fails_by_name_and_leaves_no_file(tmp_path):
    """A dataset of another kind (other columns, or no usable answer in any row) exited 0 after writing an empty
    file, or raised a bare KeyError and left an empty one; a later run then called the file empty."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match=r"row 1 has no column 'answer', which the gsm8k converter reads; its "
                                         r"columns: \['question', 'solution'\]"):
        convert("gsm8k", [{"question": "1+1?", "solution": "2"}], out)
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"no row of 2 was usable \(2 without a usable answer\): nothing written"):
        convert("gsm8k", [{"question": "1+1?", "answer": "no marker"}] * 2, out)
    assert not list(tmp_path.iterdir())
    out.write_text("kept\n")  # an earlier good output stays until a conversion succeeds
    with pytest.raises(ValueError):
        convert("gsm8k", [{"question": "1+1?", "answer": "no marker"}], out)
    assert out.read_text() == "kept\n"


def test_a_null_or_a_number_where_text_goes_names_the_row_and_out_may_not_be_source(tmp_path):
    """A null question or an int problem ended in a bare TypeError/AttributeError naming no row; --out equal to
    --source overwrote the raw rows; an --out folder was a traceback."""
    with pytest.raises(ValueError, match=r"row 2: the gsm8k converter cannot read it \(AttributeError: .*\); its "
                                         r"columns' types: \{'question': 'NoneType', 'answer': 'str'\}"):
        convert("gsm8k", [{"question": "1+1?", "answer": "#### 2"}, {"question": None, "answer": "#### 3"}],
                tmp_path / "g.jsonl")
    with pytest.raises(ValueError, match=r"row 1: the math converter cannot read it"):
        convert("math", [{"problem": 7, "solution": r"\boxed{1}"}], tmp_path / "m.jsonl")
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"question": "a?", "answer": "#### 2"}\n')
    (tmp_path / "folder").mkdir()
    tool = [sys.executable, str(ROOT / "data_tools" / "convert_dataset.py"), "gsm8k"]
    for source, out, words in ((raw, raw, "is --source itself, or a file in its folder"),
                               (tmp_path, raw, "is --source itself, or a file in its folder"),
                               (raw, tmp_path / "folder", "is a folder")):
        done = subprocess.run(tool + ["--source", str(source), "--out", str(out)], capture_output=True, text=True,
                              cwd=tmp_path)
        assert done.returncode == 1 and words in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert raw.read_text() == '{"question": "a?", "answer": "#### 2"}\n'


def test_null_answers_are_skipped_images_given_by_path_are_copied_and_cli_mistakes_are_one_line(tmp_path):
    """A null answer or solution aborted the whole conversion with a bare TypeError/AttributeError; geometry3k
    images given as paths (a column of paths, or the Image feature's {"bytes": None, "path": ...}) failed; a mistyped
    local --source went to the hub as a repo id, and an unparsable file or a missing split ended in tracebacks."""
    assert convert("gsm8k", [{"question": "1+1?", "answer": "#### 2"}, {"question": "?", "answer": None}],
                   tmp_path / "g.jsonl") == (1, {"without a usable answer": 1}, 0)
    assert convert("math", [{"problem": "p", "solution": r"\boxed{1}"}, {"problem": "q", "solution": None}],
                   tmp_path / "m.jsonl") == (1, {"without a usable answer": 1}, 0)
    Image.new("RGB", (40, 30), (10, 20, 30)).save(tmp_path / "a.png")
    rows = [{"images": [str(tmp_path / "a.png")], "problem": "<image>Find x.", "answer": "3"},
            {"images": [{"bytes": None, "path": str(tmp_path / "a.png")}], "problem": "<image>Find y.", "answer": "4"}]
    out = tmp_path / "geo" / "train.jsonl"
    assert convert("geometry3k", rows, out) == (2, {}, 0)
    for row in read_jsonl(out):
        assert Image.open(out.parent / row["images"][0]).getpixel((0, 0)) == (10, 20, 30)
    with pytest.raises(ValueError, match=r"row 1: image 0 is the path 'nope.png', which is not a file here"):
        convert("geometry3k", [{"images": ["nope.png"], "problem": "<image>x", "answer": "1"}], tmp_path / "n.jsonl")

    (tmp_path / "broken.jsonl").write_text('{"question": "a?", "answer": "#### 2"}\n{"question": "b?"\n')
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "train.jsonl").write_text('{"question": "a?", "answer": "#### 2"}\n')
    tool = [sys.executable, str(ROOT / "data_tools" / "convert_dataset.py"), "gsm8k", "--out",
            str(tmp_path / "o.jsonl")]
    for source, split, words in [("./trian.jsonl", "train", "--source ./trian.jsonl does not exist"),
                                 (str(tmp_path / "broken.jsonl"), "train", "could not read --source"),
                                 (str(tmp_path / "f"), "test",
                                  "could not read --source .*split 'test'.*Unknown split")]:
        done = subprocess.run(tool + ["--source", source, "--split", split], capture_output=True, text=True,
                              cwd=tmp_path)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        lines = [line for line in done.stderr.splitlines() if line.startswith("convert_dataset:")]
        assert len(lines) == 1 and re.search(words, lines[0]), done.stderr[-2000:]


def test_length_report_reads_a_runs_config_and_names_every_data_error(tmp_path, tiny_model, capsys):
    """The report had no way to the run's data.* and model.* settings: a file keyed `problem` (the geometry3k
    recipe's) could not be reported at all, and a system prompt or the run's image pixels were not counted. The
    run's config (and section.key=value overrides) is read as run.py reads it, the flags over it; the loader's
    TypeErrors came out as tracebacks."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {tiny_model}}}\ndata: {{path: {data}, prompt_key: problem, label_key: answer}}\n"
                      "train: {max_tokens_per_gpu: 512}\nrollout: {max_response_len: 32, batch_size: 4, "
                      "n_samples_per_prompt: 2}\n")

    def median(*extra):
        code, out, err = length_report(capsys, "--dp", "1", *extra)
        assert code == 0, err[-2000:]
        assert f"{data}: 8 prompts" in out
        return int(re.search(r"median (\d+)", out).group(1))

    plain = median("--config", str(config))
    assert median("--config", str(config), "data.system_prompt=You add numbers carefully.") > plain
    assert median("--config", str(config), "--max-tokens-per-gpu", "64") == plain  # a flag over the config
    code, _, err = length_report(capsys, "--dp", "1", "--data", str(data), "--model", str(tiny_model))
    assert code == 2 and "neither 'prompt' nor 'messages' is present" in err
    data.write_text('{"prompt": "1+1?", "label": "2"}\n{"prompt": 5, "label": "4"}\n')
    code, _, err = length_report(capsys, "--dp", "1", "--config", str(config), "data.prompt_key=prompt")
    assert code == 2 and "Traceback" not in err and "p.jsonl:2: field 'prompt' must be a string, got int" in err, \
        err[-2000:]


def test_rows_that_repeat_one_written_are_left_out_and_counted(tmp_path):
    """The hub's DAPO-Math-17k holds each of its prompts ~100 times (1.79M rows): all were written, so a run saw
    each prompt ~100 times per epoch. A row that converts to one already written is left out and counted; the same
    question with another answer is kept."""
    dapo = [{"prompt": [{"role": "user", "content": f"{i}+0?"}], "reward_model": {"ground_truth": str(i)},
             "data_source": "math_dapo"} for i in (1, 2, 1, 1, 2)]
    dapo.append({"prompt": [{"role": "user", "content": "1+0?"}], "reward_model": {"ground_truth": "one"}})
    out = tmp_path / "d.jsonl"
    assert convert("dapo_math", dapo, out) == (3, {}, 3)
    assert [(r["messages"][0]["content"], r["label"], r["metadata"]["row"]) for r in read_jsonl(out)] == \
        [("1+0?", "1", 0), ("2+0?", "2", 1), ("1+0?", "one", 5)]
    src = write_parquet(tmp_path / "train.parquet", {"question": ["a?", "a?"], "answer": ["#### 1", "#### 1"]})
    done = subprocess.run([sys.executable, str(ROOT / "data_tools" / "convert_dataset.py"), "gsm8k", "--source",
                           str(src), "--out", str(tmp_path / "g.jsonl")], capture_output=True, text=True)
    assert done.returncode == 0 and "wrote 1 rows" in done.stdout and "1 repeating a row written before" in done.stdout


def test_a_dataset_saved_to_disk_is_read_with_its_split(tmp_path):
    """A folder written by save_to_disk failed in load_dataset, whose advice (load_from_disk) a CLI user cannot take."""
    rows = {"question": ["1+1?", "2+2?"], "answer": ["#### 2", "#### 4"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dict"))
    assert [r["question"] for r in load(str(tmp_path / "one"), "train")] == rows["question"]
    assert [r["question"] for r in load(str(tmp_path / "dict"), "train")] == rows["question"]
    with pytest.raises(SystemExit, match="no split 'test' in this saved dataset; its splits: train"):
        load(str(tmp_path / "dict"), "test")


def test_geometry3k_images_per_output_file_odd_images_and_duplicates(tmp_path):
    """A test split converted beside the train split overwrote the train rows' images (both named after --split,
    "train" by default); a CMYK image stopped the conversion as "cannot write --out", base64 text in "bytes" as a
    TypeError; rows the trainer refuses (2 images, 1 placeholder) were written, and identical rows never counted as
    repeats (the key held the per-row image names)."""
    import base64

    def png(colour, mode="RGB") -> bytes:
        buf = io.BytesIO()
        Image.new(mode, (8, 8), colour).save(buf, format="PNG" if mode != "CMYK" else "JPEG")
        return buf.getvalue()

    red, blue = png((255, 0, 0)), png((0, 0, 255))
    train = [{"images": [{"bytes": red, "path": None}], "problem": "<image>Find x.", "answer": "1"}]
    test = [{"images": [{"bytes": blue, "path": None}], "problem": "<image>Find x.", "answer": "2"}]
    out = tmp_path / "geo"
    convert("geometry3k", train, out / "train.jsonl")
    convert("geometry3k", test, out / "test.jsonl")
    for split, pixel in (("train", (255, 0, 0)), ("test", (0, 0, 255))):
        (row,) = read_jsonl(out / f"{split}.jsonl")
        assert Image.open(out / row["images"][0]).convert("RGB").getpixel((0, 0)) == pixel

    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # decoded, as datasets' Image feature gives it
    rows = [{"images": [cmyk], "problem": "A", "answer": "1"},
            {"images": [{"bytes": base64.b64encode(blue).decode(), "path": None}], "problem": "B", "answer": "2"},
            {"images": [{"bytes": b"not an image", "path": None}], "problem": "C", "answer": "3"},
            {"images": [{"bytes": red, "path": None}, {"bytes": blue, "path": None}], "problem": "<image>D",
             "answer": "4"},
            {"images": [{"bytes": red, "path": None}], "problem": "<image>E", "answer": "5"},
            {"images": [{"bytes": red, "path": None}], "problem": "<image>E", "answer": "5"},  # the one before
            {"images": [{"bytes": blue, "path": None}], "problem": "<image>E", "answer": "5"}]  # another image
    written, skipped, duplicates = convert("geometry3k", rows, out / "odd.jsonl")
    assert (written, dict(skipped), duplicates) == (4, {"unreadable image": 1,
                                                        "placeholders not matching the images": 1}, 1)
    kept = read_jsonl(out / "odd.jsonl")
    assert [r["metadata"]["row"] for r in kept] == [0, 1, 4, 6]
    assert Image.open(out / kept[0]["images"][0]).convert("RGB").getpixel((0, 0)) == (255, 0, 0)  # CMYK -> RGB
    assert Image.open(out / kept[1]["images"][0]).getpixel((0, 0))[:3] == (0, 0, 255)
    written_images = sorted(p.name for p in (out / "images").glob("odd_*"))
    assert written_images == sorted(Path(r["images"][0]).name for r in kept)  # none for rows left out
