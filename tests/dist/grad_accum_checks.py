"""Run on 1 rank by tests/test_zero3.py: in bf16 (model.dtype=auto on a GPU), a mini-batch's gradient summed over
its micro-batches by the shipped DeepSpeed configs, against the exact sum (each micro-batch's gradient alone,
summed in fp64). DeepSpeed accumulates in the model's dtype unless data_types.grad_accum_dtype says otherwise: in
bf16 the gradient was off by ~5e-3 (relative) over 20 micro-batches, and depended on how samples were cut.

    python tests/spawn_ranks.py 1 tests/dist/grad_accum_checks.py MODEL_DIR OUT_JSON
"""
import functools
import json
import sys

import torch
from deepspeed.utils import safe_get_full_grad

from slime.config import load_config
from slime.data.sample import Sample, as_token_tensor
from slime.distributed.parallel_dims import ParallelDims, leave
from slime.trainer.layout import MiniBatch, distribute
from slime.trainer.losses import actor_loss
from slime.trainer.policy_engine import PolicyEngine


def batch(n: int = 48) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p, r = int(torch.randint(8, 24, (1,), generator=g)), int(torch.randint(8, 40, (1,), generator=g))
        out.append(Sample(prompt_ids=torch.randint(10, 250, (p,), generator=g).tolist(),
                          response_ids=torch.randint(10, 250, (r,), generator=g).tolist(),
                          advantages=as_token_tensor(torch.randn(r, generator=g)), group_id=i // 4))
    return out


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    dims, result, exact = ParallelDims.build(), {}, None
    for ds in ("ds_configs/zero3.json", "ds_configs/zero2.json"):
        cfg = load_config(None, [f"model.path={model}", "data.path=unused.jsonl", "model.dtype=bfloat16",
                                 f"train.ds_config={ds}", "train.max_tokens_per_gpu=128", "train.share_prompts=false"])
        actor = PolicyEngine.actor(cfg, dims)
        rb = distribute(batch(), dims, actor.train_layout)
        for s, lp in zip(rb.samples, actor.score(rb)):
            s.old_logprobs = lp
        mini, loss_fn = rb.mini_batches[0], functools.partial(actor_loss, cfg.algo)
        params = list(actor.engine.module.hf.named_parameters())
        if exact is None:  # under ZeRO-3, whose zero_grad starts a mini-batch over (ZeRO-2's does not, unstepped)
            exact = {name: 0.0 for name, _ in params}
            for mb in mini.micro:  # each micro-batch alone: a mini-batch of one, with the whole one's normalisers
                one = MiniBatch(micro=[mb], num_loss_tokens=mini.num_loss_tokens, num_seqs=mini.num_seqs,
                                num_processed=mini.num_processed, stats=mini.stats)
                actor.forward_backward(rb, one, loss_fn)
                exact = {name: exact[name] + safe_get_full_grad(p).double() for name, p in params}
                actor.engine.optimizer.zero_grad()
        actor.forward_backward(rb, mini, loss_fn)
        diff = sum(float((safe_get_full_grad(p).double() - exact[name]).norm()) ** 2 for name, p in params)
        norm = sum(float(exact[name].norm()) ** 2 for name, _ in params)
        result[ds] = {"micro_batches": len(mini.micro), "relative_error": (diff / norm) ** 0.5}
    with open(out, "w") as f:
        json.dump(result, f)
    leave()


if __name__ == "__main__":
    main()
