"""Write a tiny randomly initialised model with a character-level tokenizer, in HF format.

    python data_tools/make_tiny_model.py --out assets/tiny-random --arch qwen2

Families: dense causal LMs (qwen2, qwen3, llama), MoE (qwen3_moe, qwen2_moe, mixtral: 4 experts, top 2)
and image-text (qwen2_vl, qwen2_5_vl: a 1-block vision tower, multimodal rope over 3 position rows).

The tokenizer is built with the `tokenizers` library: byte-level BPE with no merges, i.e. one token
per byte, plus chat special tokens and a chat template, so the whole data path (template, stop
tokens) is exercised. Byte-level BPE is what Qwen2's tokenizer class rebuilds from vocab + merges
on load, so `AutoTokenizer` reproduces it exactly.
"""
from __future__ import annotations

import argparse
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<system>", "<user>", "<assistant>"]
VISION_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT_ARCHS = ("qwen2", "qwen3", "llama")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")
ARCHS = TEXT_ARCHS + MOE_ARCHS + VL_ARCHS
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<system>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<user>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<assistant>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Image-text models: user content may be a list of parts; an image part renders as Qwen-VL's placeholder.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<system>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<user>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% elif m['role'] == 'assistant' %}<assistant>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Small images: 28x28-pixel tiles (2x2 patches of 14 merge into one token), 1 to 16 tokens per image.
VL_MIN_PIXELS, VL_MAX_PIXELS = 28 * 28, 28 * 28 * 16


def build_tokenizer(vision: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    special = SPECIAL + (VISION_SPECIAL if vision else [])
    vocab = {tok: i for i, tok in enumerate(special + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_pos: int = 512, tie: bool = False, experts: int = 4, tokenizer=None,
                init_std: float = 0.02):
    import transformers

    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=None, initializer_range=init_std)
    if arch in ("qwen3", "qwen3_moe"):
        text["head_dim"] = hidden // heads
    if arch in MOE_ARCHS:
        experts_key = "num_local_experts" if arch == "mixtral" else "num_experts"
        text.update({experts_key: experts, "num_experts_per_tok": 2})
        if arch != "mixtral":
            text["moe_intermediate_size"] = hidden // 2
        if arch == "qwen2_moe":
            text["shared_expert_intermediate_size"] = hidden
    if arch in VL_ARCHS:
        half = hidden // heads // 2  # rotary frequencies per head, split over the temporal/height/width rows
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
        vision = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        if arch == "qwen2_vl":  # embed_dim: the tower's width; hidden_size: the merger's output (the LM's width)
            vision.update(embed_dim=32, hidden_size=hidden, mlp_ratio=2)
        else:
            vision.update(hidden_size=32, out_hidden_size=hidden, intermediate_size=64, fullatt_block_indexes=[0],
                          window_size=56)
        ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
        cls = {"qwen2_vl": transformers.Qwen2VLConfig, "qwen2_5_vl": transformers.Qwen2_5_VLConfig}[arch]
        return cls(text_config=text, vision_config=vision, tie_word_embeddings=tie, initializer_range=init_std, **ids)
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "mixtral": transformers.MixtralConfig}[arch]
    return cls(**text)


def make_tiny_model(out: str | Path, *, arch: str = "qwen2", seed: int = 0, **config_kwargs) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(out)
    tok = build_tokenizer(vision=arch in VL_ARCHS)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch in VL_ARCHS else AutoModelForCausalLM
    model = auto.from_config(tiny_config(arch, len(tok), tokenizer=tok, **config_kwargs))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if arch in VL_ARCHS:
        from transformers import Qwen2VLImageProcessor

        Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=VL_MIN_PIXELS,
                              max_pixels=VL_MAX_PIXELS).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--arch", default="qwen2", choices=ARCHS)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    heads = 4  # tiny_config's
    if args.hidden < heads * 2 or args.hidden % (heads * 2):
        ap.error(f"--hidden {args.hidden} must be a positive multiple of {heads * 2} ({heads} heads of an even size, "
                 "which rotary embeddings need)")
    if args.layers < 1:
        ap.error(f"--layers {args.layers} must be >= 1")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out} is a file; give a directory")
    path = make_tiny_model(args.out, arch=args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
