"""Sequence parallelism: the longest sample that trains at a fixed per-GPU budget, and the activation
memory of one long sample per rank, sp=2 vs sp=1.

    python bench/sp_memory.py [--budget 2048] [--hidden 256] [--layers 4]

(launches itself twice under torchrun: 1 CPU rank with sp=1, 2 CPU ranks with sp=2.)

1. Longest sample: with `train.max_tokens_per_gpu` = budget, a micro-batch holds sp x budget tokens. For each
   sp the script trains one step on a sample of sp x budget + 1 tokens (its row is one token shorter, the last
   token being only a target: it fills the micro-batch exactly) and checks that one token more is refused at
   plan time with the message naming the settings.
2. Footprint: one forward + backward of a single sample of `budget` tokens; per rank, the bytes of every
   tensor autograd saves for backward (saved_tensors_hooks; parameters excluded, each storage once) and
   the bytes of the attention inputs q, k, v this rank holds before the all-to-all. On a GPU,
   tests/gpu/sp_flash.py reports torch.cuda.max_memory_allocated instead.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_sample(length: int, seed: int):
    import torch

    from slime.data.sample import Sample, as_token_tensor

    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    return Sample(prompt_ids=torch.randint(5, 250, (prompt,), generator=g).tolist(),
                  response_ids=torch.randint(5, 250, (length - prompt,), generator=g).tolist(),
                  advantages=as_token_tensor(torch.randn(length - prompt, generator=g)))


def run_rank(args) -> None:
    import torch

    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={args.model}", "data.path=unused.jsonl", f"parallel.sp={args.sp}",
                             f"train.max_tokens_per_gpu={args.budget}", "train.logits_chunk_size=512"])
    dims = ParallelDims.build(sp=args.sp)
    actor = PolicyEngine.actor(cfg, dims)
    loss_fn = functools.partial(actor_loss, cfg.algo)

    def step(length: int) -> dict:
        batch = distribute([one_sample(length, 0)], dims, actor.train_layout)
        for s, lp in zip(batch.samples, actor.score(batch)):
            s.old_logprobs = lp
        saved, seen = [0], set()
        params = {p.data_ptr() for p in actor.engine.module.parameters()}
        qkv = []

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen and ptr not in params and not isinstance(t, torch.nn.Parameter):
                seen.add(ptr)
                saved[0] += t.untyped_storage().nbytes()
            return t

        hooks = [m.register_forward_hook(lambda m, i, o: qkv.append(o.numel() * o.element_size()))
                 for name, m in actor.engine.module.named_modules() if name.endswith(("q_proj", "k_proj", "v_proj"))]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            actor.forward_backward(batch, batch.mini_batches[0], loss_fn)
        for h in hooks:
            h.remove()
        actor.optimizer_step()
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        return {"saved_bytes": saved[0], "qkv_bytes": sum(qkv), "cuda_peak_bytes": peak}

    longest = args.sp * args.budget + 1  # a sample's row is one token shorter (its last token is only a target)
    trained = step(longest)
    try:
        distribute([one_sample(longest + 1, 1)], dims, actor.train_layout)
        refused = None
    except ValueError as e:
        refused = str(e)
    footprint = step(args.budget)
    results = dims.all_gather_objects({"rank": dims.rank, "footprint": footprint, "trained_longest": trained,
                                       "refused": refused}, group=dims.world_group)
    if dims.is_main:
        Path(args.out).write_text(json.dumps({"sp": args.sp, "longest": longest, "ranks": results}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=2048, help="train.max_tokens_per_gpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sp", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return
    from data_tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="sp-bench-"))
    model = make_tiny_model(work / "m", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                            max_pos=4 * args.budget + 8)
    out = {}
    for sp in (1, 2):
        path = work / f"sp{sp}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={sp}", __file__,
               f"--budget={args.budget}", f"--sp={sp}", f"--model={model}", f"--out={path}"]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"sp={sp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        out[sp] = json.loads(path.read_text())
    print(f"model hidden={args.hidden} layers={args.layers}; train.max_tokens_per_gpu={args.budget}")
    for sp, r in out.items():
        refused = all(x["refused"] for x in r["ranks"])
        print(f"sp={sp}: longest sample that trains: {r['longest']} tokens (one more is refused at plan time: "
              f"{refused})")
    base = out[1]["ranks"][0]["footprint"]
    print(f"one sample of {args.budget} tokens, per rank:     saved for backward      q/k/v inputs")
    for sp, r in out.items():
        for x in r["ranks"]:
            f = x["footprint"]
            print(f"  sp={sp} rank {x['rank']}:  {f['saved_bytes'] / 2**20:10.1f} MiB ({f['saved_bytes'] / base['saved_bytes']:.3f}x)"
                  f"  {f['qkv_bytes'] / 2**20:8.2f} MiB ({f['qkv_bytes'] / base['qkv_bytes']:.3f}x)")
    print(out[2]["ranks"][0]["refused"])
    if not all(x["refused"] for r in out.values() for x in r["ranks"]):
        sys.exit("a sample one token longer than the longest was not refused: the bench's boundary is wrong")


if __name__ == "__main__":
    main()
