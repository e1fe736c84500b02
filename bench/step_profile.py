"""Where a GRPO step's time goes, op by op, against its FLOP floor.

    python bench/step_profile.py [--size medium] [--step 3] [--top 0] [override ...]

bench/vs_trl.py's job for us (one process, 1 thread, fp32, a random Qwen3 model, 16 prompts x 4 samples x 64
new tokens, ZeRO-3 unless an override says otherwise, e.g. train.ds_config=ds_configs/zero2.json), run in this
process with torch.profiler around the rollout (HFEngine.generate) and the update (PolicyEngine.train_step) of
step --step. Each phase's profiled self time is grouped by op:

- matmuls: the linears and the logprob head (oneDNN's or torch's kernels);
- attention: sdpa's kernels in the update; the decode step's batched matmuls, mask and softmax in the rollout;
- fused chains: the compiled graphs of slime/models/fused.py (norms, rotary, SwiGLU) and their wrappers, and
  in the rollout the compiled decode step's own loops (rollout.hf_compile: its norms, rotary, attention and
  SwiGLU; its matmuls count as matmuls);
- copies and optimizer: copy_, cat, fill_, index ops, Adam;
- other ops, and the time the profiler sees outside any op (Python, hooks, the profiler's own cost).

Printed per phase with its floor from the 1-thread matmul peak measured here (as bench/vs_trl.py: generation
2 N T, update 6 N T, N the parameters without embeddings, T the positions needed: each prompt once, each
response but its last token) and two efficiencies: floor / the phase's time
without the profiler, and floor / its matmuls alone, i.e. the most it could reach if everything but the matmuls
took no time. The last lines say how much time a step may spend outside its matmuls for floor / step time to
reach bench/vs_trl.py's target, against what it spends now. --top N also lists each phase's N ops of most self
time outside the matmuls, with their calls and group.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import vs_trl  # noqa: E402

GROUPS = {  # group -> does this op name belong to it (checked in this order)
    "matmuls": lambda n: n in ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"),
    "attention": lambda n: "scaled_dot_product" in n or n in ("aten::bmm", "aten::_softmax", "aten::masked_fill_"),
    "fused chains": lambda n: "Compiled" in n or "Torch-Compiled Region" in n or "Dynamo" in n,
    "copies and optimizer": lambda n: n in ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_",
                                            "aten::index_select", "aten::index_copy_", "aten::scatter_add_",
                                            "aten::_fused_adamw_", "aten::clone") or n.startswith("aten::_foreach"),
}


def group_of(name: str) -> str:
    return next((g for g, belongs in GROUPS.items() if belongs(name)), "other ops")


def grouped(prof, wall: float) -> tuple[dict[str, float], list[tuple[str, int, float]]]:
    """Seconds of self time per group ("outside ops": the profiled wall time no op accounts for), and every op
    outside the matmuls as (name, calls, seconds), most time first."""
    out, ops = dict.fromkeys([*GROUPS, "other ops"], 0.0), []
    for e in prof.key_averages():
        out[group_of(e.key)] += e.self_cpu_time_total / 1e6
        if group_of(e.key) != "matmuls":
            ops.append((e.key, e.count, e.self_cpu_time_total / 1e6))
    out["outside ops"] = max(0.0, wall - sum(out.values()))
    return out, sorted(ops, key=lambda op: -op[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium", choices=sorted(vs_trl.SIZES))
    ap.add_argument("--step", type=int, default=3, help="the step whose rollout and update are profiled (>= 2)")
    ap.add_argument("--top", type=int, default=0, help="list each phase's N slowest ops outside the matmuls")
    ap.add_argument("overrides", nargs="*", help="config overrides added to bench/vs_trl.py's")
    args = ap.parse_args()
    if args.step < 2:
        ap.error("--step must be >= 2: step 1 pays for compiles and first-touch page faults")

    import torch

    torch.set_num_threads(1)
    from torch.profiler import profile

    from data_tools.make_tiny_model import make_tiny_model
    from slime.rollout import hf_engine
    from slime.trainer import policy_engine

    peak = max(max(p) for p in vs_trl.matmul_peaks().values())
    work = Path(tempfile.mkdtemp(prefix="step-profile-"))
    data = vs_trl.write_prompts(work)
    model = make_tiny_model(work / args.size, arch="qwen3", seed=0, heads=4, kv_heads=2, **vs_trl.SIZES[args.size])
    n = vs_trl.non_embedding_params(model)

    calls = {"rollout": 0, "update": 0}
    walls: dict[str, list[float]] = {"rollout": [], "update": []}  # unprofiled calls, from step 2 on
    seen: dict[str, tuple[float, dict[str, float]]] = {}
    tokens = {}

    def profiled(owner, name: str, phase: str):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(self, *a, **k):
            calls[phase] += 1
            if calls[phase] != args.step:
                start = time.perf_counter()
                out = original(self, *a, **k)
                if calls[phase] > 1:
                    walls[phase].append(time.perf_counter() - start)
            else:
                with profile() as prof:
                    start = time.perf_counter()
                    out = original(self, *a, **k)
                    wall = time.perf_counter() - start
                seen[phase] = (wall, grouped(prof, wall))
                if phase == "rollout":
                    prompts, params = a[0], a[1]
                    # the positions needed (as bench/vs_trl.py's floor): each prompt once, each response but
                    # its last token, for the prefill and decode steps and for the update alike
                    tokens["gen"] = sum(len(g.response_ids) for group in out for g in group)
                    tokens["all"] = sum(map(len, prompts)) + sum(len(g.response_ids) - 1 for group in out
                                                                 for g in group)
            return out

        setattr(owner, name, wrapper)

    profiled(hf_engine.HFEngine, "generate", "rollout")
    profiled(policy_engine.PolicyEngine, "train_step", "update")
    import run

    run.main(["--config", str(vs_trl.OUR_CONFIG),
              *vs_trl.our_overrides(model, data, work / "run", args.step + 1, args.overrides)])

    missing = [phase for phase in ("rollout", "update") if phase not in seen]
    if missing:  # another engine (rollout.engine=sglang), or an override that ends the job before --step
        sys.exit(f"step_profile: no {' or '.join(missing)} of step {args.step} was profiled (calls seen: {calls}); "
                 "it profiles the hf engine's generate and the trainer's train_step, in this process")
    floors = {"rollout": 2 * n * tokens["all"] / (peak * 1e9), "update": 6 * n * tokens["all"] / (peak * 1e9)}
    print(f"\n{args.size}: {n / 1e6:.1f}M parameters without embeddings, 1-thread fp32 matmul peak {peak:.0f} "
          f"GFLOP/s; step {args.step}: {tokens['gen']} generated tokens; {tokens['all']} positions needed (each "
          "prompt once, each response but its last token)")
    plain, matmuls = {}, {}
    for phase in ("rollout", "update"):
        wall, (groups, ops) = seen[phase]
        plain[phase] = statistics.median(walls[phase]) if walls[phase] else wall
        matmuls[phase] = groups["matmuls"]
        print(f"  {phase}: {plain[phase]:.2f} s without the profiler ({wall:.2f} s with it), floor "
              f"{floors[phase]:.2f} s: efficiency {floors[phase] / plain[phase]:.2f}; its matmuls alone "
              f"{groups['matmuls']:.2f} s, efficiency {floors[phase] / groups['matmuls']:.2f} if nothing else took time")
        for g, t in groups.items():
            print(f"    {g:22s} {t:6.2f} s  {100 * t / wall:5.1f}%")
        for name, count, t in ops[:args.top]:
            print(f"      {name[:60]:60s} {count:6d} calls {t:6.3f} s  ({group_of(name)})")
    floor, step = sum(floors.values()), sum(plain.values())
    budget = floor / vs_trl.TARGET_EFFICIENCY - sum(matmuls.values())
    print(f"  rollout + update: {step:.2f} s, floor {floor:.2f} s, efficiency {floor / step:.2f} (target >= "
          f"{vs_trl.TARGET_EFFICIENCY}); the matmuls take {sum(matmuls.values()):.2f} s (profiled), so the target "
          f"leaves {budget:.2f} s for everything else, which takes {step - sum(matmuls.values()):.2f} s now")


if __name__ == "__main__":
    main()
