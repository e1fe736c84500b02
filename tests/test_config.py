"""Config errors name the key and the fix; overrides and --help work."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from slime.config import Config, describe, load_config
from slime.distributed.ds_config import build_ds_config

BASE = ["model.path=m", "data.path=d.jsonl"]


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {path: d.jsonl}\ntrain: {lr: 1e-5, num_steps: 3}\n")
    cfg = load_config(path, ["train.num_steps=7", "rollout.reward.fn={math: 1.0, format: 0.1}"])
    assert isinstance(cfg, Config)
    assert cfg.train.lr == 1e-5 and cfg.train.num_steps == 7
    assert cfg.rollout.reward.fn == {"math": 1.0, "format": 0.1}


def test_override_text_is_taken_as_written():
    """YAML reads an override's " #..." as a comment and off as False: "Be brief. #1 rule" became "Be brief.", and
    algo.tis.level=off (the default's own spelling) was refused as False."""
    cfg = load_config(None, BASE + ["data.system_prompt=Be brief. #1 rule", "algo.tis.level=off"])
    assert cfg.data.system_prompt == "Be brief. #1 rule" and cfg.algo.tis.level == "off"
    assert load_config(None, BASE + ["data.system_prompt='quoted #kept'"]).data.system_prompt == "quoted #kept"


def test_override_text_for_a_text_field_is_kept_whatever_yaml_reads_in_it():
    """data.system_prompt (str | None): "Answer: 42" read as a mapping, "no" as false, "1.0" as a number, each
    then refused as the wrong type; null still clears it."""
    for text in ("Answer: 42", "no", "1.0", "[a, b]"):
        assert load_config(None, BASE + [f"data.system_prompt={text}"]).data.system_prompt == text
    assert load_config(None, BASE + ["data.system_prompt=null"]).data.system_prompt is None


def test_numbers_are_read_as_yaml_1_2_reads_them(tmp_path):
    """PyYAML reads YAML 1.1: 1e-3 (no dot) was a string inside lists and mappings, where no float field converts
    it (train.betas, a reward's weights), 010 was octal 8 and 1:30 was 90 (base 60)."""
    cfg = load_config(None, BASE + ["train.betas=[0.9, 1e-3]", "rollout.reward.fn={math: 1, format: 1e-1}",
                                    "train.num_steps=010", "train.seed=1_000"])
    assert cfg.train.betas == [0.9, 0.001] and cfg.rollout.reward.fn == {"math": 1, "format": 0.1}
    assert cfg.train.num_steps == 10 and cfg.train.seed == 1000
    with pytest.raises(TypeError, match="train.num_steps='1:30' must be an integer"):
        load_config(None, BASE + ["train.num_steps=1:30"])
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {path: d.jsonl}\ntrain: {betas: [0.9, 1e-3], lr: 2e-6}\n")
    assert load_config(path).train.betas == [0.9, 0.001]


def test_a_section_whose_keys_are_all_commented_out_is_empty(tmp_path):
    """`eval:` with nothing under it is null in YAML: refused as not a mapping, and an override into it said
    "'eval' is not a section"."""
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {path: d.jsonl}\neval:\n  # path: e.jsonl\n")
    assert load_config(path).eval == load_config(None, BASE).eval
    assert load_config(path, ["eval.path=e.jsonl"]).eval.path == "e.jsonl"


def test_a_union_is_named_by_its_members():
    text = describe()
    assert "train.fuse_elementwise = 'auto'  (bool | 'auto')" in text and "(Union)" not in text
    with pytest.raises(TypeError, match=r"expected bool \| 'auto'"):
        load_config(None, BASE + ["train.fuse_elementwise=1"])


def test_int_is_accepted_for_float():
    assert load_config(None, BASE + ["train.lr=1"]).train.lr == 1.0


@pytest.mark.parametrize("override, words", [
    ("train.lrr=1", ["unknown config key 'train.lrr'", "did you mean 'train.lr'"]),
    ("rollout.hf_fused_attention=true", ["'rollout.hf_fused_attention' was renamed", "rollout.hf_compile",
                                         "true -> attention"]),
    ("rollout.hf_compile=true", ["rollout.hf_compile=True", "'step'", "'attention'"]),
    ("trainer.lr=1", ["unknown config key 'trainer'"]),
    ("train.num_steps=abc", ["train.num_steps='abc'", "integer"]),
    ("train.num_steps=1.5", ["train.num_steps", "integer"]),
    ("model.gradient_checkpointing=maybe", ["model.gradient_checkpointing", "true or false"]),
    ("rollout.engine=vllm", ["rollout.engine='vllm'", "'hf'", "'sglang'"]),
    ("rollout.n_samples_per_prompt=1", ["n_samples_per_prompt >= 2"]),
    ("rollout.top_p=0", ["rollout.top_p"]),
    ("train.max_tokens_per_gpu=0", ["train.max_tokens_per_gpu"]),
    ("parallel.sp=0", ["parallel.sp"]),
    ("parallel.ep=0", ["parallel.ep"]),
    ("train=3", ["override 'train=3': train is a section; set its keys"]),
    ("eval.interval=0", ["eval.interval=0", ">= 1"]),
    ("eval.max_prompts=-2", ["eval.max_prompts=-2"]),
    ("rollout.max_response_len=0", ["rollout.max_response_len=0"]),
    ("rollout.stop_token_ids=['</s>']", ["rollout.stop_token_ids", "not token ids"]),
    ("rollout.reward.timeout=.nan", ["rollout.reward.timeout=nan"]),
    # inf turned the guard against a hung user function off; a seed numpy refuses failed after the models loaded
    ("rollout.reward.timeout=inf", ["rollout.reward.timeout=inf", "finite"]),
    ("rollout.generate_fn_timeout=inf", ["rollout.generate_fn_timeout=inf", "finite", "0 = no limit"]),
    ("rollout.sglang.request_timeout=inf", ["request_timeout", "finite"]),
    ("train.dist_timeout_minutes=inf", ["train.dist_timeout_minutes=inf", "finite"]),
    ("train.seed=-1", ["train.seed=-1", "[0, 2**32)"]),
    ("log.run_dir=", ["log.run_dir is empty"]),
    ("rollout.hf_compile=0", ["rollout.hf_compile=0 is not allowed"]),  # 0 == False passed, and meant "auto"
    ("rollout.overlong_penalty.buffer_len=20", ["buffer_len=20 in [0, max_len]"]),
    ("rollout.overlong_penalty.max_len=20480", ["max_len=20480 - buffer_len=0 >= rollout.max_response_len",
                                               "never applies"]),

    ("data.image_fetch_timeout=0", ["data.image_fetch_timeout=0"]),
    ("data.image_placeholder=", ["data.image_placeholder is empty"]),
    ("data.max_prompt_len=0", ["data.max_prompt_len=0"]),
    ("train.logits_chunk_size=0", ["train.logits_chunk_size=0"]),
    ("train.lr=-0.001", ["train.lr=-0.001"]),
    ("rollout.temperature=.nan", ["rollout.temperature=nan", "not a number"]),
    ("rollout.temperature=.inf", ["rollout.temperature=inf must be > 0 and finite"]),
    ("rollout.reward.retry_backoff=.inf", ["retry_backoff must be >= 0 (and finite)"]),
    ("algo.entropy_coef=.nan", ["algo.entropy_coef=nan", "not a number"]),
    ("eval.accuracy_threshold=.nan", ["eval.accuracy_threshold=nan"]),
    ("train.betas=[0.9]", ["train.betas=[0.9]", "two numbers in [0, 1)"]),
    ("train.betas=[1.5,0.999]", ["train.betas=[1.5, 0.999]"]),
    ("algo.kl_coef=-1", ["algo.kl_coef=-1.0 must be >= 0"]),
    ("train.lr=.inf", ["train.lr=inf", "finite"]),
    ("train.micro_batch_size=0", ["train.micro_batch_size=0", ">= 1"]),
    ("train.logprob_max_tokens_per_gpu=-5", ["train.logprob_max_tokens_per_gpu=-5", ">= 0"]),
    ("rollout.sync_bucket_mb=0", ["rollout.sync_bucket_mb=0", "> 0"]),
    ("algo.critic.lr=-1", ["algo.critic.lr=-1.0", ">= 0"]),
    ("algo.critic.value_clip=-1", ["algo.critic.value_clip=-1.0", "> 0"]),
    ("algo.critic.value_loss_coef=-1", ["algo.critic.value_loss_coef=-1.0"]),
    ("algo.critic.warmup_steps=-5", ["algo.critic.warmup_steps=-5"]),
])
def test_bad_config_names_key(override, words):
    with pytest.raises((ValueError, TypeError)) as err:
        load_config(None, BASE + [override])
    for word in words:
        assert word in str(err.value)


def test_an_overlong_ramp_past_the_response_limit_is_refused():
    """max_len past rollout.max_response_len: a response cut at the limit got only part of the penalty (-0.25 for
    max_len 8 and buffer 4 over a limit of 5), while the message of the neighbouring check said DAPO sets max_len
    to the limit."""
    with pytest.raises(ValueError, match=r"rollout.overlong_penalty.max_len=8 > rollout.max_response_len=5: .*only "
                                         r"part of the penalty"):
        load_config(None, BASE + ["rollout.max_response_len=5", "rollout.overlong_penalty.max_len=8",
                                  "rollout.overlong_penalty.buffer_len=4"])
    cfg = load_config(None, BASE + ["rollout.max_response_len=5", "rollout.overlong_penalty.max_len=5",
                                    "rollout.overlong_penalty.buffer_len=2"])
    assert cfg.rollout.overlong_penalty.max_len == 5


def test_min_lr_above_lr_is_refused_where_the_schedule_decays_to_it():
    with pytest.raises(ValueError, match="train.min_lr=0.01 is above train.lr=0.001"):
        load_config(None, BASE + ["train.lr=1e-3", "train.min_lr=0.01", "train.lr_schedule=cosine"])
    # a constant schedule never reads min_lr: an example's min_lr does not refuse a lower train.lr there
    assert load_config(None, BASE + ["train.lr=1e-3", "train.min_lr=0.01", "train.lr_schedule=constant"]).train.lr == 1e-3


@pytest.mark.parametrize("overrides, words", [
    # a coefficient with no KL term to weigh: nothing regularises, yet a reference model is built
    (["algo.kl_coef=0.04"], ["algo.kl_coef=0.04", "algo.use_kl_loss=true", "algo.kl_in_reward=true",
                              "algo.use_reference=true"]),
    # the KL penalty over a constant group's std of 0 would be the whole advantage
    (["algo.kl_in_reward=true", "algo.kl_coef=0.01"], ["algo.normalize_std=true", "algo.use_kl_loss=true",
                                                       "algo.normalize_std=false"]),
    (["algo.loss_agg_constant=0"], ["algo.loss_agg_constant=0", "> 0"]),
    (["algo.policy_loss=sft", "algo.entropy_coef=0.01"], ["algo.policy_loss=sft", "algo.entropy_coef"]),
    (["algo.policy_loss=sft", "algo.use_kl_loss=true", "algo.kl_coef=0.1"], ["algo.policy_loss=sft", "algo.kl_coef"]),
    (["algo.old_logprobs=rollout", "algo.tis.level=token"],
     ["algo.tis", "algo.old_logprobs=rollout", "algo.tis.level=off"]),
    # a group baseline of one sample: every advantage 0
    (["algo.advantage_estimator=reinforce_pp_baseline", "rollout.n_samples_per_prompt=1"],
     ["reinforce_pp_baseline", "n_samples_per_prompt >= 2"]),
    # dynamic sampling keeps groups whose rewards differ: a group of one never has two (it ran out of attempts,
    # blaming the reward function)
    (["algo.advantage_estimator=reinforce_pp", "rollout.dynamic_sampling=true", "rollout.n_samples_per_prompt=1"],
     ["rollout.dynamic_sampling=true", "rollout.n_samples_per_prompt=1"]),
    # k1's gradient on the policy's own samples is zero in expectation: a KL loss that never regularises
    (["algo.use_kl_loss=true", "algo.kl_coef=0.05", "algo.kl_estimator=k1"],
     ["algo.kl_estimator=k1", "zero in expectation", "k3", "k2", "algo.kl_in_reward=true"]),
    # a critic warmup as long as the run: the actor never trains, and the run exported the initial model
    (["algo.advantage_estimator=gae", "algo.critic.warmup_steps=3", "train.num_steps=3"],
     ["algo.critic.warmup_steps=3", "train.num_steps=3"]),
])
def test_algo_settings_that_would_train_on_nothing_or_noise_are_refused(overrides, words):
    with pytest.raises(ValueError) as err:
        load_config(None, BASE + overrides)
    for word in words:
        assert word in str(err.value)
    fixed = {"algo.kl_coef=0.04": ["algo.kl_coef=0.04", "algo.use_kl_loss=true"],
             "algo.use_kl_loss=true": ["algo.use_kl_loss=true", "algo.kl_coef=0.05", "algo.kl_estimator=k2"],
             "algo.advantage_estimator=gae": ["algo.advantage_estimator=gae", "algo.critic.warmup_steps=2",
                                              "train.num_steps=3"],
             "algo.kl_in_reward=true": ["algo.kl_in_reward=true", "algo.kl_coef=0.01", "algo.normalize_std=false"]}
    if overrides[0] in fixed:  # and the fix the message names is accepted
        load_config(None, BASE + fixed[overrides[0]])


def test_sequence_parallel_needs_packing():
    with pytest.raises(ValueError, match="parallel.sp > 1 .* train.packing=true"):
        load_config(None, BASE + ["parallel.sp=2", "train.packing=false"])
    assert load_config(None, BASE + ["parallel.sp=2"]).parallel.sp == 2


def test_a_critic_with_expert_parallelism_is_refused_at_load():
    """AutoEP's layer pattern covers the policy (hf.model.layers.N.mlp), not a critic backbone (hf.layers.N.mlp),
    and a dense critic would get the ep settings too: refused before anything loads."""
    with pytest.raises(ValueError, match="algo.advantage_estimator=gae trains a critic, which parallel.ep > 1"):
        load_config(None, BASE + ["parallel.ep=2", "algo.advantage_estimator=gae"])
    assert load_config(None, BASE + ["parallel.ep=2"]).parallel.ep == 2
    assert load_config(None, BASE + ["algo.advantage_estimator=gae"]).algo.advantage_estimator == "gae"


def test_missing_required_paths():
    with pytest.raises(ValueError, match="model.path is required"):
        load_config(None, ["data.path=d.jsonl"])


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: m, pth: x}\ndata: {path: d}\n")
    with pytest.raises(ValueError, match="model.pth"):
        load_config(path)


def test_describe_lists_every_section_with_docs():
    text = describe()
    for section in ("[model]", "[data]", "[rollout]", "[rollout.reward]", "[algo]", "[train]", "[checkpoint]"):
        assert section in text
    assert "train.lr = 1e-06" in text and "Peak learning rate" in text


def test_run_py_help_and_config_error_exit():
    out = subprocess.run([sys.executable, "run.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "rollout.n_samples_per_prompt" in out.stdout
    bad = subprocess.run([sys.executable, "run.py", "--config", "examples/cpu_tiny_grpo.yaml", "train.lrr=1"],
                         cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "did you mean 'train.lr'" in bad.stderr
    # overrides on both sides of an option: the ones after it were refused as unrecognized arguments
    both = subprocess.run([sys.executable, "run.py", "--config", "examples/cpu_tiny_grpo.yaml", "train.lrr=1",
                           "--dry-run", "train.num_stepz=2"], cwd=REPO, capture_output=True, text=True)
    assert both.returncode != 0 and "did you mean 'train.lr'" in both.stderr
    both = subprocess.run([sys.executable, "run.py", "--config", "examples/cpu_tiny_grpo.yaml", "train.lr=1e-3",
                           "--dry-run", "train.num_stepz=2"], cwd=REPO, capture_output=True, text=True)
    assert both.returncode != 0 and "did you mean 'train.num_steps'" in both.stderr


def test_ds_config_auto_fields_filled(tmp_path):
    cfg = load_config(None, BASE + ["train.lr=3e-4", "train.grad_clip=0.5", "train.weight_decay=0.1"])
    ds = build_ds_config(cfg.train, bf16=False)
    assert ds["optimizer"]["params"]["lr"] == 3e-4
    assert ds["gradient_clipping"] == 0.5 and ds["optimizer"]["params"]["weight_decay"] == 0.1
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is False
    bad = tmp_path / "ds.json"
    adamw = {"optimizer": {"type": "AdamW"}}
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}, **adamw}))
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size"):
        build_ds_config(cfg.train, bad, bf16=False)
    zero0 = tmp_path / "zero0.json"
    zero0.write_text(json.dumps({"zero_optimization": {"stage": 0}, **adamw}))
    with pytest.raises(ValueError, match="zero_optimization.stage is 0; use 1, 2 or 3"):
        build_ds_config(cfg.train, zero0, bf16=False)
    layout = tmp_path / "ep.json"
    layout.write_text(json.dumps({"expert_parallel": {"enabled": True, "autoep_size": 2}, **adamw}))
    with pytest.raises(ValueError, match="parallel.ep"):  # set in one place only: the run config
        build_ds_config(cfg.train, layout, bf16=False)
    for content, words in (('{"zero_optimization": {"stage": 3},}', "is not valid JSON"),
                           ('{"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5, "zero_optimization": {}}',
                            "the key 'zero_optimization' is given twice in one object"),
                           ('{"zero_optimization": {"stage": "three"}, "optimizer": {"type": "AdamW"}}',
                            "zero_optimization.stage='three'"),
                           ('{"zero_optimization": {"stage": 3}, "gradient_clippng": 0.3}',
                            "unknown key 'gradient_clippng' (DeepSpeed would ignore it); did you mean 'gradient_clipping'"),
                           ('{"zero_optimization": {"stage": 3}, "gradient_clipping": 0.3}',
                            "'gradient_clipping' is 0.3 but the run config's train.grad_clip gives 0.5"),
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}',
                            "'optimizer.params.lr' is 0.1 but the run config's train.lr gives 0.0003"),
                           # a bare KeyError: 'optimizer' where the engine was built
                           ('{"zero_optimization": {"stage": 3}}', "has no 'optimizer' section with a 'type'"),
                           # a TypeError about the betas filled in for it
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adagrad"}}',
                            "optimizer type 'Adagrad' is not supported"),
                           # DeepSpeed cast the trainer to fp16, the engines stayed in model.dtype
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam"}, "fp16": {"enabled": '
                            'true}}', "enables fp16: model.dtype sets the precision"),
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam"}, "fp16": true}',
                            "enables fp16: model.dtype sets the precision"),
                           # after every model loaded: "'<=' not supported between instances of 'float' and 'str'"
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"eps": '
                            '"1e-8"}}}', "optimizer.params.eps='1e-8' must be a number (JSON without quotes"),
                           # AdamW's "unexpected keyword argument 'lrr'"
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lrr": 1}}}',
                            "optimizer.params.lrr is not a setting of DeepSpeed's Adam (did you mean 'lr'?)"),
                           # pydantic's error, which named the key but not the file
                           ('{"zero_optimization": {"stage": 3, "stage3_param_persistance_threshold": 10}, '
                            '"optimizer": {"type": "AdamW"}}', "its zero_optimization section is refused by DeepSpeed: "
                            "1 validation error for DeepSpeedZeroConfig\nstage3_param_persistance_threshold"),
                           # the other sections too (DeepSpeed's parse of the whole), also after every model loaded
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": '
                            '"auto", "immediate_grad_update": 3}}', "refused by DeepSpeed: ValidationError: 1 "
                            "validation error for DeepSpeedBF16Config\nimmediate_grad_update"),
                           # DeepSpeed's parse takes any text there
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}, "data_types": '
                            '{"grad_accum_dtype": "fp33"}}', "data_types.grad_accum_dtype='fp33' is not a dtype"),
                           ('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}, "data_types": '
                            '{"grad_acum_dtype": "fp32"}}', "DeepSpeed takes one key there, \"grad_accum_dtype\"")):
        bad.write_text(content)
        with pytest.raises(ValueError) as e:
            build_ds_config(cfg.train, bad, bf16=False)
        assert words in str(e.value) and (words != "is not valid JSON" or str(bad) in str(e.value))


def test_zero1_in_bf16_with_fp32_accumulation_is_refused_under_a_colocated_engine(tmp_path):
    """DeepSpeed runs its BF16_Optimizer for ZeRO-1 in bf16 with data_types.grad_accum_dtype=fp32 (what the shipped
    configs set): it has no offload_states, and a colocated run failed at its first rollout on a GPU."""
    from slime.distributed.ds_config import check_offloadable

    cfg = load_config(None, BASE)
    zero1 = tmp_path / "zero1.json"
    ds = json.loads((REPO / "ds_configs/zero2.json").read_text())
    ds["zero_optimization"]["stage"] = 1
    zero1.write_text(json.dumps(ds))
    with pytest.raises(ValueError, match=r"ZeRO-1 in bf16 with data_types.grad_accum_dtype=fp32 runs DeepSpeed's "
                                         r"BF16_Optimizer, which cannot move its states off the GPU"):
        check_offloadable(build_ds_config(cfg.train, zero1, bf16=True), str(zero1))
    check_offloadable(build_ds_config(cfg.train, zero1, bf16=False), str(zero1))  # fp32: ZeRO-1's own optimizer
    for shipped in ("zero2.json", "zero3.json", "zero3_offload.json"):
        check_offloadable(build_ds_config(cfg.train, REPO / "ds_configs" / shipped, bf16=True), shipped)


def test_ds_config_without_an_owned_key_takes_the_run_configs_and_batch_keys_are_refused(tmp_path):
    """A JSON that left out gradient_clipping, the optimizer's betas / weight decay or bf16 ran with DeepSpeed's
    defaults, the run config's values dropped without a word. Batch sizes and a scheduler are the trainer's: a
    value was overridden (accumulation), refused with DeepSpeed's arithmetic, or applied to the critic only."""
    cfg = load_config(None, BASE + ["train.grad_clip=0.5", "train.weight_decay=0.1", "train.betas=[0.9, 0.95]"])
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}))
    ds = build_ds_config(cfg.train, bare, bf16=True)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert {k: ds["optimizer"]["params"][k] for k in ("lr", "betas", "weight_decay")} == \
        {"lr": cfg.train.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}
    for key, value, setting in (("scheduler", {"type": "WarmupCosineLR"}, "train.lr_schedule"),
                                ("train_batch_size", 256, "rollout.batch_size"),
                                ("gradient_accumulation_steps", 4, "train.max_tokens_per_gpu")):
        bad = tmp_path / f"{key}.json"
        bad.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}, key: value}))
        with pytest.raises(ValueError, match=rf"remove '{key}' .*the run config's {setting}"):
            build_ds_config(cfg.train, bad, bf16=False)


def test_old_logprobs_from_the_update_need_one_mini_batch_and_no_kl_in_reward():
    kl_in_reward = ["algo.kl_in_reward=true", "algo.kl_coef=0.1", "algo.normalize_std=false"]
    for bad in (["train.num_mini_batches=2"], kl_in_reward):
        with pytest.raises(ValueError, match="algo.old_logprobs=train_forward .* train.num_mini_batches=1"):
            load_config(None, BASE + ["algo.old_logprobs=train_forward", *bad])
    assert load_config(None, BASE + ["algo.old_logprobs=train_forward"]).algo.old_logprobs == "train_forward"
    # auto (the default): the scoring pass only where the update's forward is not pi_old
    assert load_config(None, BASE).algo.old_logprobs == "train_forward"
    for recompute in (["train.num_mini_batches=2"], kl_in_reward):
        assert load_config(None, BASE + recompute).algo.old_logprobs == "recompute"


def test_rollout_async_is_another_name_for_one_step_off():
    assert load_config(None, BASE + ["rollout.async=true"]).rollout.one_step_off is True
    with pytest.raises(ValueError, match="rollout.one_step_off is set twice, also by its alias rollout.async"):
        load_config(None, BASE + ["rollout.async=true", "rollout.one_step_off=false"])


def test_rollout_settings_reach_the_engine_sampling_params():
    from slime.rollout.rollout import sampling_params

    cfg = load_config(None, BASE + ["rollout.ignore_eos=true", "rollout.stop_token_ids=[7, 9]", "rollout.top_p=0.9",
                                    "rollout.max_response_len=12", "rollout.n_samples_per_prompt=3"])
    params = sampling_params(cfg.rollout)
    assert (params.ignore_eos, params.stop_token_ids, params.top_p, params.max_new_tokens, params.n) == \
        (True, (7, 9), 0.9, 12, 3)
    assert sampling_params(load_config(None, BASE).rollout).ignore_eos is False


def test_torch_adamw_runs_its_fused_kernel_and_deepspeeds_cuda_adam_gets_no_such_argument(monkeypatch, tmp_path):
    cfg = load_config(None, BASE)
    params = build_ds_config(cfg.train, bf16=False)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True  # CPU: torch.optim.AdamW(fused=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    params = build_ds_config(cfg.train, bf16=True)["optimizer"]["params"]
    assert params["torch_adam"] is False and "fused" not in params
    own = tmp_path / "cpu_adam.json"  # a config that picks DeepSpeed's Adam itself: no fused for it either
    own.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"torch_adam": False, "fused": "auto"}},
                               "zero_optimization": {"stage": 2}}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "fused" not in build_ds_config(cfg.train, own, bf16=False)["optimizer"]["params"]


def test_zero2_refuses_what_needs_partitioned_parameters():
    from slime.distributed.ds_config import check_stage

    cfg = load_config(None, BASE + ["train.ds_config=ds_configs/zero2.json"])
    check_stage(2, cfg.train, sp=1, ep=1, offload_params=False)
    check_stage(3, cfg.train, sp=2, ep=2, offload_params=True)
    for sp, ep, offload, what in ((2, 1, False, "parallel.sp > 1"), (1, 2, False, "parallel.ep > 1"),
                                  (1, 1, True, "algo.ref_offload=true")):
        with pytest.raises(ValueError, match=f"zero2.json sets ZeRO stage 2, but {what}.*use ds_configs/zero3.json"):
            check_stage(2, cfg.train, sp=sp, ep=ep, offload_params=offload)


def test_yaml_errors_and_bad_launch_arguments_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n   bad: 1\n")
    with pytest.raises(ValueError, match=r"bad.yaml is not valid YAML: mapping values are not allowed"):
        load_config(bad)
    with pytest.raises(ValueError, match=r"override 'train.lr=\[1,': the value is not valid YAML"):
        load_config(None, BASE + ["train.lr=[1,"])
    # PyYAML keeps a key's last value: the first `train:` section's settings would be gone without a word
    bad.write_text("train:\n  lr: 0.1\n  num_steps: 3\nmodel:\n  path: x\ntrain:\n  seed: 2\n")
    with pytest.raises(ValueError, match=r"(?s)bad.yaml is not valid YAML: 'train' is given twice in one mapping "
                                         r"\(first on line 1\).*merge them.*bad.yaml\", line 6"):
        load_config(bad)
    with pytest.raises(ValueError, match=r"override 'rollout.sglang.env=\{A: 1, A: 2\}'.*'A' is given twice"):
        load_config(None, BASE + ["rollout.sglang.env={A: 1, A: 2}"])
    example = str(REPO / "examples/cpu_tiny_grpo.yaml")
    bad.unlink()
    for cmd, words in (([sys.executable, str(REPO / "run.py"), "--config", example, "--dry-run", "--num-gpus", "0"],
                        "--num-gpus (0) must be >= 1"),
                       (["bash", str(REPO / "run.sh"), str(bad)], "run.sh: the first argument must be the run config"),
                       (["bash", str(REPO / "run.sh"), "--dry-run", example], "got '--dry-run'"),
                       (["bash", str(REPO / "run.sh")], "usage: run.sh CONFIG.yaml")):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode != 0 and words in proc.stderr, (cmd, proc.stderr[-500:])
    helped = subprocess.run(["bash", str(REPO / "run.sh"), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert helped.returncode == 0 and "usage: run.sh CONFIG.yaml" in helped.stdout, helped.stderr  # not an error
    proc = subprocess.run(["bash", str(REPO / "run.sh"), example], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "NPROC": "0"})
    assert proc.returncode == 2 and "run.sh: NPROC=0 must be a rank count >= 1" in proc.stderr, proc.stderr[-500:]
    # A bad override is said once, before the ranks (each printed it) and before the assets build or the port check
    proc = subprocess.run(["bash", str(REPO / "run.sh"), example, "train.lr=abc", "algo.critic.lr=1e-4"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("train.lr='abc' must be a number") == 1, proc.stderr[-500:]
    assert "rank(s) on" not in proc.stderr + proc.stdout and "ignored" not in proc.stderr, proc.stderr[-500:]


def test_an_unwritable_run_dir_or_a_missing_logger_is_said_before_anything_loads(tmp_path, monkeypatch):
    import importlib.util

    from slime.trainer.loop import check_run_dir

    (tmp_path / "afile").write_text("")
    cfg = load_config(None, BASE)
    with pytest.raises(ValueError, match=r"log.run_dir=.*afile cannot be written"):
        check_run_dir(cfg, tmp_path / "afile")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "checkpoints").write_text("")
    with pytest.raises(ValueError, match=r"taken/checkpoints is a file, where this run keeps its checkpoints"):
        check_run_dir(cfg, tmp_path / "taken")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match="log.tensorboard=true but tensorboard is not installed"):
        check_run_dir(load_config(None, BASE + ["log.tensorboard=true"]), tmp_path / "run")
    # W&B online without an API key: wandb.init failed after the models loaded, with a traceback per rank
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"log.wandb=true in online mode, but no W&B API key .*WANDB_API_KEY.*"
                                         r"`wandb login`.*log.wandb_mode=offline"):
        check_run_dir(load_config(None, BASE + ["log.wandb=true", "log.wandb_mode=online"]), tmp_path / "run")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    check_run_dir(load_config(None, BASE + ["log.wandb=true", "log.wandb_mode=online"]), tmp_path / "run")


def test_a_fresh_start_refuses_a_run_dir_with_another_runs_checkpoints(tmp_path):
    """checkpoint.resume=false in a directory whose metrics are gone but whose checkpoints are not: refused (the
    first save would prune them as if left by this run); an empty checkpoints folder, or resume=true, is fine."""
    from slime.trainer.loop import check_run_dir

    fresh = load_config(None, BASE + ["checkpoint.resume=false"])
    (tmp_path / "checkpoints").mkdir()
    check_run_dir(fresh, tmp_path)
    (tmp_path / "checkpoints" / "step_2").mkdir()
    with pytest.raises(ValueError, match=r"already holds a run \(.*checkpoints/step_2\).*checkpoint.resume=true"):
        check_run_dir(fresh, tmp_path)
    check_run_dir(load_config(None, BASE + ["checkpoint.resume=true"]), tmp_path)


def test_gspo_with_ppo_sized_clips_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="slime.config"):
        load_config(None, ["model.path=m", "data.path=d.jsonl", "algo.policy_loss=gspo"])
    assert "the GSPO paper uses clip_low=3e-4" in caplog.text and "averages over sequences" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="slime.config"):
        load_config(None, ["model.path=m", "data.path=d.jsonl", "algo.policy_loss=gspo", "algo.clip_low=3e-4",
                           "algo.clip_high=4e-4", "algo.loss_agg=seq_mean_token_mean"])
        load_config(None, ["model.path=m", "data.path=d.jsonl"])  # PPO's 0.2 is PPO's
    assert "GSPO" not in caplog.text


def test_a_sections_mapping_on_the_command_line_updates_its_keys_only(tmp_path):
    """`train={seed: 3}` replaced the YAML's whole train section: lr, steps and schedule went back to their
    defaults, unsaid; `train=null` reset it."""
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {path: d.jsonl}\ntrain: {lr: 3.0e-4, num_steps: 7}\n"
                    "rollout: {reward: {fn: {math: 1.0}}}\n")
    cfg = load_config(path, ["train={seed: 3}", "rollout={reward: {fn: {format: 1.0}}, batch_size: 8}"])
    assert (cfg.train.seed, cfg.train.lr, cfg.train.num_steps) == (3, 3e-4, 7)
    assert cfg.rollout.reward.fn == {"format": 1.0} and cfg.rollout.batch_size == 8  # a field's mapping replaces
    with pytest.raises(ValueError, match=r"override 'train=null': train is a section; set its keys \(train.KEY="):
        load_config(path, ["train=null"])
    with pytest.raises(ValueError, match=r"override 'rollout=\{sglang: null\}': rollout.sglang is a section: give a "
                                         r"mapping of its keys, not None"):
        load_config(path, ["rollout={sglang: null}"])


def test_yaml_merge_keys_load_and_a_key_that_is_not_a_name_is_said(tmp_path):
    """`<<: *anchor` (valid YAML, read by yaml.safe_load) was refused as an unknown tag; `1: 2` or `yes: 1` under a
    section said "'int' object is not iterable"."""
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {path: d.jsonl}\ntrain: {<<: {lr: 1.0e-3, num_steps: 7}, lr: 2.0e-3}\n")
    cfg = load_config(path)
    assert (cfg.train.lr, cfg.train.num_steps) == (2e-3, 7)
    path.write_text("model: {path: m}\ndata: {path: d.jsonl}\ntrain: {lr: 1.0e-3, lr: 2.0e-3}\n")
    with pytest.raises(ValueError, match="'lr' is given twice in one mapping"):
        load_config(path)
    path.write_text("model: {path: m}\ndata: {path: d.jsonl}\ntrain:\n  yes: 2\n")
    with pytest.raises(ValueError, match=r"train: the key True is not a name \(YAML reads yes/no/on/off as booleans"):
        load_config(path)
    # the anchors' own section: x-NAME at the top level (as in docker compose files), refused under another name
    shared = "x-small: &small {lr: 1.0e-3, num_steps: 7}\nmodel: {path: m}\ndata: {path: d.jsonl}\n"
    path.write_text(shared + "train: {<<: *small, lr: 2.0e-3}\n")
    assert (load_config(path).train.lr, load_config(path).train.num_steps) == (2e-3, 7)
    path.write_text(shared.replace("x-small", "small") + "train: {<<: *small}\n")
    with pytest.raises(ValueError, match=r"run.yaml: unknown config section 'small' \(sections: model, .*a top-level "
                                         "section that only holds YAML anchors is named x-SOMETHING"):
        load_config(path)
    with pytest.raises(ValueError, match=r"unknown config key 'trian'; did you mean 'train'\? \(valid keys here: "
                                         r"[a-z, ]*\)$"):  # an override's typo: no word of anchors
        load_config(None, ["model.path=m", "data.path=d.jsonl", "trian.lr=1"])


def test_settings_are_one_string_per_key_whatever_a_mappings_order():
    """What ranks compare at start (loop.check_same_config): a mapping in another key order is the same setting."""
    a = load_config(None, ["model.path=m", "data.path=d.jsonl", "rollout.sglang.env={A: '1', B: '2'}"])
    b = load_config(None, ["model.path=m", "data.path=d.jsonl", "rollout.sglang.env={B: '2', A: '1'}"])
    assert a.settings() == b.settings() and a.settings()["train.lr"] == "1e-06"
    assert a.settings() != load_config(None, ["model.path=m", "data.path=d.jsonl", "train.lr=2e-6"]).settings()


def test_a_learning_rate_that_would_wreck_the_model_is_warned(caplog):
    """train.lr=1e4 (for 1e-4) turned the model uniform in one step, with finite numbers and no word."""
    with caplog.at_level("WARNING", logger="slime.config"):
        load_config(None, ["model.path=m", "data.path=d.jsonl", "train.lr=1e4", "algo.critic.lr=2",
                           "algo.advantage_estimator=gae"])
    assert "train.lr=10000: Adam moves every weight by about that much per step" in caplog.text
    assert "algo.critic.lr=2: Adam moves" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="slime.config"):  # no critic: said to be ignored, and nothing more
        load_config(None, ["model.path=m", "data.path=d.jsonl", "algo.critic.lr=2"])
    assert "algo.critic.lr=2.0 ignored" in caplog.text and "Adam moves" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="slime.config"):
        load_config(None, ["model.path=m", "data.path=d.jsonl", "train.lr=1e-3"])  # an SFT rate
    assert "Adam moves" not in caplog.text


def test_a_home_path_is_expanded(tmp_path, monkeypatch):
    """`log.run_dir=~/runs` reaches us with its "~" (a shell expands it only at a word's start), as YAML's always
    does: the outputs went to a folder named "~" in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: ~/models/m\neval:\n  path: ~/e.jsonl\n")
    c = load_config(cfg, ["data.path=~/d.jsonl", "log.run_dir=~/runs/a", "algo.critic.path=~/critic",
                          "rollout.sglang.python=~/venv/bin/python"])
    assert (c.model.path, c.data.path, c.eval.path, c.log.run_dir, c.algo.critic.path, c.rollout.sglang.python) == (
        f"{tmp_path}/models/m", f"{tmp_path}/d.jsonl", f"{tmp_path}/e.jsonl", f"{tmp_path}/runs/a",
        f"{tmp_path}/critic", f"{tmp_path}/venv/bin/python")


def test_settings_the_run_never_reads_are_warned_at_start(caplog):
    """A critic's settings without GAE, the rollout's sampling tricks under SFT and dynamic sampling's own knobs
    without it were dropped in silence; each is now named with why, and a run that sets none warns of nothing."""
    import logging

    from slime.config import (AlgoConfig, CriticConfig, DataConfig, EvalConfig, ModelConfig, OverlongPenaltyConfig,
                              RewardConfig, RolloutConfig, TISConfig)

    def build(**kw):
        return Config(model=ModelConfig(path="m"), data=DataConfig(path="d.jsonl"), **kw)

    with caplog.at_level(logging.WARNING, logger="slime.config"):
        cfg = build(algo=AlgoConfig(critic=CriticConfig(lr=1e-4, warmup_steps=2)),
                    rollout=RolloutConfig(over_sample_factor=2.0))
    lines = cfg.ignored_settings()
    assert lines == ["algo.critic.lr=0.0001, algo.critic.warmup_steps=2 ignored: only algo.advantage_estimator=gae "
                     "trains a critic (and not under algo.policy_loss=sft)",
                     "rollout.over_sample_factor=2.0 ignored: they set how rollout.dynamic_sampling=true draws again"]
    assert [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()] == lines
    sft = build(algo=AlgoConfig(policy_loss="sft", tis=TISConfig(level="token"), critic=CriticConfig(lr=1e-4)),
                rollout=RolloutConfig(dynamic_sampling=True, n_samples_per_prompt=8,
                                      overlong_penalty=OverlongPenaltyConfig(max_len=8, buffer_len=4)))
    assert any(line.startswith("algo.tis.level='token', rollout.n_samples_per_prompt=8, rollout.dynamic_sampling=True, "
                               "rollout.overlong_penalty.max_len=8 ignored: algo.policy_loss=sft")
               for line in sft.ignored_settings())
    reward = RolloutConfig(reward=RewardConfig(fn="model:rm"), generate_fn="m:f")  # SFT without evaluation
    assert build(algo=AlgoConfig(policy_loss="sft"), rollout=reward).ignored_settings() == [
        "rollout.reward.fn='model:rm', rollout.generate_fn='m:f' ignored: algo.policy_loss=sft generates and scores "
        "only to evaluate, and eval.path is not set"]
    assert build(algo=AlgoConfig(policy_loss="sft"), rollout=reward, eval=EvalConfig(path="e.jsonl")
                 ).ignored_settings() == []
    assert build(algo=AlgoConfig(advantage_estimator="gae", critic=CriticConfig(lr=1e-4))).ignored_settings() == []
    assert build(rollout=RolloutConfig(dynamic_sampling=True, over_sample_factor=2.0)).ignored_settings() == []
    assert build().ignored_settings() == []


def test_a_user_functions_timeout_past_the_collectives_is_warned_on_several_ranks():
    """A generate_fn timeout of 3600 s (the old default) under a 10 min collective timeout: on 2 ranks a hung tool
    stopped the run by the other rank's collective timeout, which names no function, and its own message never
    came. Warned at start on several ranks; the defaults and the shipped examples warn of nothing."""
    from slime.config import (AlgoConfig, DataConfig, EvalConfig, ModelConfig, RewardConfig, RolloutConfig,
                              SGLangConfig, TrainConfig)

    def build(**kw):
        return Config(model=ModelConfig(path="m"), data=DataConfig(path="d.jsonl"), **kw)

    hung = build(rollout=RolloutConfig(generate_fn="m:f", generate_fn_timeout=3600.0))
    assert hung.user_timeout_warning(1) is None
    assert hung.user_timeout_warning(2) == (
        "rollout.generate_fn_timeout=3600s not below train.dist_timeout_minutes=10 (600 s): on 2 ranks, one that "
        "waits that long in the function (a tool that never answers, a slow multi-turn rollout) or on its SGLang "
        "server stops the run by the others' collective timeout, whose message names no function; set "
        "train.dist_timeout_minutes above the longest rollout a rank may take beyond another's, or lower "
        "rollout.generate_fn_timeout")
    assert "rollout.generate_fn_timeout=infs" in build(rollout=RolloutConfig(generate_fn="m:f", generate_fn_timeout=0)
                                                       ).user_timeout_warning(4)
    assert build(rollout=RolloutConfig(generate_fn="m:f", generate_fn_timeout=3600.0),
                 train=TrainConfig(dist_timeout_minutes=61)).user_timeout_warning(2) is None
    assert build(rollout=RolloutConfig(generate_fn_timeout=3600.0)).user_timeout_warning(2) is None  # no generate_fn
    sft = AlgoConfig(policy_loss="sft")  # its generate_fn runs in evaluation only
    slow = RolloutConfig(generate_fn="m:f", generate_fn_timeout=3600.0)
    assert build(rollout=slow, algo=sft).user_timeout_warning(2) is None
    assert build(rollout=RolloutConfig(generate_fn="m:f", generate_fn_timeout=3600.0), algo=sft,
                 eval=EvalConfig(path="e.jsonl")).user_timeout_warning(2).startswith("rollout.generate_fn_timeout")
    assert build(rollout=RolloutConfig(reward=RewardConfig(timeout=900.0))).user_timeout_warning(2).startswith(
        "rollout.reward.timeout=900s not below")
    assert build(rollout=RolloutConfig(generate_fn="m:f")).user_timeout_warning(8) is None
    # A reward server's batch may time out on every attempt, with backoffs between: 10 x 60 s + 259 s here
    server = RolloutConfig(reward=RewardConfig(fn={"http://rm:8000/score": 1.0, "math": 0.1}, max_retries=9))
    assert build(rollout=server).user_timeout_warning(2).startswith(
        "rollout.reward.timeout=60s (x10 attempts at a reward server, rollout.reward.max_retries=9, +258.75 s of "
        "backoff) not below train.dist_timeout_minutes=10 (600 s)")
    assert build(rollout=RolloutConfig(reward=RewardConfig(fn="http://rm:8000/score"))).user_timeout_warning(2) is None
    two = {"http://rm:8000/score": 1.0, "http://rm2:8000/score": 1.0}  # called one after the other: 2 x 318.75 s
    assert "2 servers, one after the other" in build(rollout=RolloutConfig(reward=RewardConfig(
        fn=two, max_retries=4))).user_timeout_warning(2)
    assert build(rollout=RolloutConfig(reward=RewardConfig(fn=two, max_retries=2))).user_timeout_warning(2) is None
    assert build(rollout=server, algo=AlgoConfig(policy_loss="sft")).user_timeout_warning(2) is None  # no scoring
    assert build(rollout=RolloutConfig(reward=RewardConfig(max_retries=9))).user_timeout_warning(2) is None  # no server
    # A rank whose SGLang server hangs names it after request_timeout and a failed /health (10 s): before the
    # others' collective timeout only if that is shorter (the old default of 600 s was not)
    sglang = build(rollout=RolloutConfig(engine="sglang", sglang=SGLangConfig(request_timeout=600.0)))
    assert sglang.user_timeout_warning(1) is None
    assert sglang.user_timeout_warning(2).startswith("rollout.sglang.request_timeout=600s (+10 s on /health) not "
                                                     "below train.dist_timeout_minutes=10 (600 s)")
    assert build(rollout=RolloutConfig(engine="sglang", sglang=SGLangConfig(request_timeout=595.0))
                 ).user_timeout_warning(2) is not None
    assert build(rollout=RolloutConfig(engine="sglang")).user_timeout_warning(8) is None  # the default
    assert build(rollout=RolloutConfig(engine="sglang", sglang=SGLangConfig(request_timeout=600.0)),
                 train=TrainConfig(dist_timeout_minutes=11)).user_timeout_warning(2) is None
    for example in sorted((REPO / "examples").glob("*.yaml")):
        assert load_config(str(example), ["model.path=m"]).user_timeout_warning(8) is None, example.name


def test_one_step_off_without_a_correction_of_the_lag_is_warned():
    """Batches sampled one update before pi_old's weights: with algo.tis off and pi_old not the engine's
    logprobs, nothing corrects for the lag. The shipped examples and synchronous runs warn of nothing."""
    from slime.config import AlgoConfig, DataConfig, ModelConfig, RolloutConfig, TISConfig

    def build(**kw):
        return Config(model=ModelConfig(path="m"), data=DataConfig(path="d.jsonl"), **kw)

    lagged = RolloutConfig(one_step_off=True)
    assert build(rollout=lagged).off_policy_warning().startswith("rollout.one_step_off=true with algo.tis.level=off")
    assert build(rollout=lagged, algo=AlgoConfig(tis=TISConfig(level="token"))).off_policy_warning() is None
    assert build(rollout=lagged, algo=AlgoConfig(old_logprobs="rollout")).off_policy_warning() is None
    assert build().off_policy_warning() is None
    for example in sorted((REPO / "examples").glob("*.yaml")):
        assert load_config(str(example), ["model.path=m"]).off_policy_warning() is None, example.name


def test_a_critic_of_its_own_is_checked_before_any_model_loads(tiny_model, tmp_path, caplog):
    """algo.critic.path: a missing folder was reported as model.path after the actor and reference had loaded; a
    critic whose packed samples compute unlike each alone (dynamic rope past its context) trained on wrong values
    where the same model as the actor is refused; one of another vocabulary failed after the first rollout,
    blaming the rollout; one of another tokenizer of the same size read every token as another."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from slime.models.loading import check_critic

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def critic(name: str, **changes) -> Path:
        path = tmp_path / name
        shutil.copytree(tiny_model, path)
        conf = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**conf, **changes}))
        return path

    def cfg(path, *extra):
        return load_config(None, [f"model.path={tiny_model}", "data.path=d.jsonl", "algo.advantage_estimator=gae",
                                  f"algo.critic.path={path}", *extra])

    check_critic(cfg(critic("same")), tokenizer)  # the actor's model as its own critic: fine
    check_critic(cfg(tmp_path / "missing", "algo.advantage_estimator=grpo"), tokenizer)  # no critic: not read
    dynamic = critic("dynamic", max_position_embeddings=10,
                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    small = critic("small-vocab", vocab_size=100)
    padded = critic("one-more-token")  # the actor's tokenizer and a token of its own: every actor id the same
    padded_tok = AutoTokenizer.from_pretrained(padded)
    padded_tok.add_special_tokens({"pad_token": "<critic-pad>"})
    padded_tok.save_pretrained(padded)
    check_critic(cfg(padded), tokenizer)
    # The critic's tokenizer without a token the actor can write: warned. (Its vocabulary given by a stand-in: a
    # tokenizer.json edited to lack a token renumbers the added tokens after it, differently across installs.)
    import types

    import slime.models.loading as loading

    lacking = {t: i for t, i in tokenizer.get_vocab().items() if t != "~"}
    stand_in = types.SimpleNamespace(from_pretrained=lambda *a, **k: types.SimpleNamespace(get_vocab=lambda: lacking))
    with caplog.at_level(logging.WARNING, logger="slime.models.loading"), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "AutoTokenizer", stand_in)
        check_critic(cfg(critic("lacking")), tokenizer)
    assert "its tokenizer lacks 1 of the actor's tokens (e.g. '~', id" in caplog.text
    other = critic("other-tokenizer")  # two tokens swapped
    vocab = json.loads((other / "tokenizer.json").read_text())
    model_vocab = vocab["model"]["vocab"]
    a, b = "a", "b"
    model_vocab[a], model_vocab[b] = model_vocab[b], model_vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    for path, words in ((tmp_path / "missing", r"algo.critic.path=.*missing is not a directory"),
                        (dynamic, r"algo.critic.path=.*dynamic uses dynamic rope, .* set train.packing=false"),
                        (small, r"algo.critic.path=.*small-vocab has a vocabulary of 100 tokens .* fewer than the "
                                r"actor's 261"),
                        (other, r"algo.critic.path=.*other-tokenizer holds a tokenizer other than model.path's \(2 "
                                r"ids name other tokens")):
        with pytest.raises((ValueError, FileNotFoundError), match=words):
            check_critic(cfg(path), tokenizer)
    check_critic(cfg(dynamic, "train.packing=false", "train.micro_batch_size=1"), tokenizer)  # each sample alone


@pytest.mark.parametrize("old, new, step, refused", [(1, 3, 2, True), (1, 2, 2, True), (1, 2, 5, True),
                                                     (3, 1, 5, False), (3, 5, 2, False), (None, 3, 2, False)])
def test_a_resume_with_a_longer_critic_warmup_after_the_actor_started_is_refused(old, new, step, refused, caplog):
    """The actor that had trained since step old + 1 was frozen again (and its schedule, shortened to fewer
    updates than it had made, ran on at min_lr), with no word in the log."""
    from slime.trainer.loop import check_critic_warmup

    changed = {"algo.critic.warmup_steps": (old, new)}
    if refused:
        with pytest.raises(ValueError, match=rf"algo.critic.warmup_steps={new} at the resume of step {step}: .* "
                                             rf"Keep algo.critic.warmup_steps={old}"):
            check_critic_warmup(changed, step)
        return
    with caplog.at_level(logging.WARNING, logger="slime.trainer.loop"):
        check_critic_warmup(changed, step)
    assert ("resumed with algo.critic.warmup_steps" in caplog.text) == (old is not None)


def test_a_warmup_as_long_as_the_run_is_warned():
    """train.warmup_steps=100 on a 3-step run kept the lr at 3% of train.lr or less, without a word."""
    base = ["model.path=m", "data.path=d.jsonl", "train.lr=3e-4"]
    warning = load_config(None, base + ["train.num_steps=3", "train.warmup_steps=100"]).warmup_warning()
    assert warning.startswith("train.warmup_steps=100 is not shorter than the 3 optimizer updates of the run") and \
        "never reaches train.lr=0.0003 (at most 3% of it)" in warning
    assert load_config(None, base + ["train.num_steps=3", "train.warmup_steps=2"]).warmup_warning() is None
    assert load_config(None, base + ["train.num_steps=3", "train.warmup_steps=5",
                                     "train.num_mini_batches=2"]).warmup_warning() is None  # 6 updates
    critic = load_config(None, base + ["train.num_steps=6", "train.warmup_steps=4", "algo.advantage_estimator=gae",
                                       "algo.critic.warmup_steps=2"]).warmup_warning()
    assert "4 optimizer updates of the run (train.num_steps x train.num_mini_batches, less algo.critic." in critic


def test_a_config_not_in_utf8_a_directory_an_url_without_scheme_and_a_negative_length_are_named(tmp_path):
    """A latin-1 config said only "'utf-8' codec can't decode byte 0xe9 in position 5"; a directory "does not
    exist"; urls=[localhost:3000] was polled for startup_timeout (900 s); max_response_len=-1 was reported as an
    overlong penalty's problem."""
    path = tmp_path / "run.yaml"
    path.write_bytes((("# " + "x" * 100 + "\n") * 100).encode() + "model:\n  path: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"run.yaml:102: byte 0xe9 is not UTF-8 \(file offset 10318\); save the "
                                         r"file as UTF-8"):
        load_config(path)
    with pytest.raises(IsADirectoryError, match=r"is a directory; give the YAML file in it"):
        load_config(tmp_path)
    base = ["model.path=m", "data.path=d.jsonl"]
    with pytest.raises(ValueError, match=r"rollout.sglang.urls\[1\]='localhost:3000' is not an http\(s\) address; "
                                         r"give the scheme: http://localhost:3000"):
        load_config(None, base + ["rollout.sglang.urls=[http://10.0.0.2:30000, localhost:3000]"])
    assert load_config(None, base + ["rollout.sglang.urls=[https://h:1]"]).rollout.sglang.urls == ["https://h:1"]
    with pytest.raises(ValueError, match=r"rollout.max_response_len=-1, .* must be >= 1"):
        load_config(None, base + ["rollout.max_response_len=-1"])


def test_an_accuracy_threshold_no_reward_reaches_is_warned_and_an_infinite_one_refused():
    base = ["model.path=m", "data.path=d.jsonl", "eval.path=e.jsonl"]
    warning = load_config(None, base + ["eval.accuracy_threshold=2",
                                        "rollout.reward.fn=exact_match"]).accuracy_warning()
    assert warning.startswith("eval.accuracy_threshold=2 is above the most rollout.reward.fn='exact_match' gives (1)")
    weighted = ["rollout.reward.fn={math: 1.0, format: 0.5}"]
    assert load_config(None, base + weighted + ["eval.accuracy_threshold=1.5"]).accuracy_warning() is None
    assert "gives (1.5)" in load_config(None, base + weighted + ["eval.accuracy_threshold=1.6"]).accuracy_warning()
    user = ["rollout.reward.fn=my.module:score", "eval.accuracy_threshold=5"]  # its range is unknown
    assert load_config(None, base + user).accuracy_warning() is None
    with pytest.raises(ValueError, match=r"eval.accuracy_threshold=inf must be a finite reward"):
        load_config(None, base + ["eval.accuracy_threshold=.inf"])
