"""Prompt source: formats, chat template, over-long filtering, dp sharding and resumable order."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from slime.config import DataConfig
from slime.data.prompts import PromptSource, load_prompts


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


def test_overlong_prompts_are_dropped_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1" * n, "label": "x"} for n in (3, 30, 5, 40)])
    prompts, report = load_prompts(DataConfig(path=str(path), max_prompt_len=20), tok)
    dropped = report.too_long
    assert dropped == 2 and len(prompts) == 2


def test_bad_rows_name_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "label": "2"}, {"question": "x"}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: neither 'prompt' nor 'messages'"):
        load_prompts(DataConfig(path=str(path)), tok)
    (tmp_path / "p.csv").write_text("a")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_prompts(DataConfig(path=str(tmp_path / "p.csv")), tok)


def test_ranks_get_disjoint_shares_and_resume_continues(task_dir, tok):
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
    fresh.load_state_dict(state)
    assert [p.index for p in fresh.next_batch()] == expected


def test_epoch_rolls_over_with_new_order(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+0=", "label": str(i)} for i in range(10)])
    src = PromptSource(DataConfig(path=str(path)), tok, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    first = [p.index for _ in range(2) for p in src.next_batch()]
    second = [p.index for _ in range(2) for p in src.next_batch()]
    assert src.epoch == 1 and len(set(first)) == 8 and first != second
