"""Load HF models (through their family's adapter) and tokenizers from a local directory."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from slime.config import ModelConfig
from slime.models.adapters import ModelAdapter, adapter_for


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


def load_model(cfg: ModelConfig, *, attn_implementation: str, dtype: torch.dtype | None = None,
               backbone_only: bool = False) -> tuple[PreTrainedModel, ModelAdapter]:
    """The model and its family's adapter (which also checks the weight names against the checkpoint)."""
    check_model_path(cfg)
    adapter = adapter_for(cfg)
    model = adapter.load(cfg, attn_implementation=attn_implementation, dtype=dtype or resolve_dtype(cfg.dtype),
                         backbone_only=backbone_only)
    return model, adapter


def load_processor(cfg: ModelConfig, tokenizer):
    """The image-text processor of a multimodal model (None for a text model)."""
    if not adapter_for(cfg).multimodal:
        return None
    from slime.multimodal.processor import VLProcessor

    return VLProcessor(cfg.path, tokenizer, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
