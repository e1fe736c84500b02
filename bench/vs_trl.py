"""GRPO step time side by side with TRL's GRPOTrainer, at equal settings, with the machine's FLOP floor.

    pip install -e ".[bench]"          # trl
    python bench/vs_trl.py [--sizes small,medium] [--steps 5] [--reps 2] [--whole-machine] [--recompute] [--compile] [--kernels]
                             [--unfused]

Per model size (random Qwen3 models built by data_tools, ~4M and ~25M parameters, the tiny char tokenizer),
one process each, 1 thread, fp32: 16 prompts x 4 samples x exactly 64 new tokens at temperature 1 (EOS
ignored on both sides: ours rollout.ignore_eos, TRL min_new_tokens), one optimizer step per batch, no KL
(TRL: beta=0, num_iterations=1), no gradient checkpointing on either side (TRL's GRPOConfig turns it on by
default; figures in the README measured before 2026-12-06 had TRL recomputing its activations). Ours runs on
ZeRO-3 (the default) and on ZeRO-2 (ds_configs/zero2.json,
which keeps the whole model on every rank, as TRL does); --recompute adds ours with the separate
old-logprob forward (algo.old_logprobs=recompute); --compile adds both with torch.compile (ours
train.compile=true on ZeRO-2, TRL torch_compile=True; each pays its compile in step 1, outside the median);
--kernels adds ours on the linear kernel that model.cpu_linear=auto does not pick (auto: oneDNN on AMD,
torch's F.linear, i.e. MKL, elsewhere) and TRL with its linears on oneDNN and our malloc settings
(train.cpu_malloc=retain), to show what the kernel gives and what the rest of the design does; --unfused
adds ours with HF's eager norm, rotary and SwiGLU chains (train.fuse_elementwise=false).
Runs alternate (TRL, ours, ..., then the other way round) so machine load hits all alike; each reports the
median step time of steps 2..N. --whole-machine adds TRL with 2 threads against ours in one process of 2 threads
and ours on 2 ranks of 1 thread. Printed: the step times, the ratio ours/TRL against the issue's target, our
breakdown (rollout / scoring+update / sync), and the FLOP floor of a step from the 1-thread fp32 matmul peak
measured in the same run (the faster of torch's F.linear and oneDNN): generation 2 N T, old-logprob forward
2 N T, forward+backward 6 N T (N parameters without embeddings), with each run's efficiency = floor / step time
(target >= 0.8 on the ~25M model). T counts the positions a step needs: each prompt once (its samples share it)
and each response without its last token (a target only, which feeds nothing): 16 x 6 + 64 x 63 = 4128 here.
(Until 2026-12-07 T counted every sample's own prompt and every token, 64 x 70 = 4480, work TRL runs but the step
does not need: efficiencies printed before then read 6.2% high.) On a shared machine the peak moves with load
from minute to minute (seen here: 117-155 GFLOP/s on one VM within an hour), so the peak is also measured
between runs, and each run's efficiency is printed twice: against the best peak of the whole invocation (never
flattering), and against the better of the peaks measured just before and just after it (the machine as the run
found it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {"small": dict(hidden=256, layers=6), "medium": dict(hidden=512, layers=10)}
PROMPTS, SAMPLES, NEW_TOKENS, LR = 16, 4, 64, 1e-5
ZERO2 = "train.ds_config=ds_configs/zero2.json"  # the full model and its gradients on every rank
UNFUSED = "train.fuse_elementwise=false"  # HF's eager elementwise chains
TARGET_RATIO, TARGET_EFFICIENCY = 0.75, 0.8  # issue 15's targets: ours/TRL step time, and floor/step time (~25M)


def digit_reward(sample) -> float:
    """Ours: share of digits in the response (the same as `trl_reward`)."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def trl_reward(completions, **_) -> list[float]:
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]


def matmul_gflops(kernel: str, n: int = 512, seconds: float = 2.0) -> float:
    """1-thread fp32 (n x n) @ (n x n).T on torch's default kernel (MKL) or on oneDNN."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    if kernel == "torch":
        mm = lambda: torch.nn.functional.linear(a, b)  # noqa: E731
    else:
        mm = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # noqa: E731
    mm()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        mm()
        count += 1
    return 2 * n ** 3 * count / (time.perf_counter() - start) / 1e9


def write_prompts(work: Path, count: int = 256) -> Path:
    """The first `count` prompts of the shipped arithmetic data, as a prompts jsonl in `work`."""
    rows = [json.loads(line) for line in (REPO / "assets/tiny-arith-data/train.jsonl").read_text().splitlines()]
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n" for r in rows[:count]))
    return data


def prompt_tokens(model: Path, data: Path) -> float:
    """Mean prompt length in tokens ("37+48=" and the like, in the model's char tokenizer), as both sides read them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    return statistics.mean(len(tok(r["prompt"], add_special_tokens=False).input_ids) for r in rows)


def peak_now() -> float:
    """The faster kernel's GFLOP/s now: one short measurement each, between runs (bench/vs_trl.py's docstring)."""
    return max(matmul_gflops(k, seconds=0.5) for k in ("torch", "onednn"))


def matmul_peaks() -> dict[str, list[float]]:
    """Three 1-second measurements of each kernel's 1-thread fp32 matmul GFLOP/s. A floor is taken from the best
    of them all: a peak measured low (or from the slower kernel) would flatter every efficiency."""
    return {k: [matmul_gflops(k, seconds=1.0) for _ in range(3)] for k in ("torch", "onednn")}


def non_embedding_params(model_dir: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)


def trl_settings(out: Path, steps: int, compile_model: bool = False) -> dict:
    """TRL's GRPOConfig arguments (tests/test_bench.py holds them against our_overrides)."""
    return dict(output_dir=str(out / "trl"), per_device_train_batch_size=PROMPTS * SAMPLES,
                num_generations=SAMPLES, max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.0,
                num_iterations=1, learning_rate=LR, max_steps=steps, logging_steps=1, report_to=[],
                use_cpu=True, bf16=False, save_strategy="no", gradient_accumulation_steps=1, seed=0,
                dataloader_num_workers=0, disable_tqdm=True, torch_compile=compile_model,
                gradient_checkpointing=False,  # TRL's default is on: a recompute ours does not do
                generation_kwargs={"min_new_tokens": NEW_TOKENS})  # fixed lengths, as ours with ignore_eos


def worker_trl(model: Path, data: Path, out: Path, steps: int, threads: int, compile_model: bool,
               onednn: bool) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    times, marks = [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - marks["t"])

    lengths = []

    class Lengths(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    cfg = GRPOConfig(**trl_settings(out, steps, compile_model))
    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if onednn:  # TRL on our CPU settings: its linears (generation runs the same modules) and malloc
        from slime.models.onednn import use_onednn_linears
        from slime.utils.cpu_malloc import retain_freed_memory

        use_onednn_linears(policy)
        print("TRL with retained malloc:", retain_freed_memory())
    trainer = GRPOTrainer(model=policy,
                          reward_funcs=trl_reward, args=cfg, train_dataset=load_dataset("json", data_files=str(data),
                                                                                        split="train"),
                          processing_class=tok, callbacks=[Clock(), Lengths()])
    trainer.train()
    out.joinpath("trl.json").write_text(json.dumps({"times": times, "response_len": lengths}))


OUR_CONFIG = REPO / "examples/cpu_tiny_grpo.yaml"


def our_overrides(model: Path, data: Path, run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    """The bench's settings over OUR_CONFIG (tests/test_bench.py loads them: a config check must not break it)."""
    return [f"model.path={model}", f"data.path={data}", f"log.run_dir={run_dir}", "data.apply_chat_template=false",
            "data.shuffle=false", f"rollout.batch_size={PROMPTS}", f"rollout.n_samples_per_prompt={SAMPLES}",
            f"rollout.max_response_len={NEW_TOKENS}", "rollout.ignore_eos=true", "rollout.temperature=1.0",
            "rollout.reward.fn=bench.vs_trl:digit_reward", f"train.num_steps={steps}", f"train.lr={LR}",
            "train.min_lr=0", "train.warmup_steps=0", "train.max_tokens_per_gpu=16384", "eval.path=null",
            "checkpoint.export_hf=false", "checkpoint.save_final=false", "checkpoint.interval=0", *extra]


def run_ours(model: Path, data: Path, out: Path, steps: int, extra: list[str], ranks: int = 1,
             threads: int = 1) -> dict:
    run_dir = out / f"ours{ranks}x{threads}{''.join(Path(e.split('=')[-1]).stem for e in extra)}"
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={ranks}"]
    cmd = [*launch, str(REPO / "run.py"), "--config", str(OUR_CONFIG), *our_overrides(model, data, run_dir, steps, extra)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    log = run_dir.with_suffix(".log")
    with open(log, "w") as f:
        if subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"our run failed, see {log}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"times": [r["time/step"] for r in rows], "response_len": [r["rollout/response_len"] for r in rows],
            "rollout": [r["time/rollout"] for r in rows], "train": [r["time/train"] for r in rows],
            "sync": [r.get("time/sync", 0.0) for r in rows], "train_tokens": [r["train/tokens"] for r in rows]}


def run_trl(model: Path, data: Path, out: Path, steps: int, threads: int = 1, compile_model: bool = False,
            onednn: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    out = out / f"trl{threads}{'compile' if compile_model else ''}{'onednn' if onednn else ''}"
    out.mkdir()
    log = out / "trl.log"
    with open(log, "w") as f:
        if subprocess.run([sys.executable, __file__, "--worker-trl", str(model), str(data), str(out), str(steps),
                           str(threads), str(int(compile_model)), str(int(onednn))], env=env, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"the TRL run failed, see {log}")
    return json.loads((out / "trl.json").read_text())


def needed_positions(prompt_len: float, gen_len: float) -> float:
    """The positions a step of the bench needs a forward at, in generation and in the update alike: each prompt
    once (its samples share it: one prefill, one shared prompt in the update) and each response but its last
    token (a target only: no later token reads it). The floor's T; ours trains exactly these (train/tokens)."""
    return PROMPTS * prompt_len + PROMPTS * SAMPLES * (gen_len - 1)


def med(xs: list[float]) -> float:
    return statistics.median(xs[1:]) if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="alternating repetitions of each run")
    ap.add_argument("--recompute", action="store_true",
                    help="also ours with the separate old-logprob forward (algo.old_logprobs=recompute)")
    ap.add_argument("--whole-machine", action="store_true",
                    help="also TRL with 2 threads vs ours with 2 threads in one process and with 2 ranks of 1 "
                         "thread (all use both cores)")
    ap.add_argument("--compile", action="store_true",
                    help="also both with torch.compile: ours with train.compile=true on ZeRO-2, TRL with torch_compile=True")
    ap.add_argument("--kernels", action="store_true",
                    help="also ours on ZeRO-2 with the fp32 linear kernel model.cpu_linear=auto does not pick here "
                         "(oneDNN or torch's MKL), and TRL with its nn.Linear layers on oneDNN (slime.models.onednn) "
                         "and our malloc settings (slime.utils.cpu_malloc)")
    ap.add_argument("--unfused", action="store_true",
                    help="also ours (ZeRO-3 and ZeRO-2) with HF's eager norm, rotary and SwiGLU chains "
                         "(train.fuse_elementwise=false; the default fuses them on CPU, slime/models/fused.py)")
    ap.add_argument("--worker-trl", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_trl:
        m, d, o, s, t, c, k = args.worker_trl
        worker_trl(Path(m), Path(d), Path(o), int(s), int(t), bool(int(c)), bool(int(k)))
        return
    from data_tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    data = write_prompts(work)
    peaks = matmul_peaks()
    peak = max(max(p) for p in peaks.values())
    from slime.models.onednn import resolve_cpu_linear

    auto = resolve_cpu_linear("auto")
    other = "torch" if auto == "onednn" else "onednn"
    print(f"1-thread fp32 matmul peak: {peak:.0f} GFLOP/s; torch's F.linear (MKL) "
          f"{', '.join(f'{p:.0f}' for p in peaks['torch'])}, oneDNN {', '.join(f'{p:.0f}' for p in peaks['onednn'])}; "
          f"ours on {auto} (model.cpu_linear=auto)")
    for size in args.sizes.split(","):
        model = make_tiny_model(work / size, arch="qwen3", seed=0, heads=4, kv_heads=2, **SIZES[size])
        n = non_embedding_params(model)
        runs = {  # name -> (how to run it, separate old-logprob forward?)
            "trl": (lambda o: run_trl(model, data, o, args.steps), False),
            "ours": (lambda o: run_ours(model, data, o, args.steps, []), False),
            "ours_zero2": (lambda o: run_ours(model, data, o, args.steps, [ZERO2]), False),
        }
        if args.recompute:
            runs["ours_recompute"] = (lambda o: run_ours(model, data, o, args.steps, ["algo.old_logprobs=recompute"]),
                                      True)
        compiled = [ZERO2, "train.compile=true"]
        if args.kernels:
            runs["trl_onednn"] = (lambda o: run_trl(model, data, o, args.steps, onednn=True), False)
            runs[f"ours_zero2_{other}_linear"] = (lambda o: run_ours(model, data, o, args.steps,
                                                                     [ZERO2, f"model.cpu_linear={other}"]), False)
        if args.unfused:
            runs["ours_unfused"] = (lambda o: run_ours(model, data, o, args.steps, [UNFUSED]), False)
            runs["ours_zero2_unfused"] = (lambda o: run_ours(model, data, o, args.steps, [ZERO2, UNFUSED]), False)
        if args.compile:
            runs["trl_compile"] = (lambda o: run_trl(model, data, o, args.steps, compile_model=True), False)
            runs["ours_zero2_compile"] = (lambda o: run_ours(model, data, o, args.steps, compiled), False)
        if args.whole_machine:
            runs["trl_2_threads"] = (lambda o: run_trl(model, data, o, args.steps, threads=2), False)
            runs["ours_2_threads"] = (lambda o: run_ours(model, data, o, args.steps, [], threads=2), False)
            runs["ours_zero2_2_threads"] = (lambda o: run_ours(model, data, o, args.steps, [ZERO2], threads=2), False)
            runs["ours_2_ranks"] = (lambda o: run_ours(model, data, o, args.steps, [], ranks=2), False)
            runs["ours_zero2_2_ranks"] = (lambda o: run_ours(model, data, o, args.steps, [ZERO2], ranks=2), False)
            if args.compile:
                runs["ours_zero2_compile_2_ranks"] = (lambda o: run_ours(model, data, o, args.steps, compiled, ranks=2),
                                                      False)
        results = {name: [] for name in runs}
        before = peak_now()
        for rep in range(args.reps):
            out = work / f"{size}-{rep}"
            out.mkdir()
            order = list(runs.items())
            for name, (fn, _) in order[::-1] if rep % 2 else order:  # each side first in every other rep
                results[name].append(fn(out))
                after = peak_now()
                results[name][-1]["peak"] = max(before, after)  # the machine as this run found it
                peak, before = max(peak, after), after
        print(f"\n{size}: {n / 1e6:.1f}M parameters without embeddings; {PROMPTS}x{SAMPLES} samples x {NEW_TOKENS} "
              f"new tokens, median of steps 2..{args.steps}, {args.reps} alternating runs each; the best peak so far "
              f"{peak:.0f} GFLOP/s")
        step, efficiency, beside = {}, {}, {}
        prompt_len = prompt_tokens(model, data)
        for name, rs in results.items():
            t = statistics.median(med(r["times"]) for r in rs)
            gen_len = statistics.median(med(r["response_len"]) for r in rs if r["response_len"])
            # The positions the step needs: each prompt once, each response but its last token (see the docstring)
            needed = needed_positions(prompt_len, gen_len)
            passes = 6 + (2 if runs[name][1] else 0)  # fwd+bwd, plus a separate old-logprob forward
            cores = 2 if name.endswith(("threads", "ranks")) else 1
            flops = (2 + passes) * n * needed  # generation (prefill and decode), then the update
            floor = flops / (cores * peak * 1e9)
            step[name], efficiency[name] = t, floor / t
            beside[name] = statistics.median(flops / (cores * r["peak"] * 1e9) / med(r["times"]) for r in rs)
            extra = ""
            if name.startswith("ours"):
                extra = "  (rollout {:.2f} s, scoring+update {:.2f} s, sync {:.2f} s)".format(
                    *(statistics.median(med(r[k]) for r in rs) for k in ("rollout", "train", "sync")))
            print(f"  {name:26s} {t:6.2f} s/step  response {gen_len:5.1f} tokens  floor {floor:5.2f} s  "
                  f"efficiency {floor / t:.2f}, {beside[name]:.2f} at the peak beside it "
                  f"({statistics.median(r['peak'] for r in rs):.0f}){extra}")
        for name, base in (("ours", "trl"), ("ours_zero2", "trl"), ("ours_recompute", "trl"),
                           ("ours_zero2_compile", "trl"), ("ours_zero2_compile", "trl_compile"),
                           (f"ours_zero2_{other}_linear", "trl"), ("ours_zero2", "trl_onednn"),
                           ("ours_zero2_compile", "trl_onednn"),
                           ("ours_2_threads", "trl_2_threads"), ("ours_zero2_2_threads", "trl_2_threads"),
                           ("ours_2_ranks", "trl_2_threads"), ("ours_zero2_2_ranks", "trl_2_threads"),
                           ("ours_zero2_compile_2_ranks", "trl_2_threads")):
            if name in step and base in step:
                ratio = step[name] / step[base]
                print(f"  {name} / {base}: {ratio:.2f}x the step time (target <= {TARGET_RATIO}: "
                      f"{'met' if ratio <= TARGET_RATIO else 'NOT met'})")
        if size == "medium":
            for name in ("ours", "ours_zero2", "ours_zero2_compile"):
                if name not in efficiency:
                    continue
                for label, e in (("at the best peak", efficiency[name]), ("at the peak beside it", beside[name])):
                    print(f"  {name} efficiency {e:.3f} {label} (target >= {TARGET_EFFICIENCY}: "  # 0.796: not 0.80
                          f"{'met' if e >= TARGET_EFFICIENCY else 'NOT met'})")

if __name__ == "__main__":
    main()
