"""Load HF models and tokenizers from a local directory (optionally a GGUF file)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from slime.config import ModelConfig


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def check_model_path(cfg: ModelConfig) -> None:
    path = Path(cfg.path)
    if not path.is_dir():
        raise FileNotFoundError(f"model.path={cfg.path} is not a directory; point it at an HF model directory "
                                "(config.json + weights + tokenizer)")


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    check_model_path(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.path, gguf_file=cfg.gguf_file, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(cfg: ModelConfig, *, attn_implementation: str, dtype: torch.dtype | None = None) -> PreTrainedModel:
    check_model_path(cfg)
    return AutoModelForCausalLM.from_pretrained(
        cfg.path, gguf_file=cfg.gguf_file, dtype=dtype or resolve_dtype(cfg.dtype),
        attn_implementation=attn_implementation, trust_remote_code=cfg.trust_remote_code)
