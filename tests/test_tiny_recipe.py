"""The CPU recipe, shortened: SFT from a random init (examples/tiny_arith_sft.yaml), then GRPO from its
export (examples/cpu_tiny_grpo.yaml) with held-out evaluation, on 2 gloo ranks. Checks that the
pipeline produces what the main job promises (eval accuracy before and after, metrics, the plot);
whether the run learns is measured by the full run (docs/tiny_arith.md), not asserted here.
"""
import json

from conftest import REPO, run_ranks
from data_tools.build_tiny_arith import MODEL, write_data
from data_tools.make_tiny_model import make_tiny_model
from slime.config import load_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evals(rows):
    return [r for r in rows if "eval/accuracy" in r]


def test_sft_then_grpo_writes_eval_before_and_after_and_plot(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    init = make_tiny_model(tmp_path / "init", **MODEL)
    with open(data / "eval.jsonl", "a") as f:  # a row the reward cannot score: left out and reported
        f.write(json.dumps({"prompt": "1+1="}) + "\n")
    common = [f"data.path={data / 'train.jsonl'}", f"eval.path={data / 'eval.jsonl'}", "eval.max_prompts=8"]

    sft_dir = tmp_path / "sft"
    run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/tiny_arith_sft.yaml"), f"model.path={init}",
               f"log.run_dir={sft_dir}", "train.num_steps=4", "train.warmup_steps=0", "rollout.batch_size=32",
               "eval.interval=2", *common, "eval.max_prompts=1"])  # rank 1's share is empty: it still takes part
    sft = read_metrics(sft_dir)
    losses = [r["train/loss"] for r in sft if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]  # cross-entropy on label + EOS goes down
    assert [r["step"] for r in evals(sft)] == [0, 2, 4]
    assert all(r["eval/num_prompts"] == 1 and r["eval/skipped_missing_label"] == 1 for r in evals(sft))
    assert (sft_dir / "hf/model.safetensors").is_file()

    rl_dir = tmp_path / "grpo"
    proc = run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
                      f"model.path={sft_dir / 'hf'}", f"log.run_dir={rl_dir}", "train.num_steps=2",
                      "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "eval.interval=1", *common])
    rows = read_metrics(rl_dir)
    ev = evals(rows)
    assert [r["step"] for r in ev] == [0, 1, 2]  # before training, then every eval.interval steps
    assert all(r["eval/num_prompts"] == 8 and 0.0 <= r["eval/accuracy"] <= 1.0 for r in ev)
    assert all(r["eval/skipped_missing_label"] == 1 for r in ev)
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("rollout/reward_mean", "rollout/response_len", "train/entropy", "time/step"):
        assert all(key in r for r in steps), key
    assert all(r["rollout/response_len"] <= 5 for r in steps)  # rollout.max_response_len
    assert "eval after step 0/2" in proc.stdout and "eval after step 2/2" in proc.stdout
    # the long phases are said as they start (minutes each on a GPU recipe, silent before)
    assert "evaluating after step 2" in proc.stdout and "saving the checkpoint of step 2" in proc.stdout
    assert f"exporting the HF model of step 2 to {rl_dir / 'hf'}" in proc.stdout
    assert "train.cpu_malloc=retain: " in proc.stdout  # the CPU default (tests/test_cpu_malloc.py: its effect)
    documented = (REPO / "docs/metrics.md").read_text()
    for key in {k for r in rows + sft for k in r if k != "step"}:  # every key logged is explained there
        prefix = key.split("/")[0] + "/"
        assert f"`{key}`" in documented or key.startswith(("data/skipped_", "eval/skipped_")) and \
            f"`{prefix}skipped_<reason>`" in documented, key
    assert (rl_dir / "metrics.png").read_bytes().startswith(PNG_MAGIC)


def test_main_config_uses_shipped_files_with_a_disjoint_eval_split():
    """A fresh clone runs the main job without generating anything: model and data are in assets/."""
    cfg = load_config(REPO / "examples/cpu_tiny_grpo.yaml")
    assert (REPO / cfg.model.path / "config.json").is_file()
    assert (REPO / cfg.model.path / "tokenizer.json").is_file()
    train, held_out = ([json.loads(line)["prompt"] for line in (REPO / path).read_text().splitlines()]
                       for path in (cfg.data.path, cfg.eval.path))
    assert len(held_out) >= 200 and cfg.eval.max_prompts in (0, *range(200, len(held_out) + 1))
    assert not set(train) & set(held_out)


def test_sft_learns_at_temperature_one_whatever_the_rollout_temperature(tmp_path):
    """SFT divided the logits by rollout.temperature: its loss was CE(softmax(z / T)), with T from a config
    copied from an RL recipe, and the model fitted logits T times too large."""
    data = tmp_path / "data"
    write_data(data)
    init = make_tiny_model(tmp_path / "init", **MODEL)
    losses = {}
    for t in (1.0, 0.7):
        run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/tiny_arith_sft.yaml"), f"model.path={init}",
                   f"log.run_dir={tmp_path / str(t)}", f"data.path={data / 'train.jsonl'}", "eval.path=null",
                   "train.num_steps=1", "rollout.batch_size=8", f"rollout.temperature={t}",
                   "checkpoint.export_hf=false",  # and a reward it never scores with: not loaded (nor checked)
                   *(["rollout.reward.fn=model:/no/such/reward-model"] if t != 1.0 else [])], nproc=1)
        losses[t] = [r["train/loss"] for r in read_metrics(tmp_path / str(t)) if "train/loss" in r]
    assert losses[0.7] == losses[1.0]
