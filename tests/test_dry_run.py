"""`run.py --dry-run`: every GPU recipe resolves its layout and memory from config.json alone, and the
figures of one recipe equal a hand computation."""
import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO
from slime.config import load_config
from slime.dry_run import GIB, plan

RECIPES = {  # recipe -> (model config of its shape, GPUs it was sized for)
    "gpu_qwen3_4b_grpo_gsm8k.yaml": ("qwen3-4b", 8),
    "gpu_qwen3_8b_dapo.yaml": ("qwen3-8b", 8),
    "gpu_qwen3_30b_a3b_moe.yaml": ("qwen3-30b-a3b", 16),
    "gpu_qwen3_8b_long_sp.yaml": ("qwen3-8b", 8),
    "gpu_qwen25vl_3b_geo3k.yaml": ("qwen2.5-vl-3b", 8),
}


CPU_EXAMPLES = {  # the CPU examples too, at 2 ranks (models of the same shape where theirs is built on first use)
    "cpu_tiny_grpo.yaml": "assets/tiny-arith", "tiny_arith_sft.yaml": "assets/tiny-arith",
    "cpu_tiny_vl_grpo.yaml": "assets/tiny-vl", "tiny_vl_sft.yaml": "assets/tiny-vl",
    "cpu_smollm2_grpo.yaml": "examples/model_configs/smollm2-135m", "cpu_tiny_tool_grpo.yaml": "assets/tiny-arith",
}


def test_every_example_is_listed_here():
    assert sorted(p.name for p in (REPO / "examples").glob("*.yaml")) == sorted({**RECIPES, **CPU_EXAMPLES})


@pytest.mark.parametrize("example", sorted(CPU_EXAMPLES))
def test_cpu_examples_pass_the_dry_run(example):
    cfg = load_config(REPO / "examples" / example, [f"model.path={REPO / CPU_EXAMPLES[example]}"])
    p = plan(cfg, 2)
    assert p["world"] == 2 and not p["warnings"]


def run_py_main():
    """run.py's main(), called in-process (test_run_sh_passes_dry_run_through runs the command itself)."""
    spec = importlib.util.spec_from_file_location("slime_run_py", REPO / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_passes_the_dry_run_on_the_gpus_it_was_sized_for(recipe, capsys):
    model, gpus = RECIPES[recipe]
    run_py_main()(["--config", str(REPO / "examples" / recipe), "--dry-run", "--num-gpus", str(gpus),
                   f"model.path={REPO / 'examples/model_configs' / model}"])  # a failure exits: SystemExit
    out = capsys.readouterr().out
    assert "layout:" in out and "per GPU, training:" in out and "per GPU, rollout:" in out
    assert "WARNING: " not in out, out  # each recipe fits the GPUs it states
    assert f"fits in 80.0 GiB per GPU" in out


def test_a_small_models_figures_are_in_units_that_show_them(capsys):
    """The CPU examples' dry run printed "0.000B parameters" and every memory figure as 0.0 GiB."""
    run_py_main()(["--config", str(REPO / "examples/cpu_tiny_grpo.yaml"), "--dry-run", "--num-gpus", "2"])
    out = capsys.readouterr().out
    assert "model assets/tiny-arith: 107.7K parameters (largest layer 16.7K)" in out, out
    # 18 + 2 (gradients summed in fp32) bytes a parameter over 2 ranks
    assert " 0.0 GiB" not in out and "actor states 1.1 MiB" in out, out


def test_a_gpu_recipe_stops_after_its_dry_run_on_a_node_without_a_gpu(tmp_path):
    """scripts/run-qwen3-4B.sh went on to launch its 8 ranks on CPU/gloo, each loading the model in fp32."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this node has a GPU: the recipe would launch")
    done = subprocess.run(["bash", str(REPO / "scripts/run-qwen3-4B.sh"),
                           f"model.path={REPO / 'examples/model_configs/qwen3-4b'}", f"log.run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "fits in 80.0 GiB per GPU" in done.stdout, done.stderr[-2000:]
    assert "recipe: this node shows no GPU; the dry run above is what the recipe launches on 8 GPU(s)" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_reward_model_is_counted_on_every_rank_in_both_phases(tmp_path):
    """A `model:PATH` reward model stays whole on every rank's GPU in bf16 for the whole run: the dry run left it
    out and said a plan fits that needed its 7.5 GiB more per GPU (a 4B reward model beside the 4B policy)."""
    import json

    rm = tmp_path / "rm-qwen3-4b"
    rm.mkdir()
    config = json.loads((REPO / "examples/model_configs/qwen3-4b/config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], num_labels=1)
    (rm / "config.json").write_text(json.dumps(config))
    recipe = REPO / "examples/gpu_qwen3_4b_grpo_gsm8k.yaml"
    policy = f"model.path={REPO / 'examples/model_configs/qwen3-4b'}"
    without = plan(load_config(recipe, [policy]), 8)
    with_rm = plan(load_config(recipe, [policy, f"rollout.reward.fn=model:{rm}"]), 8)
    rm_bytes = 2 * (4_022_468_096 + 2560)  # the policy's parameters (its head tied) and a 2560 x 1 score head
    assert without["reward_model"] == 0 and with_rm["reward_model"] == rm_bytes
    assert with_rm["training_total"] - without["training_total"] == rm_bytes
    assert with_rm["rollout_total"] - without["rollout_total"] == rm_bytes  # colocated: beside the engine
    assert with_rm["cpu_load_bytes_per_node"] - without["cpu_load_bytes_per_node"] == 8 * rm_bytes


def test_hand_computed_figures_for_qwen3_4b_on_8_gpus():
    cfg = load_config(REPO / "examples/gpu_qwen3_4b_grpo_gsm8k.yaml",
                      [f"model.path={REPO / 'examples/model_configs/qwen3-4b'}"])
    p = plan(cfg, 8)
    H, L, V, I, q, kv = 2560, 36, 151936, 9728, 32 * 128, 8 * 128
    per_layer = (q * H + 2 * kv * H + q * H) + 2 * 128 + 3 * H * I + 2 * H  # attention, q/k norms, MLP, norms
    params = V * H + L * per_layer + H  # tied head: the embedding once, plus the final norm
    assert p["params"] == params == 4_022_468_096
    assert (p["world"], p["dp"], p["sp"], p["ep"]) == (8, 8, 1, 1)
    assert p["largest_layer"] == V * H  # the embedding
    assert p["actor_states"] == 4 * V * H + 18 * params // 8 + 2 * params // 8  # ZeRO-3; fp32 accumulation
    tokens = 16384
    # checkpointing on: each layer's bf16 input, and one layer's tensors (with Qwen3's q/k norms; the fp32 upcasts)
    assert p["activations"] == tokens * (L * 2 * H + 2 * (6 * H + 3 * q + 2 * kv + 4 * I) + 4 * 32 + 4 * H
                                         + 2 * 2 * (q + kv) + 2 * (q + kv))
    assert p["logits_chunk"] == 3 * 4 * 2048 * V
    assert p["engine_weights"] == 2 * params and p["rollout_total"] == pytest.approx(0.7 * 80 * GIB + 1.5 * GIB)
    assert p["reference"] == 0 and p["critic_states"] == 0  # GRPO without KL: neither
    assert p["cpu_offload_bytes_per_node"] == 8 * p["actor_states"]  # pinned on the host while SGLang generates
    offload = plan(load_config(REPO / "examples/gpu_qwen3_4b_grpo_gsm8k.yaml", [
        f"model.path={REPO / 'examples/model_configs/qwen3-4b'}", "train.ds_config=ds_configs/zero3_offload.json"]), 8)
    assert offload["cpu_offload_bytes_per_node"] == 0  # its states live on the host: a rollout moves none
    z2 = plan(load_config(REPO / "examples/gpu_qwen3_4b_grpo_gsm8k.yaml", [
        f"model.path={REPO / 'examples/model_configs/qwen3-4b'}", "train.ds_config=ds_configs/zero2.json",
        "algo.kl_coef=0.01", "algo.use_kl_loss=true"]), 8)
    assert z2["zero_stage"] == 2 and z2["actor_states"] == 2 * params + 18 * params // 8 + 2 * params // 8
    assert z2["reference"] == 2 * params  # replicated, bf16
    assert z2["rollout_total"] == pytest.approx(0.7 * 80 * GIB + 1.5 * GIB + 2 * params)  # and awake in rollout
    with pytest.raises(ValueError, match="sets ZeRO stage 2, but parallel.sp > 1"):  # as at launch
        plan(load_config(REPO / "examples/gpu_qwen3_4b_grpo_gsm8k.yaml", [
            f"model.path={REPO / 'examples/model_configs/qwen3-4b'}", "train.ds_config=ds_configs/zero2.json",
            "parallel.sp=2"]), 8)


def test_too_few_gpus_warns_and_bad_layouts_fail():
    cfg = load_config(REPO / "examples/gpu_qwen3_30b_a3b_moe.yaml",
                      [f"model.path={REPO / 'examples/model_configs/qwen3-30b-a3b'}"])
    assert any("training needs about" in w for w in plan(cfg, 8)["warnings"])  # 30B on one node: too much
    assert not plan(cfg, 16)["warnings"]
    with pytest.raises(ValueError, match="parallel.ep=8 must divide --num-gpus=12"):
        plan(cfg, 12)
    cfg.parallel.sp = 3
    with pytest.raises(ValueError, match="parallel.sp=3 must divide --num-gpus=16"):
        plan(cfg, 16)
    cfg.parallel.sp, cfg.parallel.ep = 3, 1  # 32 query heads: sp=3 cannot split them, as launch would say
    with pytest.raises(ValueError, match="parallel.sp=3 must divide the number of attention heads \\(32\\)"):
        plan(cfg, 24)
    # 128 experts a layer do not split over 3 ranks: said here, where DeepSpeed says it after the model loads
    cfg.parallel.sp, cfg.parallel.ep, cfg.rollout.batch_size = 1, 3, 48
    with pytest.raises(ValueError, match=r"parallel.ep=3 does not divide the model's 128 experts per layer .*"
                                         r"use one of \[1, 2, 4, 8, 16, 32, 64, 128\]"):
        plan(cfg, 24)


def test_moe_shapes_count_top_k_experts_a_shared_expert_and_the_layer_ep_leaves_whole(tmp_path):
    """Mixtral keeps its expert width in intermediate_size, and was counted as one expert per token; Qwen2-MoE's
    shared expert runs on every token and was left out. Under ep the largest gathered layer was the experts' share
    even where a module ep does not split (Qwen3-30B-A3B's 311M embedding) is larger."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    from slime.dry_run import model_shape

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **common).save_pretrained(
        tmp_path / "mixtral")
    Qwen2MoeConfig(intermediate_size=160, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   num_experts=4, num_experts_per_tok=2, **common).save_pretrained(tmp_path / "qwen2_moe")
    assert model_shape(str(tmp_path / "mixtral")).mlp_width == 2 * 96
    assert model_shape(str(tmp_path / "qwen2_moe")).mlp_width == 2 * 32 + 48
    qwen3 = model_shape(str(REPO / "examples/model_configs/qwen3-30b-a3b"))
    assert qwen3.mlp_width == 8 * 768 and qwen3.largest_dense_layer == 151936 * 2048  # the embedding
    cfg = load_config(REPO / "examples/gpu_qwen3_30b_a3b_moe.yaml",
                      [f"model.path={REPO / 'examples/model_configs/qwen3-30b-a3b'}"])
    p = plan(cfg, 16)
    assert cfg.parallel.ep == 8 and qwen3.largest_layer // 8 < qwen3.largest_dense_layer
    assert p["actor_states"] == 4 * qwen3.largest_dense_layer + 18 * p["params"] // 16 + 2 * p["params"] // 16


def test_a_budget_below_the_longest_sample_is_a_warning():
    """The run found it at the step that drew such a sample, after its rollout; the dry run says it before."""
    cfg = load_config(REPO / "examples/cpu_tiny_grpo.yaml", [f"model.path={REPO / 'assets/tiny-arith'}",
                                                              "train.max_tokens_per_gpu=8"])
    longest = cfg.data.max_prompt_len + cfg.rollout.max_response_len - 1
    assert any(f"is {longest} tokens" in w and "train.max_tokens_per_gpu = 8" in w for w in plan(cfg, 2)["warnings"])
    cfg.parallel.sp = 2  # sp cuts a sample over its peers: twice the room, still short
    assert any(f"raise train.max_tokens_per_gpu to {-(-longest // 2)}" in w.lower() for w in plan(cfg, 2)["warnings"])


def test_run_sh_passes_dry_run_through(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "run.sh"), str(REPO / "examples/gpu_qwen3_4b_grpo_gsm8k.yaml"),
                           "--dry-run", f"model.path={REPO / 'examples/model_configs/qwen3-4b'}"],
                          capture_output=True, text=True, cwd=REPO, timeout=300, env={"NPROC": "8", "PATH": "/usr/bin:/bin:" + sys.prefix + "/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "8 trainer ranks" in proc.stdout and "deepspeed" not in proc.stdout.lower().split("layout")[0]


def test_an_sglang_pool_smaller_than_the_weights_is_refused():
    cfg = load_config(REPO / "examples/gpu_qwen3_8b_long_sp.yaml",
                      [f"model.path={REPO / 'examples/model_configs/qwen3-8b'}", "rollout.sglang.mem_fraction=0.15"])
    with pytest.raises(ValueError, match=r"mem_fraction=0.15 of 80 GiB = 12.0 GiB\) does not hold the model's bf16"):
        plan(cfg, 8, 80.0)


def test_the_dry_run_names_a_missing_model_an_unknown_reward_and_data_not_there_yet(tmp_path, capsys):
    """It printed "Repo id must be in the form 'repo_name'" for a missing model folder, and "fits" for a reward
    name that the run refuses at once."""
    recipe = ["--config", str(REPO / "examples/gpu_qwen3_4b_grpo_gsm8k.yaml"), "--dry-run", "--num-gpus", "8"]
    with pytest.raises(SystemExit, match=r"dry run: model.path=.*nope is not a directory"):
        run_py_main()([*recipe, f"model.path={tmp_path / 'nope'}"])
    model = f"model.path={REPO / 'examples/model_configs/qwen3-4b'}"
    with pytest.raises(SystemExit, match=r"dry run: .*nosuch"):
        run_py_main()([*recipe, model, "rollout.reward.fn=nosuch"])
    capsys.readouterr()
    run_py_main()([*recipe, model, f"data.path={tmp_path / 'later.jsonl'}"])
    out = capsys.readouterr().out
    assert f"note: data.path={tmp_path / 'later.jsonl'} is not a file here yet: the run needs it" in out


def test_the_dry_run_refuses_what_the_run_refuses_at_start(tmp_path, capsys):
    """A model whose packed samples would not compute as each alone (dynamic rope past its context), and more
    mini-batches than a step has samples: the dry run said "fits"; the run refused the one at start and failed the
    other after its first rollout."""
    import json

    config = json.loads((REPO / "assets/tiny-arith/config.json").read_text())
    config.update(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                               "rope_theta": 10000.0})
    (tmp_path / "dyn").mkdir()
    (tmp_path / "dyn/config.json").write_text(json.dumps(config))
    example = ["--config", str(REPO / "examples/cpu_tiny_grpo.yaml"), "--dry-run", "--num-gpus", "2"]
    with pytest.raises(SystemExit, match=r"dry run: model.path=.*dyn uses dynamic rope"):
        run_py_main()([*example, f"model.path={tmp_path / 'dyn'}"])
    with pytest.raises(SystemExit, match=r"train.num_mini_batches=8 optimizer steps per batch, but a step has 4 "
                                         r"samples \(rollout.batch_size x rollout.n_samples_per_prompt\)"):
        run_py_main()([*example, "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "train.num_mini_batches=8"])


def test_sft_without_evaluation_plans_no_engine(capsys):
    """SFT builds a rollout engine only to evaluate: the dry run added an hf engine's weights (15 GiB a GPU at 8B)."""
    cfg = load_config(REPO / "examples/tiny_arith_sft.yaml", [f"model.path={REPO / 'assets/tiny-arith'}",
                                                              "eval.path=null"])
    p = plan(cfg, 2)
    assert p["engines"].startswith("none") and p["engine_weights"] == 0 == p["rollout_total"]
    with_eval = plan(load_config(REPO / "examples/tiny_arith_sft.yaml", [f"model.path={REPO / 'assets/tiny-arith'}",
                                                                          "eval.path=e.jsonl"]), 2)
    assert with_eval["engine_weights"] > 0 and with_eval["training_total"] == p["training_total"] + \
        with_eval["engine_weights"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_activation_formula_is_what_autograd_keeps(arch, dtype, tmp_path):
    """activation_bytes against the tensors a training forward saves for backward (saved-tensor hooks, each
    storage once, parameters left out), per layer: 4 layers less 2 layers, with q wider than the hidden size. The
    formula before counted 1.5-1.7x too little (the norms' outputs, the rotated q and k, attention's output twice,
    SwiGLU's fourth tensor; the fp32 upcasts under bf16)."""
    import torch
    import transformers

    from slime.data.batch import build_micro_batch
    from slime.data.sample import Sample
    from slime.dry_run import activation_bytes, model_shape
    from slime.models.attention import PACKED_SDPA
    from slime.models.policy import PolicyModel

    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(5, 200, (16,), generator=g).tolist(),
                      response_ids=torch.randint(5, 200, (16,), generator=g).tolist()) for _ in range(16)]
    mb = build_micro_batch(samples, range(16))
    saved = {}
    for layers in (2, 4):
        config = cls[arch](vocab_size=256, hidden_size=192, intermediate_size=640, num_hidden_layers=layers,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=48, tie_word_embeddings=False)
        config.save_pretrained(tmp_path / f"{layers}")
        torch.manual_seed(0)
        model = PolicyModel(transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=PACKED_SDPA, dtype=getattr(torch, dtype)))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                  target_ids=mb.target_ids)
        saved[layers] = sum(kept.values())
    shape = model_shape(str(tmp_path / "4"))
    assert shape.qk_norm == (arch == "qwen3")
    tokens = mb.input_ids.numel()
    per_two_layers = activation_bytes(shape, tokens, False, 4 if dtype == "float32" else 2) // 2
    assert saved[4] - saved[2] == pytest.approx(per_two_layers, rel=0.005)
