"""Run on 2 ranks by tests/test_sglang.py against one running SGLang server (`rollout.sglang.urls`).

    torchrun --standalone --nproc_per_node 2 tests/dist/sglang_checks.py MODEL_DIR OUT_DIR SERVER_URL [overrides]

Pushes the ZeRO-3 actor's weights three times: at start and after a training step as colocated
tensor buckets, then after another step over a gloo weight-update group (disaggregated path). After
each push both ranks generate greedily on the server; the reference is an hf engine loaded with the
same gathered weights. Records the server's weight version and the colocated engine's call order.
"""
import copy
import functools
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    from dist.actor_checks import fixed_batch, local_share
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.models.loading import load_tokenizer
    from slime.rollout.engine import SamplingParams, make_engine
    from slime.rollout.hf_engine import HFEngine
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine

PROMPTS = ["12+7=", "what is 3*4?", "hello", "9-5"]


def chat_ids(tokenizer, question: str) -> list[int]:
    """Prompt ids as the data path makes them: chat template as text, then tokenized."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def train_step(actor: PolicyEngine, cfg, dims) -> None:
    batch = distribute(local_share(fixed_batch(), dims), dims, actor.train_layout)
    for s, lp in zip(batch.samples, actor.score(batch)):
        s.old_logprobs = lp
    actor.train_step(batch, functools.partial(actor_loss, cfg.algo))


def main() -> None:
    model_dir, out, url = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=5e-2",
                             "train.max_tokens_per_gpu=64", "rollout.sync_bucket_mb=0.02", "rollout.engine=sglang",
                             f"rollout.sglang.urls=[{url}]", "rollout.sglang.ranks_per_engine=2",
                             "rollout.sglang.release_memory=true",  # the GPU's order, checked on CPU too
                             *sys.argv[4:]])
    dims = ParallelDims.build(sp=cfg.parallel.sp, ep=cfg.parallel.ep)
    tokenizer = load_tokenizer(cfg.model)
    actor = PolicyEngine.actor(cfg, dims)
    colocated = make_engine(cfg.rollout, cfg.model, tokenizer, dims)
    dis_cfg = copy.deepcopy(cfg.rollout)
    dis_cfg.sglang.mode = "disaggregated"
    disaggregated = make_engine(dis_cfg, cfg.model, tokenizer, dims)
    reference = HFEngine(cfg.model, tokenizer, device=dims.device)
    prompts = [chat_ids(tokenizer, p)
               for p in PROMPTS[dims.rank::dims.world_size]]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)

    def check(engine, version: int) -> dict:
        engine.update_weights(actor.gathered_weight_buckets(cfg.rollout.sync_bucket_mb), version=version)
        reference.update_weights(actor.gathered_weight_buckets(cfg.rollout.sync_bucket_mb), version=version)
        engine.wake()  # the loop's order: wake, generate, sleep
        ours = [g[0] for g in engine.generate(prompts, greedy)]
        engine.sleep()
        theirs = [g[0] for g in reference.generate(prompts, greedy)]
        served = engine.clients[0].get("/model_info")["weight_version"]
        return {"ours": [g.response_ids for g in ours], "theirs": [g.response_ids for g in theirs],
                "logprob_diff": max((abs(a - b) for x, y in zip(ours, theirs) if x.response_ids == y.response_ids
                                     for a, b in zip(x.logprobs, y.logprobs)), default=None),
                "served_version": served, "engine_version": engine.weight_version}

    result = {"initial": check(colocated, 1)}
    train_step(actor, cfg, dims)
    result["tensor"] = check(colocated, 2)
    train_step(actor, cfg, dims)
    colocated.wake()  # hand the server back fully resident before the other engine drives it
    result["distributed"] = check(disaggregated, 3)
    result["colocated_events"] = [list(e) for e in colocated.events]
    result["disaggregated_events"] = [list(e) for e in disaggregated.events]
    result["metrics"] = colocated.metrics()
    per_rank = dims.all_gather_objects(result, group=dims.world_group)
    disaggregated.shutdown()
    colocated.shutdown()
    if dims.is_main:
        (out / "result.json").write_text(json.dumps(per_rank))


if __name__ == "__main__":
    main()
    leave()
