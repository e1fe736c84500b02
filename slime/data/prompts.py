"""Prompt source: .jsonl (read line by line, so errors name file:line), .json (an array of objects, or JSON
lines) and .parquet (through `datasets`), text or image-text rows, tokenised once, sharded over dp, resumable.

Every rank holds the same filtered, tokenised list and the same shuffled order (seeded by
train.seed and the epoch); rank r takes the r-th contiguous part of each global batch. The state is
(epoch, offset) into that order, so resuming continues with exactly the next batch.

Image-text rows (see slime/multimodal/schema.py) are checked at load: every image is decoded once
and its processed size fixes the prompt's image tokens; bad rows are skipped and counted. Pixels are
made only when a prompt is drawn, on the rank that uses it.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import random
import re
from pathlib import Path
from typing import Any

from slime.config import DataConfig
from slime.data.sample import Sample, answer_kind, label_text, unscorable_answers
from slime.multimodal.images import REASONS, ImageError, read_image
from slime.multimodal.processor import MultimodalInputs, VLProcessor
from slime.multimodal.schema import parse_row
from slime.utils import jsonfiles

logger = logging.getLogger(__name__)


RESERVED_METADATA = frozenset({"turns", "reward_info", "weight_version", "ended_at_image_token"})
"""Keys the rollout sets in a sample's metadata (a generate function's turns, reward functions' extra numbers,
the engine's weight version): a row's own metadata may not hold them."""


@dataclasses.dataclass
class Prompt:
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict
    index: int  # row in the source file
    images: list | None = None
    """Image-text rows: the image references (checked at load; decoded again when drawn)."""
    mm: MultimodalInputs | None = None
    """Pixel patches and grids, filled when the prompt is drawn on the rank that uses it."""
    source: str = ""
    """file:line of its row ("" for a prompt made in code)."""
    target_ids: list[int] | None = None
    """SFT: the response to learn as the chat template renders the label after the prompt, through the turn's end
    (sft_target); None: the label's tokens and the turn's end."""

    @property
    def where(self) -> str:
        """The prompt as messages name it: at its file:line (by index where it has no file)."""
        return f"the prompt at {self.source}" if self.source else f"prompt index {self.index}"


@dataclasses.dataclass
class LoadReport:
    too_long: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Bad rows by reason (missing_image, corrupt_image, placeholder_mismatch, ...)."""


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """Rows of a JSON-lines file; a malformed line is an error naming file:line (blank lines are skipped)."""
    rows = []
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"{path} is empty: a JSON-lines file needs one JSON object per line")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark some editors write (.json reads past it)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}: byte 0x{raw[e.start]:02x} at column {column} (file offset {e.start}) is "
                         "not UTF-8; re-encode the file as UTF-8") from None
    # Lines end at "\n" only: str.splitlines would also split at U+2028, U+0085 and the like, which JSON
    # writers (json.dumps(..., ensure_ascii=False)) leave raw inside strings.
    for n, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            row = jsonfiles.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        except jsonfiles.DuplicateKeyError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
        rows.append((n, row))
    return rows


def _is_array(raw: bytes) -> bool:
    """Whether a .json file's text (in the encoding json.loads detects, a BOM left out) starts with "["."""
    text = raw[:64].decode(json.detect_encoding(raw), errors="ignore").lstrip("\ufeff \t\r\n")
    return text[:1] == "["


def read_json(path: Path) -> list[tuple[int, dict]]:
    """Rows of a .json file: one JSON array of objects (row numbers count from 1), or JSON lines. Read as plain
    JSON, not through `datasets`, whose column typing would turn mixed labels such as "007" and 4 into numbers."""
    raw = path.read_bytes()
    try:
        data = jsonfiles.loads(raw)
    except jsonfiles.DuplicateKeyError as e:
        if _is_array(raw):  # one array: the row's line is named
            _array_rows(raw, path)
        else:  # JSON lines, whose error names the line; or one object over many lines
            try:
                read_jsonl(path)
            except ValueError as by_line:
                if isinstance(by_line.__context__, jsonfiles.DuplicateKeyError):
                    raise
        raise ValueError(f"{path}: {e}") from None
    except UnicodeDecodeError:
        return read_jsonl(path)  # which names the byte's line
    except json.JSONDecodeError as e:
        if _is_array(raw):  # one array, perhaps over many lines: the parser's line is the one to name
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        return read_jsonl(path)  # JSON lines (or broken JSON: the error then names the line)
    if isinstance(data, dict):  # one object, on one line or many; unless it wraps the rows or holds columns
        # a single field listing objects that are not chat messages (a row's images or tools sit beside its prompt)
        wrapped = next((k for k, v in data.items() if len(data) == 1 and isinstance(v, list) and v and
                        all(isinstance(r, dict) and "role" not in r for r in v)), None)
        if wrapped is not None or (data and all(isinstance(v, dict) for v in data.values())):
            shape = f"its rows in the field {wrapped!r}" if wrapped is not None else \
                "columns of values by row (pandas' to_json default)"
            raise ValueError(f"{path}: one JSON object holding {shape}; a .json prompt file is a list of row "
                             "objects, or one object per line (pandas: to_json(path, orient='records', lines=True))")
        return [(1, data)]
    if not isinstance(data, list):
        raise ValueError(f"{path}: a .json prompt file must hold a list of objects (or one object per line), got "
                         f"a JSON {type(data).__name__}")
    rows = list(zip(_array_rows(raw, path), data))
    for n, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: must be a JSON object, got {type(row).__name__}")
    return rows


class ArrayRow(int):
    """The number (from 1) of a row of a .json array, written `line (row n)` with the line its object starts on:
    in messages, `file:line` names it in a pretty-printed array as in a one-line one."""
    line: int

    def __new__(cls, n: int, line: int) -> ArrayRow:
        self = super().__new__(cls, n)
        self.line = line
        return self

    def __str__(self) -> str:
        return f"{self.line} (row {int(self)})"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _array_rows(raw: bytes, path: Path) -> list[ArrayRow]:
    """The row numbers of the .json array `raw`, as ArrayRow with the line each row starts on (plain row numbers
    where its text does not decode). A key twice in a row's object raises naming it."""
    try:
        text = raw.decode(json.detect_encoding(raw)).removeprefix("\ufeff")  # as json.loads reads it
    except UnicodeDecodeError:
        return list(range(1, len(jsonfiles.loads(raw)) + 1))
    decoder, rows, line, at = jsonfiles.decoder(), [], 1, 0
    i = _JSON_SPACE.match(text, 0).end() + 1  # past the "["
    while True:
        i = _JSON_SPACE.match(text, i).end()
        if text[i] == "]":
            return rows
        line += text.count("\n", at, i)
        rows.append(ArrayRow(len(rows) + 1, line))
        try:
            at, i = i, decoder.raw_decode(text, i)[1]
        except jsonfiles.DuplicateKeyError as e:
            raise ValueError(f"{path}:{rows[-1]}: {e}") from None
        i = _JSON_SPACE.match(text, i).end()
        i += text[i] == ","


def load_rows(path: str) -> list[tuple[int, dict]]:
    """(line or row number, row) of a .jsonl, .json or .parquet file (parquet through `datasets`, which decodes
    Image features)."""
    import datasets

    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{path} is a directory; data.path (and eval.path) name one prompt file: .jsonl, .json "
                                "or .parquet")
    if not p.is_file():
        where = "" if p.is_absolute() else f" ({p.resolve()}: relative paths are read from {Path.cwd()})"
        raise FileNotFoundError(f"{path} does not exist{where} (data.path / eval.path name a prompt file)")
    if p.suffix == ".jsonl":
        return read_jsonl(p)
    if p.suffix == ".json":
        return read_json(p)
    if p.suffix != ".parquet":
        raise ValueError(f"data.path={path}: unsupported extension '{p.suffix}'; use .jsonl, .json or .parquet")
    kind = "parquet"
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    except Exception as e:  # datasets wraps JSON decode errors deep inside; surface the file name
        raise ValueError(f"data.path={path}: could not be read as {kind}: {e}") from e
    return list(enumerate(ds.to_list(), 1))


def _texts_left_out(messages, text: str, unknown_roles: bool = False) -> int | None:
    """The first chat message whose text (a string content, or a text part's) is not in the rendered prompt: a
    template that does not know a role renders nothing for it. None where every text is there (or no messages).
    `unknown_roles`: only a message whose role is none of KNOWN_ROLES (a known one's text may be left out on
    purpose: Qwen3's template drops the reasoning of earlier assistant turns)."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if unknown_roles and m.get("role") in KNOWN_ROLES:
            continue
        content = m.get("content")
        parts = [content] if isinstance(content, str) else \
            [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        # a template may render a message as JSON (Llama 3.1's ipython turns: tojson), its quotes and newlines escaped
        if any(part.strip() and part.strip() not in text and json.dumps(part.strip())[1:-1] not in text
               for part in parts):
            return i
    return None


KNOWN_ROLES = ("system", "user", "assistant", "tool")


class TemplateRefused(ValueError):
    """The tokenizer's chat template raised on a row's messages (the loader names the file and line)."""


def _render(messages: list[dict], cfg: DataConfig, tokenizer) -> str:
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + list(messages)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's TemplateError (a template's raise_exception), or a TypeError in its expressions
        raise TemplateRefused(f"{type(e).__name__}: {e}") from e


def sft_target(messages: list[dict], label: str, prompt_text: str, prompt_ids: list[int], cfg: DataConfig,
               tokenizer, end_id: int) -> list[int] | None:
    """SFT on a chat template: the reply to learn is what the template renders after the prompt when the label is
    the assistant's message, through the token that ends its turn. Templates add text around a reply: Qwen3's
    an empty "<think>\n\n</think>\n\n" block before the final one, others a space; learning the label's tokens
    alone taught a reply the template never renders. The tokens are those of the whole conversation after the
    prompt's (where the prompt's tokens begin them), else of that text alone. None where the template does not
    render the prompt and then the label (it refuses the message, reorders, or ends the turn with text, not
    `end_id`): the label's tokens and the turn's end are learned there."""
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + list(messages)
    try:
        full = tokenizer.apply_chat_template(list(messages) + [{"role": "assistant", "content": label}],
                                             tokenize=False)
    except Exception:  # jinja2's TemplateError, a TypeError in its expressions: the label's tokens, as before
        return None
    if not isinstance(full, str) or not full.startswith(prompt_text) or label not in full[len(prompt_text):]:
        return None
    full_ids = tokenizer(full, add_special_tokens=False).input_ids
    if full_ids[:len(prompt_ids)] == prompt_ids:
        target = full_ids[len(prompt_ids):]
    else:  # image tokens expanded in the prompt's ids, or a merge across the boundary
        target = tokenizer(full[len(prompt_text):], add_special_tokens=False).input_ids
    return target[:target.index(end_id) + 1] if end_id in target else None


def _joined_text_parts(messages: list[dict]) -> list[dict]:
    """Messages whose content is a list of text parts, with the parts' texts joined (one after the other, as the
    chat templates that read parts render them). A text model's template may not read parts at all: Qwen2.5's
    renders the list's Python repr, Qwen3's nothing."""
    return [{**m, "content": "".join(p.get("text") or "" for p in m["content"])}
            if isinstance(m.get("content"), list) else m for m in messages]


def encode_prompt(row: dict, line: int, cfg: DataConfig, tokenizer, path: str,
                  text_model: bool = True) -> tuple[str, list[int]]:
    """Apply the chat template (when asked and available) and tokenise one text row. On a text model
    (`text_model`), a message's list of text parts is given to the template as one string."""
    use_template = cfg.apply_chat_template and tokenizer.chat_template is not None
    if row.get(cfg.prompt_key) is not None:
        content = row[cfg.prompt_key]
        if not isinstance(content, str):
            raise TypeError(f"{path}:{line}: field '{cfg.prompt_key}' must be a string, got {type(content).__name__}")
        messages = [{"role": "user", "content": content}]
    elif row.get(cfg.messages_key) is not None:
        messages = _joined_text_parts(row[cfg.messages_key]) if text_model else row[cfg.messages_key]
        if not use_template:
            raise ValueError(f"{path}:{line}: chat '{cfg.messages_key}' need a tokenizer with a chat template "
                             "(data.apply_chat_template=true)")
    else:
        raise ValueError(f"{path}:{line}: neither '{cfg.prompt_key}' nor '{cfg.messages_key}' is present; set "
                         "data.prompt_key / data.messages_key to the field holding the prompt")
    if not use_template:
        return content, plain_ids(tokenizer, content)
    text = _render(messages, cfg, tokenizer)
    return text, tokenizer(text, add_special_tokens=False).input_ids


def plain_ids(tokenizer, text: str) -> list[int]:
    """A prompt without a chat template, as its tokenizer encodes a text: with the special tokens it puts before
    one (a BOS, which Llama, Gemma and Mistral expect; a template writes its own), none after (an EOS would end
    the prompt)."""
    bare, full = tokenizer(text, add_special_tokens=False).input_ids, tokenizer(text).input_ids
    lead = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
    return full[:lead] + bare


def encode_image_prompt(messages: list[dict], refs: list, cfg: DataConfig, processor: VLProcessor,
                        base_dir: Path) -> tuple[str, list[int], list]:
    """Check every image (decoded once, then dropped) and tokenise the prompt with its image tokens.
    Returns the text, the ids, and the references to keep (in-memory images stay as they are)."""
    sizes = [read_image(ref, base_dir, max_pixels=cfg.max_image_pixels, timeout=cfg.image_fetch_timeout).size
             for ref in refs]
    text = _render(messages, cfg, processor.tokenizer)
    try:
        ids = processor.prompt_ids(text, sizes)
    except ValueError as e:
        raise ImageError("placeholder_mismatch", str(e)) from None
    return text, ids, refs


def _is_empty(row: dict, cfg: DataConfig) -> bool:
    """No text and no image in the row's prompt (a chat template alone does not make a prompt)."""
    prompt, messages = row.get(cfg.prompt_key), row.get(cfg.messages_key)
    if isinstance(prompt, str):
        return not prompt.strip() and not row.get(cfg.images_key)
    if prompt is not None or messages is None:  # a wrong type, or neither field: encode_prompt names them
        return False

    def empty(content) -> bool:
        if isinstance(content, str):
            return not content.strip()
        return all(p.get("type") == "text" and isinstance(p.get("text"), str) and not p["text"].strip()
                   for p in content or [] if isinstance(p, dict))  # other parts: check_messages names them
    return all(empty(m.get("content")) for m in messages if isinstance(m, dict))


def _ends_with_reply(row: dict, cfg: DataConfig) -> bool:
    messages = row.get(cfg.messages_key)
    return isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict) \
        and messages[-1].get("role") == "assistant"


def _reply_as_label(row: dict, cfg: DataConfig, path: str, line: int) -> dict:
    """SFT: a chat whose last message is the assistant's reply learns that reply, from the messages before it. It
    was rendered into the prompt and the label learned after it: the model copied an answer it could see (with the
    reply also in the label) or the row was skipped for having no label."""
    messages = row.get(cfg.messages_key)
    if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant"):
        return row
    content = messages[-1].get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ValueError(f"{path}:{line}: the final assistant message, which SFT learns as the response, holds "
                             "parts other than text; give it as text")
        content = _joined_text_parts(messages[-1:])[0]["content"]
    if not isinstance(content, str):
        raise TypeError(f"{path}:{line}: the final assistant message's content must be text, got "
                        f"{type(content).__name__}")
    label = row.get(cfg.label_key)
    if has_label(label) and content.strip() not in (label_text(label).strip(), str(label).strip()):
        raise ValueError(f"{path}:{line}: the messages end with an assistant reply and '{cfg.label_key}' gives "
                         "another response; SFT learns one: drop the final message or the label")
    return {**row, cfg.messages_key: messages[:-1], cfg.label_key: content}


def has_label(value: Any) -> bool:
    """Whether a row's label gives a reward something to compare against: not missing, not "" and not []."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (list, tuple)):
        return bool(value)
    return value is not None


class SkippedRow(ValueError):
    """A row that is counted and skipped (not an error of the whole file)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


SKIP_REASONS = REASONS + ("missing_label", "empty_prompt", "label_too_long", "unrendered_role",
                          "not_on_every_rank")  # the last: see keep_only


def load_prompts(cfg: DataConfig, tokenizer, path: str | None = None, processor: VLProcessor | None = None,
                 *, label_required: bool = False, label_is_text: bool = False, reply_as_label: bool = False,
                 max_sample_len: tuple[int, str] | None = None) -> tuple[list[Prompt], LoadReport]:
    """All usable prompts of the file. Over-long prompts are dropped and counted; rows with an empty prompt,
    without the label a reward needs (`label_required`), or image-text rows with a bad image (or placeholders
    that do not match the images) are skipped, logged with file:line and counted by reason, and more than
    data.max_skipped_frac of them is an error. SFT (`label_is_text`, or `reply_as_label` for its evaluation): a
    chat ending in the assistant's reply has that reply as its label, the messages before it as its prompt. SFT
    (`label_is_text`): a label must be text, and a row whose
    prompt + label passes `max_sample_len` = (tokens, the settings that make it) is skipped the same way (the EOS
    after the label is a target only: no micro-batch row holds it)."""
    path = path or cfg.path
    base_dir = Path(path).resolve().parent
    prompts, report, logged, long_rows, left_out, left_out_rows = [], LoadReport(), 0, [], [], 0
    if cfg.system_prompt and not (cfg.apply_chat_template and tokenizer.chat_template is not None):
        why = "the tokenizer has no chat template" if cfg.apply_chat_template else "data.apply_chat_template=false"
        raise ValueError(f"data.system_prompt is set, but {why}: a system message goes only through the chat "
                         "template, so it would be dropped. Put it in the prompts, or use a model whose tokenizer has "
                         "a chat template")
    rows = load_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    use_template = cfg.apply_chat_template and tokenizer.chat_template is not None
    end_id = turn_end_id(tokenizer, cfg) if label_is_text else None
    unrendered, shown = 0, None  # SFT rows whose reply the template does not render after the prompt; one it adds to
    if cfg.apply_chat_template and tokenizer.chat_template is None and \
            any(row.get(cfg.prompt_key) is not None for _, row in rows):
        logger.warning("%s: data.apply_chat_template=true, but model.path's tokenizer has no chat template: the "
                       "'%s' texts are tokenised as they are (set data.apply_chat_template=false to say so)", path,
                       cfg.prompt_key)
    for line, row in rows:
        if row.get(cfg.prompt_key) is not None and row.get(cfg.messages_key) is not None:
            raise ValueError(f"{path}:{line}: the row has both '{cfg.prompt_key}' and '{cfg.messages_key}'; keep one "
                             "(a prompt is one user message; messages is the whole chat)")
        try:
            if label_is_text or reply_as_label:
                row = _reply_as_label(row, cfg, path, line)
            elif _ends_with_reply(row, cfg):  # rendered, the reply and a new assistant turn after it
                raise ValueError(f"{path}:{line}: the chat in '{cfg.messages_key}' ends with the assistant's message: "
                                 "the policy would see that reply in its prompt and answer after it. Remove it (an "
                                 f"answer to compare against goes in '{cfg.label_key}'), or learn it with SFT "
                                 "(algo.policy_loss=sft)")
            # Said before placeholders are matched to images (a wrong type of the field is parse_row's to name)
            if processor is None and isinstance(row.get(cfg.images_key), list) and row[cfg.images_key]:
                raise ValueError(f"{path}:{line}: the row has images but model.path is a text-only model")
            try:
                # A text-only model reads "<image>" in a prompt without images as text.
                may_have_images = processor is not None or bool(row.get(cfg.images_key))
                parsed = parse_row(row, prompt_key=cfg.prompt_key, messages_key=cfg.messages_key,
                                   images_key=cfg.images_key,
                                   placeholder=cfg.image_placeholder if may_have_images else "")
            except TypeError as e:
                raise TypeError(f"{path}:{line}: {e}") from None
            if _is_empty(row, cfg):
                raise SkippedRow("empty_prompt", "the prompt is empty")
            if parsed is None:
                text, ids = encode_prompt(row, line, cfg, tokenizer, path, text_model=processor is None)
                refs = None
                if processor is not None and processor.image_token_id in ids:  # no image would fill them
                    raise SkippedRow("placeholder_mismatch", f"the prompt holds {ids.count(processor.image_token_id)} "
                                     f"image token(s) (the text {processor.image_token!r}) but no images; give the "
                                     f"images in '{cfg.images_key}' with {cfg.image_placeholder!r} placeholders, or "
                                     "remove the token from the text")
            elif processor is None:
                raise ValueError(f"{path}:{line}: the row has images but model.path is a text-only model")
            elif not cfg.apply_chat_template:
                raise ValueError(f"{path}:{line}: image-text rows need the chat template, which places the model's "
                                 "vision tokens; set data.apply_chat_template=true")
            else:
                text, ids, refs = encode_image_prompt(*parsed, cfg, processor, base_dir)
            messages = row.get(cfg.messages_key)  # as parsed: a placeholder in a turn's text is an image part there
            messages = parsed[0] if parsed is not None and messages is not None else messages
            if (unknown := _texts_left_out(messages, text, unknown_roles=True)) is not None:
                raise SkippedRow("unrendered_role", f"message {unknown} has the role {messages[unknown]['role']!r}, "
                                 "which model.path's chat template does not render (its text is not in the prompt, "
                                 f"which would be trained on without it); use one of {', '.join(KNOWN_ROLES)} "
                                 "(ShareGPT's human and gpt are user and assistant)")
            lost = _texts_left_out(messages, text)
            if lost is not None and len(left_out) < 5:
                left_out.append(f"{line} (message {lost}, role {row[cfg.messages_key][lost]['role']!r})")
            left_out_rows += lost is not None
            if label_required and not has_label(row.get(cfg.label_key)):
                why = ("SFT learns it as the response, or the final assistant message of the row's messages"
                       if label_is_text else "the reward compares against it")
                raise SkippedRow("missing_label", f"no '{cfg.label_key}', or an empty one ({why}; data.label_key "
                                                  "names the field)")
            if not ids:
                raise SkippedRow("empty_prompt", "the prompt is empty")
            label = row.get(cfg.label_key)
            if label_required and not label_is_text and (bad := unscorable_answers(label)):
                raise ValueError(f"{path}:{line}: '{cfg.label_key}' is {label!r:.60}: the built-in reward compares "
                                 "the answer with a string or a (finite) number, or a list of them, not "
                                 f"{answer_kind(bad[0])}; fix the label, or score it with a reward function of your "
                                 "own")
            if label_is_text and label is not None and (isinstance(label, (list, tuple)) or unscorable_answers(label)):
                raise ValueError(f"{path}:{line}: SFT learns the label's text as the response, but '{cfg.label_key}' is "
                                 f"{answer_kind(label)} ({str(label)[:60]}); give one string")
            target = learned = None  # SFT: the template's rendering of the reply, and what is learned
            if label_is_text and label is not None:
                learned = tokenizer(label_text(label), add_special_tokens=False).input_ids + [end_id]
                if use_template:
                    chat = (parsed[0] if parsed is not None  # as the prompt was rendered: encode_(image_)prompt
                            else [{"role": "user", "content": row[cfg.prompt_key]}]
                            if row.get(cfg.prompt_key) is not None
                            else row[cfg.messages_key] if processor is not None
                            else _joined_text_parts(row[cfg.messages_key]))
                    target = sft_target(chat, label_text(label), text, ids, cfg, tokenizer, end_id)
                    if target is None:
                        unrendered += 1
                    elif target != learned and shown is None:
                        shown = (line, tokenizer.decode(target))
                    learned = learned if target is None else target
            if learned is not None and processor is not None and processor.image_token_id in learned:
                raise SkippedRow("placeholder_mismatch", f"the label holds the image token (the text "
                                 f"{processor.image_token!r}), which SFT would teach the model to write: no image "
                                 "fills it; remove it from the label")
            if learned is not None and max_sample_len is not None and len(ids) <= cfg.max_prompt_len:
                limit, key = max_sample_len  # (a prompt past data.max_prompt_len is dropped as too long, below)
                # prompt + label: its row in a micro-batch (the turn's end after it is a target only, Sample.row_len)
                n = len(ids) + len(learned) - 1
                if n > limit:
                    raise SkippedRow("label_too_long", f"prompt + label is {n} tokens, more than a micro-batch "
                                                       f"holds ({key} = {limit})")
        except TemplateRefused as e:
            raise ValueError(f"{path}:{line}: the chat template of model.path refused this row ({e}); make the row's "
                             "messages fit it (roles, their order, content as a string), or set "
                             "data.apply_chat_template=false") from None
        except (ImageError, SkippedRow) as e:
            report.skipped[e.reason] += 1
            if logged < 20:
                logger.warning("%s:%s: skipped (%s): %s", path, line, e.reason, e)
            logged += 1
            continue
        if len(ids) > cfg.max_prompt_len:
            report.too_long += 1
            if len(long_rows) < 5:
                long_rows.append(f"{line} ({len(ids)} tokens)")
            continue
        meta = row.get(cfg.metadata_key)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise TypeError(f"{path}:{line}: field '{cfg.metadata_key}' must be an object, got {type(meta).__name__}")
        taken = sorted(RESERVED_METADATA & meta.keys())
        if taken:  # a row's "turns" was logged as rollout/turns (text crashed the step), its reward_info as reward/
            raise ValueError(f"{path}:{line}: field '{cfg.metadata_key}' holds {taken}, which the rollout writes into "
                             f"each sample's metadata itself ({', '.join(sorted(RESERVED_METADATA))}): rename them")
        prompts.append(Prompt(ids, text, row.get(cfg.label_key), meta, line - 1, images=refs, source=f"{path}:{line}",
                              target_ids=target))
    bad = sum(report.skipped.values())
    if bad:
        if logged > 20:
            logger.warning("%s: ... and %d more skipped rows", path, logged - 20)
        logger.warning("%s: skipped %d of %d rows: %s", path, bad, len(rows), dict(report.skipped))
        if bad > cfg.max_skipped_frac * len(rows):
            raise ValueError(f"{path}: {bad} of {len(rows)} rows are bad ({dict(report.skipped)}), more than "
                             f"data.max_skipped_frac={cfg.max_skipped_frac}; fix the data (the log names each "
                             "file:line) or raise the limit")
    if shown is not None:
        logger.info("%s: SFT learns each reply as the chat template renders it after the prompt, through the turn's "
                    "end: line %d's is %r", path, shown[0], shown[1][:200])
    if unrendered:
        logger.warning("%s: in %d row(s) the chat template does not render the prompt and then the label as the "
                       "assistant's reply (it refuses the message, or ends the turn with text): SFT learns the "
                       "label's tokens and the turn's end there", path, unrendered)
    if left_out_rows:
        logger.warning("%s: in %d row(s) the chat template left the text of a message out of the prompt (a role it "
                       "does not know, or content it does not render?): line %s%s", path, left_out_rows,
                       ", ".join(left_out), ", ..." if left_out_rows > len(left_out) else "")
    if report.too_long:
        logger.warning("%s: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens: line%s %s%s", path,
                       report.too_long, report.too_long + len(prompts), cfg.max_prompt_len,
                       "s" if len(long_rows) > 1 else "", ", ".join(long_rows),
                       ", ..." if report.too_long > len(long_rows) else "")
    if not prompts:
        raise ValueError(f"{path}: no usable prompts (dropped {report.too_long} as too long, skipped {bad} bad rows; "
                         "raise data.max_prompt_len or fix the data)")
    return prompts, report


def with_pixels(prompts: list[Prompt], cfg: DataConfig, processor: VLProcessor | None, path: str
                ) -> tuple[list[Prompt], collections.Counter]:
    """Decode the images of drawn prompts into pixel patches; a prompt whose image broke since load is
    skipped and counted (the batch is then one prompt short on this rank)."""
    out, skipped = [], collections.Counter()
    base_dir = Path(path).resolve().parent
    for p in prompts:
        if p.images is None or processor is None:
            out.append(p)
            continue
        try:
            images = [read_image(ref, base_dir, max_pixels=cfg.max_image_pixels, timeout=cfg.image_fetch_timeout)
                      for ref in p.images]
        except ImageError as e:
            logger.warning("%s: skipped when drawn (%s): %s", p.source or f"{path}:{p.index + 1}", e.reason, e)
            skipped[e.reason] += 1
            continue
        mm = processor.pixels(images)
        tokens = (mm.image_grid_thw.prod(-1) // processor.merge ** 2).tolist()
        runs = [len(list(run)) for token, run in itertools.groupby(p.prompt_ids) if token == processor.image_token_id]
        if tokens != runs:  # a file replaced by one of another size (or two swapped): features would go astray
            logger.warning("%s: skipped when drawn (changed_since_load): its images now make %s image tokens, "
                           "the prompt was tokenised with %s", p.source or f"{path}:{p.index + 1}", tokens, runs)
            skipped["changed_since_load"] += 1
            continue
        out.append(dataclasses.replace(p, mm=mm))
    return out, skipped


def rows_on_every_rank(prompts: list[Prompt], dims) -> set[int]:
    """The source rows every rank loaded (a collective over the world). Every rank reads a data file itself, and
    an image fetch can fail on one rank alone: ranks slicing or drawing from different lists would take different
    prompts."""
    loaded = dims.all_gather_objects([p.index for p in prompts], group=dims.world_group)
    return set.intersection(*map(set, loaded))


class PromptSource:
    """Global batches of prompts in a seeded order; each dp rank gets its slice."""

    def __init__(self, cfg: DataConfig, tokenizer, *, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 processor: VLProcessor | None = None, label_required: bool = False, label_is_text: bool = False,
                 max_sample_len: tuple[int, str] | None = None):
        if batch_size % dp_size:
            raise ValueError(f"rollout.batch_size={batch_size} must be divisible by the data-parallel size {dp_size}")
        self.cfg, self.batch_size, self.dp_rank, self.dp_size, self.seed = cfg, batch_size, dp_rank, dp_size, seed
        self.processor = processor
        self.prompts, self.report = load_prompts(cfg, tokenizer, processor=processor, label_required=label_required,
                                                 label_is_text=label_is_text, max_sample_len=max_sample_len)
        self.num_too_long = self.report.too_long
        self.turn_end = turn_end_stops(tokenizer, cfg)  # what ends SFT targets and rollouts besides EOS
        if self.turn_end and dp_rank == 0:
            logger.info("the chat template ends an assistant's turn with %r (id %d), not EOS %r: SFT targets end "
                        "with it and rollouts stop at it", tokenizer.convert_ids_to_tokens(self.turn_end[0]),
                        self.turn_end[0], tokenizer.eos_token)
        self.skipped_when_drawn: collections.Counter = collections.Counter()
        if len(self.prompts) < batch_size:
            raise ValueError(f"{cfg.path} has {len(self.prompts)} usable prompts, fewer than "
                             f"rollout.batch_size={batch_size}")
        self.epoch, self.offset, self._front = 0, 0, []
        self._order = self._make_order()

    def keep_only(self, rows: set[int]) -> int:
        """Keep the prompts of these source rows only (those every rank could load: an image fetched over http can
        fail on one rank alone, and ranks drawing from different lists would index different prompts). Returns
        how many were dropped; they count as skipped (`data/skipped_not_on_every_rank`)."""
        before = len(self.prompts)
        self.prompts = [p for p in self.prompts if p.index in rows]
        self.report.skipped["not_on_every_rank"] += before - len(self.prompts)
        if len(self.prompts) < self.batch_size:
            raise ValueError(f"{self.cfg.path} has {len(self.prompts)} prompts that every rank could load, fewer than "
                             f"rollout.batch_size={self.batch_size}")
        if len(self.prompts) != before:
            self._order = self._make_order()
        return before - len(self.prompts)

    def _make_order(self) -> list[int]:
        """The epoch's seeded order, its first prompts `_front`: when a batch spans two epochs, the new epoch
        starts with prompts not in the old one's tail (where there are enough), so no batch holds a prompt twice."""
        order = list(range(len(self.prompts)))
        if self.cfg.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        front = set(self._front)
        return self._front + [i for i in order if i not in front]

    def next_batch(self, n: int | None = None) -> list[Prompt]:
        """This rank's share of the next n prompts (default rollout.batch_size); epochs roll over.
        Image-text prompts come with their pixel patches."""
        n = n or self.batch_size
        if n % self.dp_size or n > len(self._order):
            raise ValueError(f"cannot draw {n} prompts over {self.dp_size} ranks from {len(self._order)}")
        ids = self._order[self.offset:self.offset + n]
        self.offset += n
        if len(ids) < n:  # the epoch's tail is used, and the batch is filled from the next epoch's order
            self.epoch, self.offset = self.epoch + 1, n - len(ids)
            self._front, tail = [], set(ids)
            self._front = [i for i in self._make_order() if i not in tail][:self.offset]
            self._order = self._make_order()
            ids += self._order[:self.offset]
        # rank r takes the r-th contiguous part: the global batch, rank after rank, is then the draw's order, so
        # the trainer's mini-batches (contiguous in it) hold the same prompts whatever dp is
        share = n // self.dp_size
        mine = ids[self.dp_rank * share:(self.dp_rank + 1) * share]
        drawn, skipped = with_pixels([self.prompts[i] for i in mine], self.cfg, self.processor, self.cfg.path)
        self.skipped_when_drawn += skipped
        return drawn

    def skipped_metrics(self, reduce_sum, when_drawn: collections.Counter | None = None) -> dict[str, float]:
        """`data/skipped_<reason>`: rows skipped at load (every rank read the same file) plus prompts skipped
        when drawn (`when_drawn`: those counted up to an earlier draw), summed over ranks by `reduce_sum` (a
        collective: call on every rank). Only reasons seen."""
        when_drawn = self.skipped_when_drawn if when_drawn is None else when_drawn
        drawn = reduce_sum([float(when_drawn[r]) for r in SKIP_REASONS])
        out = {f"data/skipped_{r}": self.report.skipped[r] + d for r, d in zip(SKIP_REASONS, drawn)
               if self.report.skipped[r] + d}
        if self.report.too_long:  # over data.max_prompt_len, dropped at load (the start-up line says it too)
            out["data/skipped_too_long"] = self.report.too_long
        return dict(sorted(out.items()))

    def state_dict(self) -> dict:
        """Where the order stands, and this rank's prompts skipped when drawn (a checkpoint records their sum over
        ranks: `with_skips_of_all_ranks`)."""
        return {"epoch": self.epoch, "offset": self.offset, "front": self._front, "order": self._order_settings(),
                "skipped_when_drawn": {r: n for r, n in self.skipped_when_drawn.items() if n}}

    @staticmethod
    def with_skips_of_all_ranks(state: dict, reduce_sum) -> dict:
        """`state` (a state_dict of this rank) with the skips of every rank summed by `reduce_sum` (a collective)."""
        mine = state.get("skipped_when_drawn", {})
        total = reduce_sum([float(mine.get(r, 0)) for r in SKIP_REASONS])
        return {**state, "skipped_when_drawn": {r: int(n) for r, n in zip(SKIP_REASONS, total) if n}}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state: its skip counts (the sum over the ranks that wrote it) go to dp rank 0, so the
        cumulative `data/skipped_*` continue where they were."""
        self.epoch, self.offset, self._front = state["epoch"], state["offset"], list(state.get("front", []))
        self.skipped_when_drawn = collections.Counter(state.get("skipped_when_drawn", {}) if self.dp_rank == 0 else {})
        self._order = self._make_order()
        saved, now = state.get("order"), self._order_settings()  # no "order" in checkpoints of older versions
        if saved is not None and saved != now:
            changes = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v)
            logger.warning("resumed with another prompt order (%s): the run continues at position %d of epoch %d "
                           "of the new order, so prompts of this epoch may repeat or be left out until it ends",
                           changes, self.offset, self.epoch)

    def _order_settings(self) -> dict:
        """What the order of prompts follows from: a resume with other values continues in another order."""
        return {"data.path": str(Path(self.cfg.path).resolve()), "prompts": len(self.prompts),
                "data.shuffle": self.cfg.shuffle, "train.seed": self.seed}


def to_samples(prompts: list[Prompt], n: int, first_group_id: int) -> list[Sample]:
    """n empty samples per prompt, sharing a group id."""
    return [Sample(prompt_ids=list(p.prompt_ids), prompt_text=p.prompt_text, label=p.label,
                   metadata=dict(p.metadata), group_id=first_group_id + g)
            for g, p in enumerate(prompts) for _ in range(n)]


_REPLY = "slime-reply-0f3a"  # the assistant's content in turn_end_id's rendering: text no template adds itself


def turn_end_id(tokenizer, cfg: DataConfig) -> int:
    """The token that ends a response: EOS, unless the prompts are rendered by a chat template
    (data.apply_chat_template) that ends an assistant's turn with another special token. Base models' tokenizers
    do so (Qwen2.5's EOS is <|endoftext|> and its template ends a turn with <|im_end|>; Llama-3.1's <|end_of_text|>
    and <|eot_id|>): SFT targets end with that token and rollouts stop at it, so a model learns to end its turn as
    the template renders one. A template that ends a turn with text, or cannot render a user-assistant exchange,
    leaves EOS."""
    eos = tokenizer.eos_token_id
    if not (cfg.apply_chat_template and tokenizer.chat_template):
        return eos
    try:
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _REPLY}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # a template's raise_exception (it wants a system message first, say)
        return eos
    if not isinstance(text, str) or _REPLY not in text:
        return eos
    after = tokenizer(text[text.rindex(_REPLY) + len(_REPLY):], add_special_tokens=False).input_ids
    special = {*tokenizer.all_special_ids, *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)}
    return after[0] if after and after[0] in special else eos


def turn_end_stops(tokenizer, cfg: DataConfig) -> tuple[int, ...]:
    """Stop ids a rollout needs besides the engines' EOS: the chat template's turn end where it is not EOS."""
    end = turn_end_id(tokenizer, cfg)
    return () if end == tokenizer.eos_token_id else (end,)


def sft_samples(prompts: list[Prompt], tokenizer, turn_end: tuple[int, ...] = ()) -> list[Sample]:
    """Supervised samples: the label's text followed by the turn's end (`turn_end`, turn_end_stops'; EOS when
    empty) is the response to learn."""
    end_id = turn_end[0] if turn_end else tokenizer.eos_token_id
    samples = []
    for p in prompts:
        if p.label is None:
            raise ValueError(f"SFT needs a label for every prompt; {p.where} has none (data.label_key)")
        target = list(p.target_ids) if p.target_ids is not None else \
            tokenizer(label_text(p.label), add_special_tokens=False).input_ids + [end_id]
        samples.append(Sample(prompt_ids=list(p.prompt_ids), response_ids=target, prompt_text=p.prompt_text,
                              response_text=label_text(p.label), label=p.label, metadata=dict(p.metadata),
                              group_id=p.index, finish_reason="stop",
                              mm=None if p.mm is None else p.mm.without_images()))
    return samples
