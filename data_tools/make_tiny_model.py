"""Write a tiny randomly initialised causal LM with a character-level tokenizer, in HF format.

    python data_tools/make_tiny_model.py --out assets/tiny-random --arch qwen2

The tokenizer is built with the `tokenizers` library: byte-level BPE with no merges, i.e. one token
per byte, plus chat special tokens and a chat template, so the whole data path (template, stop
tokens) is exercised. Byte-level BPE is what Qwen2's tokenizer class rebuilds from vocab + merges
on load, so `AutoTokenizer` reproduces it exactly.
"""
from __future__ import annotations

import argparse
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<system>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<system>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<user>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<assistant>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_pos: int = 512, tie: bool = False):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    extra = {"head_dim": hidden // heads} if arch == "qwen3" else {}
    return cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
               tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=None, **extra)


def make_tiny_model(out: str | Path, *, arch: str = "qwen2", seed: int = 0, **config_kwargs) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), **config_kwargs))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3", "llama"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = make_tiny_model(args.out, arch=args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
