"""Model adapters: what weight sync pushes and export_hf writes is exactly what a checkpoint holds.

For every family (tiny random configs built offline), the reference is the unwrapped model's own
`save_pretrained`: its safetensors keys and shapes. The trainer side runs on 2 ZeRO-3 ranks.
"""
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from conftest import REPO, run_ranks
from data_tools.make_tiny_model import VL_ARCHS, make_tiny_model
from dist.actor_checks import fixed_batch
from slime.models.adapters import ModelAdapter, get_adapter, read_checkpoint_shapes

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "qwen2_vl", "qwen2_5_vl"]
SCORED = {"llama", "qwen2", "qwen3", "qwen3_moe"}  # export -> from_pretrained -> the trainer's logprobs


def auto_class(arch):
    return AutoModelForImageTextToText if arch in VL_ARCHS else AutoModelForCausalLM


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=1) for arch in FAMILIES}


@pytest.fixture(scope="module")
def checks(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter_checks")
    specs = [f"{arch}={path}" + (":score" if arch in SCORED else "") for arch, path in models.items()]
    run_ranks([str(REPO / "tests/dist/adapter_checks.py"), str(out), *specs], timeout=1200)
    return out


def saved_keys(model, tmp_path):
    """The reference: keys and shapes of the unwrapped model's own save_pretrained."""
    model.save_pretrained(tmp_path)
    return read_checkpoint_shapes(tmp_path)


@pytest.mark.parametrize("arch", FAMILIES)
def test_sync_and_export_names_equal_save_pretrained(arch, models, checks, tmp_path):
    model = auto_class(arch).from_pretrained(models[arch])
    expected = saved_keys(model, tmp_path / "ref")
    synced = {k: tuple(v) for k, v in json.loads((checks / arch / "sync.json").read_text()).items()}
    assert synced == expected
    assert read_checkpoint_shapes(checks / arch / "hf") == expected
    if arch in ("qwen3_moe", "qwen2_vl"):  # the families whose memory layout differs from the checkpoint
        assert set(expected) != {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("arch", FAMILIES)
def test_export_reloads_with_the_trainer_weights(arch, models, checks):
    exported = auto_class(arch).from_pretrained(checks / arch / "hf")
    original = auto_class(arch).from_pretrained(models[arch])  # no step was taken: the weights are the initial ones
    ref = dict(original.named_parameters())
    for name, p in exported.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", FAMILIES)
def test_hf_engine_loads_checkpoint_named_buckets(arch, models, checks):
    """The engine started from zeros and received only checkpoint-named tensors (fused experts split)."""
    state = torch.load(checks / arch / "engine_state.pt")
    original = dict(auto_class(arch).from_pretrained(models[arch]).named_parameters())
    assert set(state) == set(original)
    for name, t in state.items():
        torch.testing.assert_close(t, original[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", sorted(SCORED))
def test_exported_model_gives_the_trainer_logprobs(arch, checks):
    model = AutoModelForCausalLM.from_pretrained(checks / arch / "hf", attn_implementation="sdpa")
    trainer = torch.load(checks / arch / "logprobs.pt")
    for s, got in zip(fixed_batch(), trainer):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        p = len(s.prompt_ids)
        want = torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, ids[0, p:, None]).squeeze(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_identity_names_for_a_converted_family_fail_at_load_naming_the_key(models):
    """What an unknown family gets (in-memory names), applied where they are wrong, fails loudly."""
    model = AutoModelForCausalLM.from_pretrained(models["qwen3_moe"])
    wrong = ModelAdapter(family="qwen3_moe", convert=False)
    # (DeepSeek-V3 and other MoE families without an adapter: the message blamed an incomplete checkpoint)
    with pytest.raises(ValueError, match=r"holds its experts fused in memory \('model\.layers\.0\.mlp\.experts\."
                                         r"(gate_up|down)_proj'\) where its checkpoint holds them one by one.*MoE "
                                         r"families with one: qwen2_moe, qwen3_moe, mixtral"):
        wrong.check_checkpoint(model, models["qwen3_moe"])
    get_adapter("qwen3_moe").check_checkpoint(model, models["qwen3_moe"])  # the real adapter passes


def test_a_checkpoint_without_its_output_layer_says_what_may_be_wrong(tmp_path):
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    model = AutoModelForCausalLM.from_pretrained(src)
    weights = load_file(src / "model.safetensors")
    weights.pop("lm_head.weight")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'lm_head.weight' .* the checkpoint lacks it: an incomplete export or copy\? "
                                         r"A model whose output layer .* tie_word_embeddings: true"):
        get_adapter("qwen3").check_checkpoint(model, src)


def test_unknown_family_gets_identity_names():
    adapter = get_adapter("some_new_arch")
    assert not adapter.convert and adapter.positions == "1d"
    t = torch.zeros(2)
    assert adapter.to_checkpoint(None, [("a.weight", t)]) == [("a.weight", t)]


def test_vl_adapter_declares_mrope_and_image_inputs():
    for arch in VL_ARCHS:
        adapter = get_adapter(arch)
        assert adapter.positions == "mrope" and adapter.multimodal
        assert adapter.extra_inputs == ("pixel_values", "image_grid_thw")


def test_a_model_directory_without_config_or_tokenizer_says_what_is_missing(tmp_path):
    import shutil

    from slime.config import ModelConfig
    from slime.models.loading import load_model, load_tokenizer

    src = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    no_tok, no_conf = tmp_path / "no_tok", tmp_path / "no_conf"
    for d, skip in ((no_tok, ("tokenizer",)), (no_conf, ("config.json",))):
        d.mkdir()
        for f in src.iterdir():
            if not f.name.startswith(skip):
                shutil.copy(f, d / f.name)
    with pytest.raises(ValueError, match=r"no_tok: no tokenizer there"):
        load_tokenizer(ModelConfig(path=str(no_tok)))
    with pytest.raises(FileNotFoundError, match=r"no_conf has no config.json"):
        load_model(ModelConfig(path=str(no_conf)), attn_implementation="sdpa")
    # transformers' "You set `ignore_mismatched_sizes` to `False`", which the user did not, naming no path
    wide = tmp_path / "wide"
    shutil.copytree(src, wide)
    (wide / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), "hidden_size": 96}))
    with pytest.raises(ValueError, match=r"model.path=.*wide: the weights do not have the shapes its config.json "
                                         r"gives"):
        load_model(ModelConfig(path=str(wide)), attn_implementation="sdpa")
    # not transformers' "Checkout 'https://huggingface.co/...'" of a hub id
    with pytest.raises(FileNotFoundError, match=r"model.gguf_file=nope.gguf is not a file in model.path=.*no_conf "
                                                r"\(GGUF files there: none\)"):
        load_tokenizer(ModelConfig(path=str(no_conf), gguf_file="nope.gguf"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    for key in ("pad_token", "eos_token"):
        config.pop(key, None)
    (no_conf / "config.json").write_text((src / "config.json").read_text())
    (no_conf / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="neither a pad nor an eos token"):
        load_tokenizer(ModelConfig(path=str(no_conf)))


def test_a_weights_file_cut_short_is_named(tmp_path):
    from slime.config import ModelConfig
    from slime.models.loading import load_model

    src = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors \(\d+ bytes\) cannot be read: .*cut short or corrupt"):
        load_model(ModelConfig(path=str(src)), attn_implementation="sdpa")


def test_an_export_replaces_an_earlier_one_with_other_shards(tmp_path):
    from slime.models.export import save_hf_dir

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="qwen3", seed=0))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_hf_dir(tmp_path / "out", state, model=model)  # one file
    bumped = {k: v + 1 for k, v in state.items()}
    save_hf_dir(tmp_path / "out", bumped, model=model, max_shard_size="20KB")  # shards and an index
    assert not (tmp_path / "out" / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(reloaded[k], bumped[k]) for k in bumped if k in reloaded)


def test_an_export_that_fails_midway_leaves_the_earlier_one_whole(tmp_path):
    from slime.models.export import exported_step, save_hf_dir

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="qwen3", seed=0))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_hf_dir(tmp_path / "out", state, model=model, marker={"step": 3})
    assert exported_step(tmp_path / "out") == 3

    class DiskFull:
        def save_pretrained(self, out):
            raise OSError(28, "No space left on device")

    bumped = {k: v + 1 for k, v in state.items()}
    with pytest.raises(RuntimeError, match=r"writing the HF export's config and tokenizer files in .*\.out\.partial "
                                           r"failed: \[Errno 28\] No space left.*its partial files removed; .*out is "
                                           r"as it was"):
        save_hf_dir(tmp_path / "out", bumped, model=model, extra_savers=[DiskFull()], marker={"step": 5},
                    max_shard_size="20KB")
    assert not (tmp_path / ".out.partial").exists()  # its shards held the space of the full disk
    assert exported_step(tmp_path / "out") == 3  # the earlier export, whole: no new shard, no index beside it
    assert sorted(p.name for p in (tmp_path / "out").glob("model*")) == ["model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(reloaded[k], state[k]) for k in state if k in reloaded)
    assert exported_step(tmp_path / "nowhere") is None


def test_a_shard_the_disk_cannot_take_names_the_file_and_the_free_space(tmp_path, monkeypatch):
    """safetensors says only "I/O error: No space left on device (os error 28)", with no path."""
    from slime.models import export

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="qwen3", seed=0))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def full(*args, **kwargs):
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export, "save_file", full)
    with pytest.raises(RuntimeError, match=r"writing the HF export's .*\.out\.partial/model.safetensors failed: "
                                           r"Error while serializing.*GiB free on that file system \(a full disk, "
                                           r"a quota, a read-only folder\?\), its partial files removed; no earlier "
                                           r"export is at"):
        export.save_hf_dir(tmp_path / "out", state, model=model)
    assert not (tmp_path / ".out.partial").exists()


def test_an_export_stops_at_the_turn_end_the_run_trained(tmp_path):
    """A model trained to end its reply with a chat template's end of turn that is not EOS (<|im_end|> on a base
    model) was exported with the base generation config: HF's generate ran on past every turn end."""
    import json

    from transformers import GenerationConfig

    from slime.models.export import save_hf_dir

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="qwen3", seed=0))
    eos = model.generation_config.eos_token_id
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_hf_dir(tmp_path / "out", state, model=model, stop_ids=(7,))
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [eos, 7]
    assert model.generation_config.eos_token_id == eos  # the trainer's own model is left as it was
    save_hf_dir(tmp_path / "plain", state, model=model)
    assert json.loads((tmp_path / "plain/generation_config.json").read_text())["eos_token_id"] == eos


def test_an_export_folder_that_cannot_be_made_is_named(tmp_path, monkeypatch):
    """A read-only run folder gave Python's bare PermissionError (run as root here: the denial is simulated)."""
    from pathlib import Path

    from slime.models import export

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="qwen3", seed=0))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(RuntimeError, match=r"creating the HF export's folder .*\.out\.partial failed: \[Errno 13\] "
                                           r"Permission denied.*read-only folder\?\).*no earlier export is at"):
        export.save_hf_dir(tmp_path / "out", state, model=model)


def test_an_export_killed_while_it_replaces_the_earlier_one_leaves_one_whole(tmp_path, monkeypatch):
    """The new folder took the export's name in two renames (the earlier one aside, the new one in): a kill
    between them left no export at all. They are exchanged in one step now."""
    from slime.models import export
    from slime.models.export import exported_step, save_hf_dir

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="qwen3", seed=0))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_hf_dir(tmp_path / "out", state, model=model, marker={"step": 3})
    renames = []

    def killed_at_the_second(src, dst):  # a kill after the earlier export went aside
        renames.append((src, dst))
        if len(renames) == 2:
            raise KeyboardInterrupt
        os.rename(src, dst)

    monkeypatch.setattr(export.os, "replace", killed_at_the_second)
    try:
        save_hf_dir(tmp_path / "out", state, model=model, marker={"step": 5})
    except KeyboardInterrupt:
        pass
    assert exported_step(tmp_path / "out") in (3, 5)
    assert not list(tmp_path.glob(".out.*"))


def test_a_family_whose_code_cannot_take_the_packed_attention_is_refused_by_name(tmp_path):
    """Falcon indexes its own table of attention classes: a bare KeyError: 'packed_sdpa' came out of the load."""
    import transformers

    from slime.config import ModelConfig
    from slime.models.attention import PACKED_SDPA
    from slime.models.loading import load_model

    config = transformers.FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "falcon")
    with pytest.raises(ValueError, match=r"the falcon model's code does not call the attention through transformers' "
                                         r"attention interface, so it cannot run the trainer's 'packed_sdpa'.*not "
                                         r"supported \(KeyError: 'packed_sdpa'\)"):
        load_model(ModelConfig(path=str(tmp_path / "falcon")), attn_implementation=PACKED_SDPA)


def test_an_image_text_family_without_an_adapter_is_refused_by_name(tmp_path):
    """A Qwen3-VL loaded with the text adapter: its image rows were refused as for a text-only model, its text rows
    failed in AutoModelForCausalLM with a list of some 200 classes."""
    import transformers

    from slime.config import ModelConfig
    from slime.models.adapters import adapter_for

    transformers.AutoConfig.for_model("qwen3_vl").save_pretrained(tmp_path / "qwen3-vl")
    with pytest.raises(ValueError, match=r"the image-text family 'qwen3_vl' is not supported .* image-text families: "
                                         r"qwen2_vl, qwen2_5_vl"):
        adapter_for(ModelConfig(path=str(tmp_path / "qwen3-vl")))
    for family in ("qwen3", "gemma3"):  # gemma3 has a vision tower, and a causal-LM class for its text
        transformers.AutoConfig.for_model(family).save_pretrained(tmp_path / family)
        assert adapter_for(ModelConfig(path=str(tmp_path / family))).family == family
