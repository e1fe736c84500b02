"""Load HF models (through their family's adapter) and tokenizers from a local directory."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from slime.config import ModelConfig
from slime.models.adapters import ModelAdapter, adapter_for
from slime.models.attention import packing_refusal


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def check_model_path(cfg: ModelConfig, key: str = "model.path") -> None:
    """`key`: the setting that names the folder (algo.critic.path for a critic)."""
    path = Path(cfg.path)
    if path.is_file() and path.suffix == ".gguf":
        raise FileNotFoundError(f"{key}={cfg.path} is a GGUF file: set {key} to its folder and "
                                f"model.gguf_file={path.name}, or convert it with data_tools/gguf_to_hf.py")
    if not path.is_dir():
        where = "" if path.is_absolute() else f" ({path.resolve()}: relative paths are read from {Path.cwd()})"
        raise FileNotFoundError(f"{key}={cfg.path} is not a directory{where}; point it at an HF model "
                                "directory (config.json + weights + tokenizer)")
    if cfg.gguf_file is not None and not (path / cfg.gguf_file).is_file():
        found = sorted(p.name for p in path.glob("*.gguf"))
        raise FileNotFoundError(f"model.gguf_file={cfg.gguf_file} is not a file in {key}={cfg.path} (GGUF files "
                                f"there: {', '.join(found) or 'none'})")
    if cfg.gguf_file is None and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{key}={cfg.path} has no config.json; an HF model directory holds config.json, "
                                "the weights and the tokenizer (or set model.gguf_file for a GGUF model)")


def critic_model(cfg) -> ModelConfig:
    """The critic's model settings: the actor's, from algo.critic.path where that is set."""
    return dataclasses.replace(cfg.model, path=cfg.algo.critic.path or cfg.model.path)


def check_critic(cfg, tokenizer) -> None:
    """A critic of its own (algo.critic.path), checked before any model loads: its folder, its weight files, that
    its samples compute in packed rows as alone (check_packing), and that it reads the actor's token ids (its
    vocabulary is at least the actor's, and no id of a tokenizer of its own names another token). A critic of
    another vocabulary failed after the first rollout, blaming the rollout; one of another tokenizer of the same
    size read every token as another. One whose tokenizer lacks some of the actor's tokens is warned."""
    if not (cfg.trains_critic and cfg.algo.critic.path):
        return
    model, key = critic_model(cfg), "algo.critic.path"
    check_model_path(model, key)
    check_weight_files(model, key)
    check_packing(cfg, model, key)
    vocab, actors = text_config_value(model, "vocab_size"), text_config_value(cfg.model, "vocab_size")
    if vocab is not None and actors is not None and vocab < actors:
        raise ValueError(f"{key}={model.path} has a vocabulary of {vocab} tokens (vocab_size in its config.json), "
                         f"fewer than the actor's {actors} (model.path): the critic reads the actor's token ids. Give "
                         "a critic trained with the actor's tokenizer")
    if any((Path(model.path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        own = AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
        mine = {i: t for t, i in own.get_vocab().items()}
        theirs = {i: t for t, i in tokenizer.get_vocab().items()}  # tokens added on one side only are no conflict
        if other := sorted(i for i in mine.keys() & theirs.keys() if mine[i] != theirs[i]):
            raise ValueError(f"{key}={model.path} holds a tokenizer other than model.path's ({len(other)} ids name "
                             f"other tokens, e.g. id {other[0]}: {theirs[other[0]]!r} for the actor, "
                             f"{mine[other[0]]!r} for the critic): the critic would read the actor's token ids as "
                             "other tokens. Give a critic trained with the actor's tokenizer")
        # Tokens of the actor's the critic's tokenizer lacks (ids inside the actor's model: it can write them), e.g.
        # Qwen3's <think> under a Qwen2.5 critic: embedding rows the critic never trained on.
        if unknown := sorted(i for i in theirs.keys() - mine.keys() if actors is None or i < actors):
            logging.getLogger(__name__).warning(
                "%s=%s: its tokenizer lacks %d of the actor's tokens (e.g. %r, id %d): the critic reads them through "
                "embedding rows it was not trained with", key, model.path, len(unknown), theirs[unknown[0]],
                unknown[0])


def check_weight_files(cfg: ModelConfig, key: str = "model.path") -> None:
    """Each safetensors file's header against its size: a file cut short (a copy or a download that stopped)
    fails here by name, not as safetensors' bare 'incomplete metadata' from inside from_pretrained."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(cfg.path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except SafetensorError as e:
            raise ValueError(f"{key}={cfg.path}: {f.name} ({f.stat().st_size} bytes) cannot be read: {e}. The file "
                             "is cut short or corrupt (a copy or download that stopped?); copy or export it again") \
                from None


def text_config_value(cfg: ModelConfig, key: str) -> int | None:
    """An integer of the model's config.json (of its text model, for an image-text one); None if not stated."""
    path = Path(cfg.path) / "config.json"
    if cfg.gguf_file is not None or not path.is_file():
        return None
    conf = json.loads(path.read_text())
    value = conf.get(key) or (conf.get("text_config") or {}).get(key)
    return int(value) if value else None


def check_prompt_vocab(prompts, cfg: ModelConfig, tokenizer, key: str = "data.path") -> None:
    """A prompt whose token ids fall outside the model's vocabulary (a tokenizer with added tokens the model has
    no embedding for: a special token in the text) failed at the first generate call, naming no row."""
    vocab = text_config_value(cfg, "vocab_size")
    if vocab is None:
        return
    for p in prompts:
        if p.prompt_ids and max(p.prompt_ids) >= vocab:
            bad = sorted({t for t in p.prompt_ids if t >= vocab})
            tokens = tokenizer.convert_ids_to_tokens(bad[:3])
            raise ValueError(f"{p.where} ({key}) holds token ids {bad[:5]} ({tokens}) "
                             f"outside model.path's vocabulary [0, {vocab}): the tokenizer has tokens the model has no "
                             "embedding for. Remove them from the text, or give the model's own tokenizer")


def context_length(cfg: ModelConfig) -> int | None:
    """The model's `max_position_embeddings`; None if not stated."""
    return text_config_value(cfg, "max_position_embeddings")


def ids_past_vocabulary(cfg: ModelConfig, ids) -> tuple[int | None, list[int]]:
    """The model's vocabulary size (config.json) and the ids of `ids` at or past it."""
    vocab = text_config_value(cfg, "vocab_size")
    return vocab, [t for t in ids if vocab is not None and t >= vocab]


def check_stop_ids(cfg: ModelConfig, stop_ids) -> None:
    """rollout.stop_token_ids past the model's vocabulary could never be generated: a stop that never stops."""
    vocab, bad = ids_past_vocabulary(cfg, stop_ids)
    if bad:
        raise ValueError(f"rollout.stop_token_ids={list(stop_ids)}: {bad} are past the model's vocabulary of {vocab} "
                         f"tokens (vocab_size in {cfg.path}/config.json), so they never end a response; give ids of "
                         "this model's tokenizer")


def check_turn_end(cfg: ModelConfig, turn_end: tuple[int, ...], tokenizer) -> None:
    """The chat template's turn end (a rollout's stop, SFT's last target) past the model's vocabulary: a stop that
    never stops, and an SFT target the loss cannot take."""
    vocab, bad = ids_past_vocabulary(cfg, turn_end)
    if bad:
        raise ValueError(f"the chat template's turn end {tokenizer.convert_ids_to_tokens(bad[0])!r} (id {bad[0]}) is "
                         f"past the model's vocabulary of {vocab} tokens (vocab_size in {cfg.path}/config.json): the "
                         "model can never generate it, and SFT cannot learn it. The tokenizer in the model folder "
                         "(its chat template) is not this model's, or the model's embeddings were not resized to it")


def check_packing(cfg, model: ModelConfig | None = None, key: str = "model.path") -> None:
    """A model (the actor's, or `model` named by `key`) whose samples would not compute as each alone in a packed
    row or padded batch is refused at start (slime/models/attention.py's packing_refusal), naming the setting
    that avoids it."""
    if not cfg.train.packing and cfg.train.micro_batch_size == 1:
        return
    model = model or cfg.model
    conf = AutoConfig.from_pretrained(model.path, gguf_file=model.gguf_file, trust_remote_code=model.trust_remote_code)
    why = packing_refusal(conf, cfg.data.max_prompt_len + cfg.rollout.max_response_len, packing=cfg.train.packing)
    if why:
        raise ValueError(f"{key}={model.path} {why}")


def warn_past_context(cfg: ModelConfig, longest_prompt: int, max_new_tokens: int, logger,
                      what: str = "prompt", lower: str = "data.max_prompt_len or rollout.max_response_len") -> bool:
    """Warn (True) when the longest prompt plus the response budget passes the model's context length: rope
    models still run there, untrained, on the hf engine, and an SGLang server refuses or cuts such requests."""
    limit = context_length(cfg)
    if limit is None or longest_prompt + max_new_tokens <= limit:
        return False
    logger.warning("the longest %s (%d tokens) plus up to %d new tokens passes the model's context length "
                   "(max_position_embeddings=%d in %s/config.json): positions past it are untrained, and an SGLang "
                   "engine refuses or cuts such requests. Lower %s", what, longest_prompt, max_new_tokens, limit,
                   cfg.path, lower)
    return True


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    check_model_path(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.path, gguf_file=cfg.gguf_file, trust_remote_code=cfg.trust_remote_code)
    if len(tok) <= 1 or not tok("a b", add_special_tokens=False).input_ids:  # transformers builds an empty one
        raise ValueError(f"model.path={cfg.path}: no tokenizer there (tokenizer.json, tokenizer.model or vocab.json); "
                         "copy the model's tokenizer files into the directory")
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ValueError(f"model.path={cfg.path}: the tokenizer has neither a pad nor an eos token; set "
                             "\"eos_token\" (and \"pad_token\") in its tokenizer_config.json")
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: ModelConfig, *, attn_implementation: str, dtype: torch.dtype | None = None,
               backbone_only: bool = False) -> tuple[PreTrainedModel, ModelAdapter]:
    """The model and its family's adapter (which also checks the weight names against the checkpoint)."""
    check_model_path(cfg)
    check_weight_files(cfg)
    adapter = adapter_for(cfg)
    try:
        model = adapter.load(cfg, attn_implementation=attn_implementation, dtype=dtype or resolve_dtype(cfg.dtype),
                             backbone_only=backbone_only)
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e):  # transformers' words for it, whose cause is config.json's
            raise
        raise ValueError(f"model.path={cfg.path}: the weights do not have the shapes its config.json gives "
                         "(transformers' load report above lists them: hidden_size, intermediate_size, head counts?); "
                         "give the config.json the weights were saved with") from None
    except (KeyError, ValueError) as e:  # transformers' own words name its sdpa or a dict's missing key
        if not any(k in str(e) for k in (attn_implementation, "scaled_dot_product_attention")):
            raise
        raise ValueError(f"model.path={cfg.path}: the {adapter.family} model's code does not call the attention through "
                         f"transformers' attention interface, so it cannot run the trainer's {attn_implementation!r} "
                         f"(packed samples); this model family is not supported ({type(e).__name__}: {e})") from None
    return model, adapter


def load_processor(cfg: ModelConfig, tokenizer):
    """The image-text processor of a multimodal model (None for a text model)."""
    if not adapter_for(cfg).multimodal:
        given = [f"model.{k}={getattr(cfg, k)}" for k in ("min_pixels", "max_pixels") if getattr(cfg, k) is not None]
        if given:
            logging.getLogger(__name__).warning("%s ignored: model.path=%s is a text model (they size images)",
                                                ", ".join(given), cfg.path)
        return None
    from slime.multimodal.processor import VLProcessor

    return VLProcessor(cfg.path, tokenizer, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
