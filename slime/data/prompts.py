"""Prompt source: jsonl/parquet through `datasets`, tokenised once, sharded over dp, resumable.

Every rank holds the same filtered, tokenised list and the same shuffled order (seeded by
train.seed and the epoch); rank r takes positions r, r+dp, ... of each global batch. The state is
(epoch, offset) into that order, so resuming continues with exactly the next batch.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

from slime.config import DataConfig
from slime.data.sample import Sample

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Prompt:
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict
    index: int  # row in the source file


def load_rows(path: str) -> list[dict]:
    """Rows of a .jsonl/.json or .parquet file, loaded with `datasets` (no network, no cache dir clutter)."""
    import datasets

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path} does not exist")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(p.suffix)
    if kind is None:
        raise ValueError(f"data.path={path}: unsupported extension '{p.suffix}'; use .jsonl, .json or .parquet")
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    except Exception as e:  # datasets wraps JSON decode errors deep inside; surface the file name
        raise ValueError(f"data.path={path}: could not be read as {kind}: {e}") from e
    return ds.to_list()


def encode_prompt(row: dict, line: int, cfg: DataConfig, tokenizer, path: str) -> tuple[str, list[int]]:
    """Apply the chat template (when asked and available) and tokenise one row."""
    use_template = cfg.apply_chat_template and tokenizer.chat_template is not None
    if row.get(cfg.prompt_key) is not None:
        content = row[cfg.prompt_key]
        if not isinstance(content, str):
            raise TypeError(f"{path}:{line}: field '{cfg.prompt_key}' must be a string, got {type(content).__name__}")
        messages = [{"role": "user", "content": content}]
    elif row.get(cfg.messages_key) is not None:
        messages = row[cfg.messages_key]
        if not use_template:
            raise ValueError(f"{path}:{line}: chat '{cfg.messages_key}' need a tokenizer with a chat template "
                             "(data.apply_chat_template=true)")
    else:
        raise ValueError(f"{path}:{line}: neither '{cfg.prompt_key}' nor '{cfg.messages_key}' is present; set "
                         "data.prompt_key / data.messages_key to the field holding the prompt")
    if not use_template:
        return content, tokenizer(content, add_special_tokens=False).input_ids
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + list(messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tokenizer(text, add_special_tokens=False).input_ids


def load_prompts(cfg: DataConfig, tokenizer, path: str | None = None) -> tuple[list[Prompt], int]:
    """All prompts of the file that fit `max_prompt_len`, and the number dropped for length."""
    path = path or cfg.path
    prompts, too_long = [], 0
    for i, row in enumerate(load_rows(path)):
        text, ids = encode_prompt(row, i + 1, cfg, tokenizer, path)
        if len(ids) > cfg.max_prompt_len:
            too_long += 1
            continue
        meta = row.get(cfg.metadata_key) or {}
        if not isinstance(meta, dict):
            raise TypeError(f"{path}:{i + 1}: field '{cfg.metadata_key}' must be an object, got {type(meta).__name__}")
        prompts.append(Prompt(ids, text, row.get(cfg.label_key), meta, i))
    if too_long:
        logger.warning("%s: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens",
                       path, too_long, too_long + len(prompts), cfg.max_prompt_len)
    if not prompts:
        raise ValueError(f"{path}: no usable prompts (dropped {too_long} as too long; raise data.max_prompt_len)")
    return prompts, too_long


class PromptSource:
    """Global batches of prompts in a seeded order; each dp rank gets its slice."""

    def __init__(self, cfg: DataConfig, tokenizer, *, batch_size: int, dp_rank: int, dp_size: int, seed: int):
        if batch_size % dp_size:
            raise ValueError(f"rollout.batch_size={batch_size} must be divisible by the data-parallel size {dp_size}")
        self.cfg, self.batch_size, self.dp_rank, self.dp_size, self.seed = cfg, batch_size, dp_rank, dp_size, seed
        self.prompts, self.num_too_long = load_prompts(cfg, tokenizer)
        if len(self.prompts) < batch_size:
            raise ValueError(f"{cfg.path} has {len(self.prompts)} usable prompts, fewer than "
                             f"rollout.batch_size={batch_size}")
        self.epoch, self.offset = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.cfg.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int | None = None) -> list[Prompt]:
        """This rank's share of the next n prompts (default rollout.batch_size); epochs roll over."""
        n = n or self.batch_size
        if n % self.dp_size or n > len(self._order):
            raise ValueError(f"cannot draw {n} prompts over {self.dp_size} ranks from {len(self._order)}")
        if self.offset + n > len(self._order):  # drop the ragged tail of an epoch
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._make_order()
        ids = self._order[self.offset:self.offset + n]
        self.offset += n
        return [self.prompts[i] for i in ids[self.dp_rank::self.dp_size]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._make_order()


def to_samples(prompts: list[Prompt], n: int, first_group_id: int) -> list[Sample]:
    """n empty samples per prompt, sharing a group id."""
    return [Sample(prompt_ids=list(p.prompt_ids), prompt_text=p.prompt_text, label=p.label,
                   metadata=dict(p.metadata), group_id=first_group_id + g)
            for g, p in enumerate(prompts) for _ in range(n)]


def sft_samples(prompts: list[Prompt], tokenizer) -> list[Sample]:
    """Supervised samples: the label's text followed by EOS is the response to learn."""
    samples = []
    for p in prompts:
        if p.label is None:
            raise ValueError(f"SFT needs a label for every prompt; row {p.index} has none (data.label_key)")
        target = tokenizer(str(p.label), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        samples.append(Sample(prompt_ids=list(p.prompt_ids), response_ids=target, prompt_text=p.prompt_text,
                              response_text=str(p.label), label=p.label, metadata=dict(p.metadata),
                              group_id=p.index, finish_reason="stop"))
    return samples
