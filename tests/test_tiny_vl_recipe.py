"""The image-text CPU recipe, shortened: SFT of a random-init Qwen2-VL (examples/tiny_vl_sft.yaml),
then GRPO from its export (examples/cpu_tiny_vl_grpo.yaml) with held-out evaluation on 2 gloo ranks.
Checks the pipeline end to end (images drawn, both schemas, metrics, export with its image processor);
whether it learns is measured by the full run (docs/vlm.md ("The tiny task")), not asserted here.
"""
import json

from conftest import REPO, run_ranks
from data_tools.build_tiny_vl import MODEL
from data_tools.make_tiny_model import make_tiny_model
from data_tools.make_vl_task import make_split, write
from slime.config import load_config
from test_tiny_recipe import PNG_MAGIC, evals, read_metrics


def test_vl_sft_then_grpo_runs_with_eval_and_export(tmp_path):
    data = write(tmp_path / "data", n_train=64, n_eval=8, seed=0)
    init = make_tiny_model(tmp_path / "init", **MODEL)
    common = [f"data.path={data / 'train.jsonl'}", f"eval.path={data / 'eval.jsonl'}"]

    sft_dir = tmp_path / "sft"
    run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/tiny_vl_sft.yaml"), f"model.path={init}",
               f"log.run_dir={sft_dir}", "train.num_steps=3", "train.warmup_steps=0", "rollout.batch_size=16",
               "eval.interval=3", *common])
    sft = read_metrics(sft_dir)
    losses = [r["train/loss"] for r in sft if "train/loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert (sft_dir / "hf/preprocessor_config.json").is_file()  # the export carries its image processor

    rl_dir = tmp_path / "grpo"
    proc = run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_vl_grpo.yaml"),
                      f"model.path={sft_dir / 'hf'}", f"log.run_dir={rl_dir}", "train.num_steps=2",
                      "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "eval.interval=1", *common])
    rows = read_metrics(rl_dir)
    assert [r["step"] for r in evals(rows)] == [0, 1, 2]
    assert all(r["eval/num_prompts"] == 8 for r in evals(rows))
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["train/ppo_kl"] == 0.0
    assert steps[0]["rollout/train_logprob_abs_diff"] < 1e-4  # trainer and hf engine agree with images
    assert "eval after step 2/2" in proc.stdout
    assert (rl_dir / "metrics.png").read_bytes().startswith(PNG_MAGIC)

    # a multi-turn generate function on the image prompts: three policy turns around two observations
    turns_dir = tmp_path / "turns"
    run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_vl_grpo.yaml"),
               f"model.path={sft_dir / 'hf'}", f"log.run_dir={turns_dir}", "train.num_steps=1", "eval.path=null",
               "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
               "rollout.generate_fn=custom_rollouts:three_turns",
               "checkpoint.export_hf=false", "log.plot=false", f"data.path={data / 'train.jsonl'}"])
    row, = read_metrics(turns_dir)
    assert 1 < row["rollout/turns"] <= 3 and row["rollout/observation_frac"] > 0, row
    assert row["rollout/train_logprob_abs_diff"] < 1e-4  # each turn's logprobs, with the images, as the trainer's


def test_vl_config_uses_the_shipped_model_and_a_disjoint_eval_split():
    cfg = load_config(REPO / "examples/cpu_tiny_vl_grpo.yaml")
    for name in ("config.json", "tokenizer.json", "preprocessor_config.json", "model.safetensors"):
        assert (REPO / cfg.model.path / name).is_file(), name
    train, held_out = make_split(3000, 300, 0)
    assert len(held_out) == 300 and not {s[:6] for s in train} & {s[:6] for s in held_out}
