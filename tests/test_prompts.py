"""Prompt source: formats, chat template, over-long filtering, dp sharding and resumable order."""
import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from conftest import REPO
from slime.config import DataConfig
from slime.data.prompts import SKIP_REASONS, PromptSource, load_prompts


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_and_messages_with_chat_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "1+2=", "label": "3", "metadata": {"k": 1}},
        {"messages": [{"role": "user", "content": "2+2="}], "label": "4"}])
    prompts, report = load_prompts(DataConfig(path=str(path), system_prompt="be brief"), tok)
    dropped = report.too_long
    assert dropped == 0
    assert prompts[0].prompt_text == "<system>be brief<user>1+2=<assistant>"
    assert tok.decode(prompts[1].prompt_ids) == "<system>be brief<user>2+2=<assistant>"
    assert prompts[0].label == "3" and prompts[0].metadata == {"k": 1}


def test_no_template_and_parquet(tmp_path, tok):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["7*6=", "1-1="], "answer": ["42", "0"]}), path)
    cfg = DataConfig(path=str(path), prompt_key="question", label_key="answer", apply_chat_template=False)
    prompts, _ = load_prompts(cfg, tok)
    assert [p.prompt_text for p in prompts] == ["7*6=", "1-1="]
    assert tok.decode(prompts[0].prompt_ids) == "7*6=" and prompts[0].label == "42"


def test_a_prompt_path_that_is_a_folder_or_missing_says_so(tmp_path, tok):
    with pytest.raises(IsADirectoryError, match="is a directory; data.path .* name one prompt file"):
        load_prompts(DataConfig(path=str(tmp_path)), tok)
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_prompts(DataConfig(path=str(tmp_path / "nope.jsonl")), tok)
    # a relative path: where it was looked for (run.sh runs from the repository, not the user's directory)
    with pytest.raises(FileNotFoundError, match=r"^nope.jsonl does not exist \(/.*/nope.jsonl: relative paths are read "
                                                r"from /"):
        load_prompts(DataConfig(path="nope.jsonl"), tok)


def test_a_gguf_file_as_model_path_names_the_two_settings(tmp_path):
    from slime.config import ModelConfig
    from slime.models.loading import check_model_path

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"is a GGUF file: set model.path to its folder and "
                                                r"model.gguf_file=m.gguf"):
        check_model_path(ModelConfig(path=str(tmp_path / "m.gguf")))
    with pytest.raises(FileNotFoundError, match=r"model.path=nope is not a directory \(/.*/nope: relative paths"):
        check_model_path(ModelConfig(path="nope"))


def test_what_would_be_silently_dropped_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2=", "label": "3"}])
    with pytest.raises(ValueError, match="data.system_prompt is set, but data.apply_chat_template=false"):
        load_prompts(DataConfig(path=str(path), system_prompt="be brief", apply_chat_template=False), tok)
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "1+2=", "label": "3"},
                                                 {"prompt": "2+2=", "messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="both.jsonl:2: the row has both 'prompt' and 'messages'; keep one"):
        load_prompts(DataConfig(path=str(both)), tok)


def test_overlong_prompts_are_dropped_counted_and_named(tmp_path, tok, caplog):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1" * n, "label": "x"} for n in (3, 30, 5, 40)])
    with caplog.at_level(logging.WARNING, logger="slime.data.prompts"):
        prompts, report = load_prompts(DataConfig(path=str(path), max_prompt_len=20), tok)
    dropped = report.too_long
    assert dropped == 2 and len(prompts) == 2
    assert re.search(r"dropped 2 of 4 prompts longer than data.max_prompt_len=20 tokens: lines 2 \(\d+ tokens\), "
                     r"4 \(\d+ tokens\)$", caplog.text.strip()), caplog.text
    from slime.data.prompts import PromptSource

    source = PromptSource(DataConfig(path=str(path), max_prompt_len=20), tok, batch_size=1, dp_rank=0, dp_size=1,
                          seed=0)  # and logged with the other skips, in every train record
    assert source.skipped_metrics(lambda values: values) == {"data/skipped_too_long": 2}


def test_bad_rows_name_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "label": "2"}, {"question": "x"}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: neither 'prompt' nor 'messages'"):
        load_prompts(DataConfig(path=str(path)), tok)
    (tmp_path / "p.csv").write_text("a")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_prompts(DataConfig(path=str(tmp_path / "p.csv")), tok)


def test_the_ranks_shares_in_rank_order_are_the_one_rank_batch(task_dir, tok):
    """The trainer lays the global batch out rank after rank and cuts mini-batches from it in order: with rank r
    drawing positions r, r + dp, ... (as before), mini-batch m of train.num_mini_batches=2 held other prompts at
    dp=2 than at dp=1, against the docs' "mini-batch m is the same samples whatever dp is"."""
    cfg = DataConfig(path=str(task_dir / "train.jsonl"))
    one = PromptSource(cfg, tok, batch_size=8, dp_rank=0, dp_size=1, seed=3)
    two = [PromptSource(cfg, tok, batch_size=8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for _ in range(3):
        assert [p.index for p in one.next_batch()] == [p.index for s in two for p in s.next_batch()]


def test_ranks_get_disjoint_shares_and_resume_continues(task_dir, tok, caplog):
    cfg = DataConfig(path=str(task_dir / "train.jsonl"))
    sources = [PromptSource(cfg, tok, batch_size=8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    seen = []
    for _ in range(3):
        parts = [[p.index for p in s.next_batch()] for s in sources]
        assert len(parts[0]) == len(parts[1]) == 4 and not set(parts[0]) & set(parts[1])
        seen += parts[0] + parts[1]
    assert len(set(seen)) == len(seen)  # no prompt repeats within an epoch
    state = sources[0].state_dict()
    expected = [p.index for p in sources[0].next_batch()]
    fresh = PromptSource(cfg, tok, batch_size=8, dp_rank=0, dp_size=2, seed=3)
    with caplog.at_level(logging.WARNING):
        fresh.load_state_dict(state)
    assert [p.index for p in fresh.next_batch()] == expected and not caplog.text
    other = PromptSource(cfg, tok, batch_size=8, dp_rank=0, dp_size=2, seed=4)
    with caplog.at_level(logging.WARNING):
        other.load_state_dict(state)  # another seed: said so, not silently another order
    assert "resumed with another prompt order (train.seed 3 -> 4)" in caplog.text


def test_epoch_rolls_over_with_new_order(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+0=", "label": str(i)} for i in range(10)])
    src = PromptSource(DataConfig(path=str(path)), tok, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    first = [p.index for _ in range(2) for p in src.next_batch()]
    second = [p.index for _ in range(2) for p in src.next_batch()]
    assert src.epoch == 1 and len(set(first)) == 8 and first != second


def test_a_batch_spanning_two_epochs_holds_no_prompt_twice_and_resumes_the_same(tmp_path, tok):
    """10 prompts, batches of 4: every third batch takes the epoch's last 2 and the next epoch's first 2. The next
    epoch starts with prompts not in that tail (its shuffled order alone repeated one here), still drawing each
    prompt once per epoch; a resume after such a batch draws what the run would have."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+0=", "label": str(i)} for i in range(10)])
    cfg = DataConfig(path=str(path))
    src = PromptSource(cfg, tok, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    batches = [[p.index for p in src.next_batch()] for _ in range(15)]  # 60 prompts: 6 epochs
    assert all(len(set(b)) == 4 for b in batches), batches
    drawn = [i for b in batches for i in b]
    assert all(sorted(drawn[e * 10:(e + 1) * 10]) == list(range(10)) for e in range(6))
    plain = PromptSource(cfg, tok, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    plain._front = []
    plain.epoch = 1
    assert set(drawn[8:10]) & set(plain._make_order()[:2])  # the seeded order alone: a prompt twice in batch 3
    src = PromptSource(cfg, tok, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    for _ in range(3):
        src.next_batch()
    fresh = PromptSource(cfg, tok, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    fresh.load_state_dict(src.state_dict())
    assert [[p.index for p in fresh.next_batch()] for _ in range(4)] == batches[3:7]


def test_jsonl_lines_end_only_at_newline(tmp_path, tok):
    """U+2028 and U+0085 inside a string are legal JSON, and json.dumps(ensure_ascii=False) writes them raw."""
    rows = [{"prompt": "a\u2028b", "label": "1"}, {"prompt": "c\u0085d", "label": "2"}, {"prompt": "e", "label": "3"}]
    path = tmp_path / "p.jsonl"
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    prompts, _ = load_prompts(DataConfig(path=str(path), apply_chat_template=False), tok)
    assert [p.prompt_text for p in prompts] == ["a\u2028b", "c\u0085d", "e"] and [p.index for p in prompts] == [0, 1, 2]


def test_json_arrays_keep_their_values(tmp_path, tok):
    """A .json file is read as JSON: `datasets` would type the label column and turn "007" into 7."""
    rows = [{"prompt": "1", "label": "007"}, {"prompt": "2", "label": 4}, {"prompt": "3", "label": "1e3"}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    write_jsonl(tmp_path / "l.json", rows)  # JSON lines under a .json name
    for name in ("a.json", "l.json"):
        prompts, _ = load_prompts(DataConfig(path=str(tmp_path / name)), tok)
        assert [p.label for p in prompts] == ["007", 4, "1e3"], name
    (tmp_path / "b.json").write_text(json.dumps([{"prompt": "1"}, "2"]))
    with pytest.raises(ValueError, match=r"b.json:1 \(row 2\): must be a JSON object, got str"):
        load_prompts(DataConfig(path=str(tmp_path / "b.json")), tok)
    # Pretty-printed: one object over many lines is one row; a broken array names the parser's line
    (tmp_path / "o.json").write_text(json.dumps({"prompt": "1+1=", "label": "2"}, indent=2))
    assert [p.label for p in load_prompts(DataConfig(path=str(tmp_path / "o.json")), tok)[0]] == ["2"]
    (tmp_path / "c.json").write_text('[\n  {"prompt": "1+1="},\n  {"prompt": "2+2="}\n  {"prompt": "3+3="}\n]\n')
    with pytest.raises(ValueError, match=r"c.json:4: not valid JSON \(Expecting ',' delimiter at column 3\)"):
        load_prompts(DataConfig(path=str(tmp_path / "c.json")), tok)


def test_a_row_of_a_pretty_printed_json_array_is_named_by_its_line(tmp_path, tok, caplog):
    """Errors named a .json array's row by its number as if it were a line (`file:3` for the object on line 9 of a
    pretty-printed array): they name the line the row's object starts on, and its number."""
    import logging

    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "", "label": "4"}, {"prompt": "3+3=", "metadata": 5}]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(rows, indent=2))  # rows start on lines 2, 6 and 10
    with caplog.at_level(logging.WARNING), \
            pytest.raises(TypeError, match=r"p.json:10 \(row 3\): field 'metadata' must be an object"):
        load_prompts(DataConfig(path=str(path), max_skipped_frac=1.0), tok)
    assert "p.json:6 (row 2): skipped (empty_prompt)" in caplog.text
    rows[2]["metadata"] = {}
    path.write_text(json.dumps(rows, indent=2), encoding="utf-16-le")  # no BOM: json.loads detects it, as we do
    prompts, _ = load_prompts(DataConfig(path=str(path), max_skipped_frac=1.0), tok)
    assert [p.index for p in prompts] == [0, 2]  # the row's number, as before
    assert prompts[1].where == f"the prompt at {path}:10 (row 3)"  # in a generate_fn's errors
    path.write_text('[{"prompt": "a"},\n {"prompt": "b", "prompt": "c"}]', encoding="utf-16")  # with its BOM
    with pytest.raises(ValueError, match=r"p.json:2 \(row 2\): the key 'prompt' is given twice"):
        load_prompts(DataConfig(path=str(path)), tok)


def test_a_rows_metadata_may_not_hold_the_keys_the_rollout_writes(tmp_path, tok):
    """A row's metadata "turns" was logged as rollout/turns (a text value crashed the first step), its
    "reward_info" as reward/* metrics."""
    for key in ("turns", "reward_info", "weight_version"):
        path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "metadata": {"source": "x"}},
                                                  {"prompt": "2+2=", "metadata": {key: "multi"}}])
        with pytest.raises(ValueError, match=rf"p.jsonl:2: field 'metadata' holds \['{key}'\], which the rollout "
                                             r"writes into each sample's metadata itself"):
            load_prompts(DataConfig(path=str(path)), tok)


def test_a_key_twice_in_a_row_is_an_error_naming_the_row(tmp_path, tok):
    """json keeps a key's last value: the first prompt (or label) the user wrote would be dropped without a word."""
    row = '{"prompt": "1+1=", "label": "2", "prompt": "2+2="}'
    for name, text, where in (("l.jsonl", f'{{"prompt": "3+3="}}\n{row}\n', "l.jsonl:2"),
                              ("l.json", f'{{"prompt": "3+3="}}\n{row}\n', "l.json:2"),
                              ("first.json", f'{row}\n{{"prompt": "3+3="}}\n', "first.json:1"),
                              ("a.json", f'[{{"prompt": "3+3="}},\n {row}]', r"a.json:2 \(row 2\)"),
                              ("o.json", row.replace(", ", ",\n  "), "o.json")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"{where}: the key 'prompt' is given twice in one object"):
            load_prompts(DataConfig(path=str(tmp_path / name)), tok)


def test_empty_labels_are_missing_labels(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "label": []}, {"prompt": "2+2=", "label": " "},
                                              {"prompt": "3+3=", "label": 0}, {"prompt": "4+4=", "label": ["8"]}])
    prompts, report = load_prompts(DataConfig(path=str(path), max_skipped_frac=1.0), tok, label_required=True)
    assert [p.label for p in prompts] == [0, ["8"]] and dict(report.skipped) == {"missing_label": 2}
    prompts, report = load_prompts(DataConfig(path=str(path)), tok)  # no reward needs them: kept as given
    assert len(prompts) == 4 and not report.skipped


def test_sft_learns_a_chats_final_assistant_reply_from_the_messages_before_it(tmp_path, tok, caplog):
    """A chat SFT row ending in the assistant's reply: the reply was rendered into the prompt and the label learned
    after a new assistant turn (the model copied an answer it could see), or, without a label, the row was skipped
    as "missing_label" with the reward's wording."""
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "10+10="}]
    rows = [{"messages": [*chat, {"role": "assistant", "content": "20"}], "label": "20"},
            {"messages": [*chat, {"role": "assistant", "content": [{"type": "text", "text": "20"}]}]},
            {"messages": chat, "label": "20"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    prompts, report = load_prompts(DataConfig(path=str(path)), tok, label_required=True, label_is_text=True)
    assert not report.skipped and [p.label for p in prompts] == ["20"] * 3
    assert prompts[0].prompt_ids == prompts[1].prompt_ids == prompts[2].prompt_ids  # the reply is not in the prompt
    assert "20" not in prompts[0].prompt_text
    evaluated, _ = load_prompts(DataConfig(path=str(path)), tok, label_required=True, reply_as_label=True)
    assert [p.prompt_ids for p in evaluated] == [p.prompt_ids for p in prompts]  # an SFT run's evaluation alike
    other = write_jsonl(tmp_path / "other.jsonl", [{"messages": [*chat, {"role": "assistant", "content": "21"}],
                                                    "label": "20"}])
    with pytest.raises(ValueError, match=r"other.jsonl:1: the messages end with an assistant reply and 'label' gives "
                                         r"another response; SFT learns one"):
        load_prompts(DataConfig(path=str(other)), tok, label_required=True, label_is_text=True)
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"messages": chat}, {"prompt": "2+2=", "label": "4"}])
    with caplog.at_level(logging.WARNING):
        _, report = load_prompts(DataConfig(path=str(bare), max_skipped_frac=1.0), tok, label_required=True,
                                 label_is_text=True)
    assert dict(report.skipped) == {"missing_label": 1} and "SFT learns it as the response, or the final " \
        "assistant message" in caplog.text


def test_sft_labels_are_text(tmp_path, tok):
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": 4}])
    prompts, _ = load_prompts(DataConfig(path=str(ok)), tok, label_required=True, label_is_text=True)
    assert [p.label for p in prompts] == ["2", 4]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": ["4", "4.0"]}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: SFT learns the label's text as the response, but 'label' is a "
                                         r"list \(\['4', '4.0'\]\); give one string"):
        load_prompts(DataConfig(path=str(bad)), tok, label_required=True, label_is_text=True)
    assert len(load_prompts(DataConfig(path=str(bad)), tok, label_required=True)[0]) == 2  # a reward takes lists
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4" * 40}])
    prompts, report = load_prompts(DataConfig(path=str(long), max_skipped_frac=0.5), tok, label_required=True,
                                   label_is_text=True, max_sample_len=(20, "parallel.sp x train.max_tokens_per_gpu"))
    assert [p.label for p in prompts] == ["2"] and dict(report.skipped) == {"label_too_long": 1}
    # The limit is the micro-batch row's: prompt + label (the EOS after it is a target only, Sample.row_len).
    fit = write_jsonl(tmp_path / "fit.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4" * 10}])
    kept = load_prompts(DataConfig(path=str(fit)), tok, label_required=True, label_is_text=True)[0][1]
    n = len(kept.prompt_ids) + len(tok(kept.label, add_special_tokens=False).input_ids)
    for limit, count in ((n, 2), (n - 1, 1)):
        prompts, report = load_prompts(DataConfig(path=str(fit), max_skipped_frac=0.5), tok, label_required=True,
                                       label_is_text=True, max_sample_len=(limit, "train.max_tokens_per_gpu"))
        assert len(prompts) == count and report.skipped["label_too_long"] == 2 - count
    # A prompt past data.max_prompt_len is dropped as too long (as for RL), not a bad row counted against
    # data.max_skipped_frac because its label made the row too long as well
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "1+1=", "label": "2"},
                                                 {"prompt": "2+2=" * 10, "label": "4" * 40}])
    prompts, report = load_prompts(DataConfig(path=str(both), max_prompt_len=20, max_skipped_frac=0.0), tok,
                                   label_required=True, label_is_text=True, max_sample_len=(30, "budget"))
    assert [p.label for p in prompts] == ["2"] and report.too_long == 1 and not report.skipped


@pytest.mark.parametrize("row, message", [
    ({"messages": "2+2="}, r"p.jsonl:1: field 'messages' must be a list of chat messages"),
    ({"messages": ["hi"]}, r"p.jsonl:1: 'messages'\[0\] must be an object with a string 'role'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, r"p.jsonl:1: 'messages'\[0\].content lists 'hi'"),
    ({"messages": [{"role": "user", "content": 7}]}, r"p.jsonl:1: 'messages'\[0\].content must be a string or a list"),
    ({"prompt": "x", "images": "a.png"}, r"p.jsonl:1: field 'images' must be a list of image references"),
    ({"prompt": "x", "metadata": []}, r"p.jsonl:1: field 'metadata' must be an object, got list"),
])
def test_fields_of_the_wrong_type_name_file_line_and_field(tmp_path, tok, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [row, {"prompt": "1+1="}])
    with pytest.raises(TypeError, match=message):
        load_prompts(DataConfig(path=str(path)), tok)


def test_an_empty_conversation_is_an_empty_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": []}, {"prompt": "1+1="}, {"prompt": "2+2="}])
    prompts, report = load_prompts(DataConfig(path=str(path), max_skipped_frac=0.5), tok)
    assert len(prompts) == 2 and dict(report.skipped) == {"empty_prompt": 1}


def test_eval_rows_without_the_label_the_reward_needs_are_skipped(tmp_path, tok, tiny_model):
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims
    from slime.trainer.evaluate import load_eval_prompts

    path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"{k}+1=", "label": str(k + 1)} for k in range(9)]
                       + [{"prompt": "9+1="}])
    one = ParallelDims(world_size=1, rank=0, local_rank=0, dp=1)
    for fn, kept, skipped in (("exact_match", 9, {"missing_label": 1}), ("reward_fns_for_test:length_reward", 10, {})):
        cfg = load_config(None, [f"model.path={tiny_model}", f"data.path={path}", f"eval.path={path}",
                                 f"rollout.reward.fn={fn}"])
        evalset = load_eval_prompts(cfg, tok, one)
        assert len(evalset.prompts) == kept and evalset.skipped == skipped, fn


class RankOfTwo:
    """Rank 0 of two, whose peer loaded the rows `other` (and skipped none when drawn)."""
    world_size, rank, is_main, world_group = 2, 0, True, None

    def __init__(self, other):
        self.other = other

    def all_gather_objects(self, obj, group=None):
        return [obj, self.other]

    def all_reduce_sum(self, values, group=None):
        return [float(v) for v in values]


@pytest.mark.parametrize("max_prompts,mine", [(0, [0, 3, 5]), (4, [0, 3])])
def test_eval_rows_another_rank_could_not_load_are_left_out_and_counted(tmp_path, tok, tiny_model, max_prompts, mine):
    """Each rank loads the eval file itself and takes every world_size-th prompt: a row missing on one rank (an
    image fetch that failed there) would shift its slice, so that some prompts were evaluated twice and others
    never. Every rank keeps the rows all of them loaded (then the first eval.max_prompts)."""
    from slime.config import load_config
    from slime.trainer.evaluate import load_eval_prompts

    path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"{k}+1=", "label": str(k + 1)} for k in range(6)])
    cfg = load_config(None, [f"model.path={tiny_model}", f"data.path={path}", f"eval.path={path}",
                             f"eval.max_prompts={max_prompts}"])
    evalset = load_eval_prompts(cfg, tok, RankOfTwo(other=[0, 1, 3, 4, 5]))  # the peer lacks row 2
    assert [p.index for p in evalset.prompts] == mine  # the peer's slice: rows 1, 4
    assert evalset.skipped == {"not_on_every_rank": 1}


def test_a_text_model_reads_an_image_placeholder_without_images_as_text(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1<image>2"}, {"prompt": "<image>x", "images": ["a.png"]}])
    with pytest.raises(ValueError, match="p.jsonl:2: the row has images but model.path is a text-only model"):
        load_prompts(DataConfig(path=str(path), apply_chat_template=False), tok)
    write_jsonl(path, [{"prompt": "1<image>2"}])
    prompts, report = load_prompts(DataConfig(path=str(path), apply_chat_template=False), tok)
    assert [p.prompt_text for p in prompts] == ["1<image>2"] and not report.skipped


def test_ranks_that_loaded_different_rows_keep_only_the_common_ones(tmp_path, tok):
    """Each rank loads the file itself; an image fetch that fails on one rank only would leave the ranks with
    different lists, so that one shuffled order drew different prompts (the same prompt twice, others never).
    The loop keeps the rows every rank loaded: here rank 1 could not load row 2."""
    from slime.data.prompts import PromptSource

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{k}+1="} for k in range(6)])
    ranks = [PromptSource(DataConfig(path=str(path)), tok, batch_size=2, dp_rank=r, dp_size=2, seed=3) for r in (0, 1)]
    ranks[1].prompts = [p for p in ranks[1].prompts if p.index != 2]  # as if loaded without it
    ranks[1]._order = ranks[1]._make_order()
    common = set.intersection(*({p.index for p in src.prompts} for src in ranks))
    assert [src.keep_only(common) for src in ranks] == [1, 0]
    assert ranks[0].skipped_metrics(lambda values: values) == {"data/skipped_not_on_every_rank": 1}
    # The first two batches take 4 of the epoch's 5 prompts: every rank draws from the same order, so no prompt
    # twice and none that a rank lacks (with the lists apart, one order indexed two different lists).
    drawn = [p.index for _ in range(2) for src in ranks for p in src.next_batch()]
    assert len(set(drawn)) == 4 and set(drawn) <= common
    with pytest.raises(ValueError, match="prompts that every rank could load, fewer than rollout.batch_size=2"):
        ranks[0].keep_only({0})


def test_skips_when_drawn_are_summed_over_ranks_into_a_checkpoint_and_continue_after_a_resume(task_dir, tok):
    """data/skipped_<reason> are cumulative: a checkpoint holds the skips of every rank (summed), a resume gives them
    to dp rank 0 alone, so that the next sum over ranks continues from them."""
    cfg = DataConfig(path=str(task_dir / "train.jsonl"))
    sources = [PromptSource(cfg, tok, batch_size=8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    sources[0].skipped_when_drawn["changed_since_load"] += 1
    sources[1].skipped_when_drawn.update({"changed_since_load": 2, "fetch_failed": 1})
    states = [s.state_dict() for s in sources]
    rank1 = [float(states[1]["skipped_when_drawn"].get(r, 0)) for r in SKIP_REASONS]
    saved = PromptSource.with_skips_of_all_ranks(states[0], lambda mine: [a + b for a, b in zip(mine, rank1)])
    assert saved["skipped_when_drawn"] == {"changed_since_load": 3, "fetch_failed": 1}
    resumed = [PromptSource(cfg, tok, batch_size=8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for s in resumed:
        s.load_state_dict(saved)
    assert dict(resumed[0].skipped_when_drawn) == {"changed_since_load": 3, "fetch_failed": 1}
    assert not resumed[1].skipped_when_drawn
    resumed[1].skipped_when_drawn["changed_since_load"] += 1  # a skip after the resume
    totals = [sum(s.skipped_when_drawn[r] for s in resumed) for r in SKIP_REASONS]
    metrics = resumed[0].skipped_metrics(lambda values: totals)
    assert metrics["data/skipped_changed_since_load"] == 4 and metrics["data/skipped_fetch_failed"] == 1


def test_a_row_the_chat_template_refuses_is_named_with_its_line(tiny_model, tmp_path):
    """A template that raises on a row (here: roles must alternate, as Mistral's does) gives file:line and the fix,
    not a bare jinja2 error from deep inside."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = ("{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"messages": [{"role": "user", "content": "1+1="}]},
                       {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: the chat template of model.path refused this row "
                                         r"\(TemplateError: Conversation roles must alternate.*"
                                         r"data.apply_chat_template=false"):
        load_prompts(DataConfig(path=str(path)), tok)


def test_prompts_without_a_chat_template_to_apply_are_said_once(tiny_model, tmp_path, caplog):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = None
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"prompt": "1+1="}, {"prompt": "2+2="}])
    with caplog.at_level(logging.WARNING, logger="slime.data.prompts"):
        prompts, _ = load_prompts(DataConfig(path=str(path)), tok)
    assert prompts[0].prompt_text == "1+1="
    assert caplog.text.count("tokenizer has no chat template") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime.data.prompts"):
        load_prompts(DataConfig(path=str(path), apply_chat_template=False), tok)
    assert "chat template" not in caplog.text


def test_a_message_the_chat_template_leaves_out_is_warned_about_with_its_line(tok, tmp_path, caplog):
    """The tiny models' template renders system, user and assistant turns only: a 'tool' turn's text vanishes
    from the prompt, which loads (templates leave a known role's text out on purpose: Qwen3's drops earlier turns'
    reasoning); the log names the line, the message and its role. (An unknown role's row is skipped:
    tests/test_faults.py.)"""
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"messages": [{"role": "user", "content": "1+1="}]},
                       {"messages": [{"role": "user", "content": "2+2="}, {"role": "tool", "content": "calc: 4"}]}])
    with caplog.at_level(logging.WARNING, logger="slime.data.prompts"):
        prompts, _ = load_prompts(DataConfig(path=str(path)), tok)
    assert len(prompts) == 2 and "calc: 4" not in prompts[1].prompt_text
    assert "in 1 row(s) the chat template left the text of a message out of the prompt" in caplog.text
    assert "line 2 (message 1, role 'tool')" in caplog.text


def test_a_list_of_text_parts_reads_as_its_text_on_a_text_model(tmp_path, tok):
    """OpenAI-style content, [{"type": "text", "text": ...}], on a text model: its template rendered the list's
    Python repr ("[{'type': 'text', ...}]"); the parts' texts are joined, as templates that read parts do."""
    plain = {"messages": [{"role": "user", "content": "what is 1+1?"}], "label": "2"}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                                       {"type": "text", "text": " 1+1?"}]}], "label": "2"}
    prompts, _ = load_prompts(DataConfig(path=str(write_jsonl(tmp_path / "p.jsonl", [plain, parts]))), tok)
    assert "type" not in prompts[1].prompt_text
    assert prompts[1].prompt_ids == prompts[0].prompt_ids and prompts[1].prompt_text == prompts[0].prompt_text



@pytest.mark.parametrize("part", [{"type": "text", "content": "what is 1+1?"}, {"type": "text", "text": 5}])
def test_a_text_part_without_a_string_text_is_named(tmp_path, tok, part):
    """{"type": "text", "content": ...} loaded with its question silently gone (the prompt was the template's frame
    alone); a non-string "text" failed with a bare AttributeError. Both name the file, line and part."""
    row = {"messages": [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": [part]}], "label": "2"}
    with pytest.raises(TypeError, match=r"p.jsonl:1: 'messages'\[1\].content has a text part without a string "
                                         r"'text' .*a text part is \{\"type\": \"text\", \"text\": \"...\"\}"):
        load_prompts(DataConfig(path=str(write_jsonl(tmp_path / "p.jsonl", [row]))), tok)

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_templates_turn_end_ends_sft_targets_and_rollouts_where_it_is_not_eos(tmp_path, tiny_model, tok):
    """A base model's tokenizer (Qwen2.5's, Llama-3.1's) has an EOS that is not the template's end of turn: SFT
    learned EOS after the reply, and rollouts ran past the turn's end, while the exported template renders
    <|im_end|>. Both now end where the template ends a turn; elsewhere EOS stays."""
    from slime.config import RolloutConfig
    from slime.data.prompts import sft_samples, turn_end_id
    from slime.rollout.rollout import sampling_params

    base = AutoTokenizer.from_pretrained(tiny_model)
    base.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    base.chat_template = QWEN_LIKE
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    assert im_end != base.eos_token_id
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [{"role": "user", "content": f"{i}+1="},
                                                              {"role": "assistant", "content": str(i + 1)}]}
                                                for i in range(4)])
    data = PromptSource(DataConfig(path=str(path)), base, batch_size=2, dp_rank=0, dp_size=1, seed=0,
                        label_required=True, label_is_text=True)
    assert data.turn_end == (im_end,)
    sample = sft_samples(data.next_batch(), base, data.turn_end)[0]
    assert base.decode(sample.prompt_ids).endswith("<|im_start|>assistant\n")
    assert sample.response_ids == base(sample.label, add_special_tokens=False).input_ids + [im_end]
    assert sampling_params(RolloutConfig(stop_token_ids=[7]), data.turn_end).stop_token_ids == (7, im_end)
    assert sampling_params(RolloutConfig(stop_token_ids=[im_end]), data.turn_end).stop_token_ids == (im_end,)
    assert evaluation_stops(base, path) == (im_end,)
    assert rollout_stops(data, base) == (im_end,)

    # EOS where the template is not applied, where it ends a turn with EOS (the tiny model's), with text, or raises
    assert turn_end_id(base, DataConfig(path=str(path), apply_chat_template=False)) == base.eos_token_id
    assert turn_end_id(tok, DataConfig(path=str(path))) == tok.eos_token_id
    base.chat_template = QWEN_LIKE.replace("<|im_end|>", "")
    assert turn_end_id(base, DataConfig(path=str(path))) == base.eos_token_id
    base.chat_template = "{{ raise_exception('a system message first') }}"
    assert turn_end_id(base, DataConfig(path=str(path))) == base.eos_token_id


class Seen(Exception):
    """What a stand-in engine was asked to generate with."""


class SeenEngine:
    weight_version = 0

    def wake(self):
        pass

    def generate(self, prompts, params, mm=None):
        raise Seen(params.stop_token_ids)


# A template that adds text around the final reply, as Qwen3's does (an empty thinking block before it) and
# Llama-2's (a space before it and after it).
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
            "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPACED = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
          "{% else %} {{ m['content'] }} <eos>{% endif %}{% endfor %}")  # a turn ends with a space and EOS


@pytest.mark.parametrize("template, reply", [(THINKING, "<think>\n\n</think>\n\n20<|im_end|>"),
                                             (SPACED, " 20 <eos>"), (QWEN_LIKE, "20<|im_end|>")])
def test_sft_learns_the_reply_as_the_chat_template_renders_it(tmp_path, tiny_model, template, reply, caplog):
    """SFT learned the label's tokens and the turn's end, where the template renders more around a reply: Qwen3's
    an empty thinking block before the final one, Llama-2's a space on each side. A model so trained answered
    without the block its template's generation prompt then expects (and the learned text was never rendered)."""
    from slime.data.prompts import sft_samples

    base = AutoTokenizer.from_pretrained(tiny_model)
    base.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    base.add_tokens(["<think>", "</think>"])  # plain added tokens, as in Qwen3's tokenizer
    base.chat_template = template
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "10+10="}]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [*chat, {"role": "assistant", "content": "20"}]},
                                                {"prompt": "10+10=", "label": "20"}])
    with caplog.at_level(logging.INFO, logger="slime.data.prompts"):
        data = PromptSource(DataConfig(path=str(path), shuffle=False), base, batch_size=2, dp_rank=0, dp_size=1,
                            seed=0, label_required=True, label_is_text=True)
    samples = sft_samples(data.next_batch(), base, data.turn_end)
    for sample, before in zip(samples, (chat, chat[-1:])):
        assert base.decode(sample.response_ids) == reply and sample.response_text == "20"
        rendered = base.apply_chat_template([*before, {"role": "assistant", "content": "20"}], tokenize=False)
        assert rendered.startswith(base.decode(sample.prompt_ids + sample.response_ids))  # the whole chat as rendered
    said = "SFT learns each reply as the chat template renders it after the prompt" in caplog.text
    assert said == (template != QWEN_LIKE)  # said where it is more than the label and the turn's end


def test_sft_on_a_template_that_does_not_render_the_reply_after_the_prompt_learns_the_label(tmp_path, tiny_model,
                                                                                               caplog):
    """A template that renders a reply otherwise (here: it refuses an assistant message last) keeps the label's
    tokens and the turn's end, and says so."""
    from slime.data.prompts import sft_samples

    base = AutoTokenizer.from_pretrained(tiny_model)
    base.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    base.chat_template = ("{% if messages[-1]['role'] == 'assistant' and messages|length > 1 %}"
                          "{{ raise_exception('no') }}{% endif %}" + QWEN_LIKE)
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "10+10=", "label": "20"}])
    with caplog.at_level(logging.WARNING, logger="slime.data.prompts"):
        data = PromptSource(DataConfig(path=str(path)), base, batch_size=1, dp_rank=0, dp_size=1, seed=0,
                            label_required=True, label_is_text=True)
    assert "in 1 row(s) the chat template does not render the prompt and then the label" in caplog.text
    assert data.turn_end == ()  # the template's own probe is refused too: EOS ends the turn
    (sample,) = sft_samples(data.next_batch(), base, data.turn_end)
    assert sample.response_ids == base("20", add_special_tokens=False).input_ids + [base.eos_token_id]


def test_the_sft_length_limit_counts_what_the_template_adds_to_the_reply(tmp_path, tiny_model):
    base = AutoTokenizer.from_pretrained(tiny_model)
    base.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    base.chat_template = THINKING  # <think> and </think> as text here: a byte each
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "10+10=", "label": "20"}, {"prompt": "1+1=", "label": "2"}])
    kept = load_prompts(DataConfig(path=str(path)), base, label_required=True, label_is_text=True)[0][0]
    n = len(kept.prompt_ids) + len(kept.target_ids) - 1  # the turn's end after the reply is a target only
    assert n > len(kept.prompt_ids) + 2 + 10  # the block counts
    for limit, count in ((n, 2), (n - 1, 1)):
        prompts, report = load_prompts(DataConfig(path=str(path), max_skipped_frac=1.0), base, label_required=True,
                                       label_is_text=True, max_sample_len=(limit, "train.max_tokens_per_gpu"))
        assert len(prompts) == count and report.skipped["label_too_long"] == 2 - count


def rollout_stops(data, tokenizer) -> tuple[int, ...]:
    """The stop ids a training rollout drawing from `data` hands the engine."""
    from one_rank import OneRank

    from slime.config import RolloutConfig
    from slime.rollout.rollout import collect_rollout

    with pytest.raises(Seen) as seen:
        collect_rollout(SeenEngine(), data, RolloutConfig(batch_size=2), tokenizer, None, OneRank(), step=0)
    return seen.value.args[0]


def evaluation_stops(tokenizer, path) -> tuple[int, ...]:
    """The stop ids an evaluation on `path` (its own prompts) hands the engine."""
    from one_rank import OneRank

    from slime.config import load_config
    from slime.trainer.evaluate import evaluate, load_eval_prompts

    cfg = load_config(None, ["model.path=m", f"data.path={path}", f"eval.path={path}", "algo.policy_loss=sft"])
    with pytest.raises(Seen) as seen:
        evaluate(SeenEngine(), load_eval_prompts(cfg, tokenizer, OneRank()), cfg, tokenizer, None, OneRank())
    return seen.value.args[0]


def test_an_rl_chat_ending_with_the_assistants_reply_is_refused_naming_the_line(tiny_model, tmp_path):
    """Rendered for RL, the reply sat in the prompt before a new assistant turn: the policy saw the answer."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    path = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    write_jsonl(path, [{"messages": chat[:1], "label": "2"}, {"messages": chat, "label": "2"}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: the chat in 'messages' ends with the assistant's message: the "
                                         r"policy would see that reply.*algo.policy_loss=sft"):
        load_prompts(DataConfig(path=str(path)), tok, label_required=True)
    sft, _ = load_prompts(DataConfig(path=str(path)), tok, label_required=True, label_is_text=True)
    assert [p.label for p in sft] == ["2", "2"]  # SFT learns the reply (from the messages before it)


def test_a_label_the_built_in_reward_cannot_compare_is_refused_at_load(tiny_model, tmp_path):
    """It was found when the row was first drawn, maybe hours into the run, with no file or line."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"prompt": "1+1=", "label": ["2", 2.0]}, {"prompt": "2+2=", "label": {"answer": "4"}}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: 'label' is \{'answer': '4'\}: the built-in reward compares "
                                         r"the answer with a string or a \(finite\) number, or a list of them, "
                                         r"not a dict"):
        load_prompts(DataConfig(path=str(path)), tok, label_required=True)
    assert len(load_prompts(DataConfig(path=str(path)), tok)[0]) == 2  # a function of the user's reads it


def test_a_prompt_without_a_chat_template_starts_with_the_tokenizers_bos():
    """Llama, Gemma and Mistral expect a BOS: a plain prompt was tokenised without it. No EOS after it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from slime.data.prompts import plain_ids

    vocab = {c: i for i, c in enumerate(["<s>", "</s>", *"abc "])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    assert tok("ab c").input_ids == [0, 2, 3, 5, 4, 1]
    assert plain_ids(tok, "ab c") == [0, 2, 3, 5, 4]
    tk.post_processor = None  # a tokenizer that adds nothing (Qwen's): the text's ids alone
    assert plain_ids(PreTrainedTokenizerFast(tokenizer_object=tk), "ab c") == [2, 3, 5, 4]


def test_a_json_object_wrapping_its_rows_or_holding_columns_is_refused_naming_the_shape(tiny_model, tmp_path):
    """Read as one row, the error named the wrapper's keys ("neither 'prompt' nor 'messages'") at line 1."""
    import pandas as pd

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}]
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}))
    pd.DataFrame(rows).to_json(tmp_path / "columns.json")
    for name, shape in (("wrapped", "its rows in the field 'data'"), ("columns", "columns of values by row")):
        with pytest.raises(ValueError, match=rf"{name}.json: one JSON object holding {shape}.*orient='records'"):
            load_prompts(DataConfig(path=str(tmp_path / f"{name}.json")), tok)
    for i, row in enumerate(({"messages": [{"role": "user", "content": "1+1="}], "label": "2"},
                             {"prompt": "1+1=", "tools": [{"name": "calc"}], "label": "2"})):  # one row, as before
        (tmp_path / f"one{i}.json").write_text(json.dumps(row))
        assert len(load_prompts(DataConfig(path=str(tmp_path / f"one{i}.json")), tok)[0]) == 1


def test_a_numeric_sft_label_is_learned_as_written_and_nan_labels_are_refused(tmp_path, tok):
    """SFT learned str(0.00001) = '1e-05' where the built-in rewards compare answers with '0.00001'; JSON's NaN
    passed as a label, and exact_match then gave a response "nan" the reward."""
    from slime.data.prompts import sft_samples

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "tiny?", "label": 0.00001}, {"prompt": "big?", "label": 1e20},
                                              {"prompt": "two?", "label": 2}])
    prompts, _ = load_prompts(DataConfig(path=str(path)), tok, label_required=True, label_is_text=True)
    samples = sft_samples(prompts, tok)
    assert [s.response_text for s in samples] == ["0.00001", "100000000000000000000", "2"]
    assert tok.decode(samples[0].response_ids[:-1]) == "0.00001"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "what?", "label": NaN}\n')
    for sft in (False, True):
        with pytest.raises(ValueError, match=r"p.jsonl:2: .*'label' is .*NaN or an infinity"):
            load_prompts(DataConfig(path=str(path)), tok, label_required=True, label_is_text=sft)


def test_a_prompt_of_tokens_past_the_models_vocabulary_is_named_at_load(tmp_path):
    """The tiny arithmetic model's tokenizer has a token (<|endoftext|>, id 261) past its 261 embeddings: a prompt
    holding it failed at the first generate call, naming no row."""
    from slime.config import ModelConfig
    from slime.models.loading import check_prompt_vocab, load_tokenizer

    model = ModelConfig(path=str(REPO / "assets/tiny-arith"))
    tok = load_tokenizer(model)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2=<|endoftext|>"}])
    prompts, _ = load_prompts(DataConfig(path=str(path)), tok)
    check_prompt_vocab(prompts[:1], model, tok)
    with pytest.raises(ValueError, match=r"the prompt at .*p.jsonl:2 \(data.path\) holds token ids \[261\] "
                                         r"\(\['<\|endoftext\|>'\]\) outside model.path's vocabulary \[0, 261\)"):
        check_prompt_vocab(prompts, model, tok)


def test_a_jsonl_file_with_a_byte_order_mark_reads_as_a_json_file_does(tmp_path, tok):
    """Saved by an editor with a UTF-8 BOM: the .json file read, the .jsonl one failed on line 1 ("Unexpected UTF-8
    BOM")."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    prompts, _ = load_prompts(DataConfig(path=str(path)), tok)
    assert [p.prompt_text for p in prompts] == [p.prompt_text for p in load_prompts(
        DataConfig(path=str(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}]))), tok)[0]]


def test_a_message_a_template_renders_as_json_counts_as_rendered():
    """Llama 3.1's template renders an ipython (tool) turn with tojson: its quotes and newlines escaped, the text
    was taken for left out, and the row skipped as unrendered_role."""
    from slime.data.prompts import _texts_left_out

    output = 'result: "4"\nok'
    messages = [{"role": "user", "content": "2+2?"}, {"role": "ipython", "content": output}]
    rendered = "<user>2+2?<ipython>" + json.dumps(output) + "<assistant>"
    assert _texts_left_out(messages, rendered, unknown_roles=True) is None
    assert _texts_left_out(messages, "<user>2+2?<assistant>", unknown_roles=True) == 1


def test_an_sft_reply_written_as_the_float_labels_repr_is_not_a_conflict(tmp_path, tok):
    """A converter that wrote both the label and the final reply from one float: label 1e-05, reply "1e-05"."""
    chat = [{"role": "user", "content": "tiny?"}, {"role": "assistant", "content": "1e-05"}]
    path = write_jsonl(tmp_path / "s.jsonl", [{"messages": chat, "label": 1e-05}])
    prompts, _ = load_prompts(DataConfig(path=str(path)), tok, label_required=True, label_is_text=True)
    assert len(prompts) == 1
