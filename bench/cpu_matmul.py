"""fp32 linear layers on CPU: torch's F.linear (MKL) against oneDNN (model.cpu_linear, slime/models/onednn.py).

    python bench/cpu_matmul.py [--threads 1] [--hidden 512] [--decode] [--layers 10]

For the linear layers of a Qwen3 model of the given width (q/o: h x h, k/v: h x h/2 with 2 of 4 heads, gate/up
and down: h x 2h and 2h x h, as bench/vs_trl.py's models), at 1 (one-token decode) to 4096 rows (a training
micro-batch): GFLOP/s of the forward on each kernel, their ratio, and for the largest row count both backward
matmuls (input and weight gradients). Also which kernel `slime.models.onednn.linear` picks (MIN_MACS), so the
crossover it assumes can be checked on a new machine, and which kernel model.cpu_linear=auto runs on this CPU.
Results are also compared to fp64 (max relative error).

--decode: the hf engine's decode-step matmuls as a rollout runs them, every layer's weights in turn (a model's
weights stream from memory at each step: --layers layers of the fused shapes qkv, o, gate+up, down), at 16 to 448
rows, on the plain weights (F.linear: MKL's sgemm on x @ W.T) against the copies rollout.hf_packed_weights keeps
(slime/models/decode_step.py): transposed (torch.mm, MKL on x @ W) and oneDNN's blocked layout.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from slime.models import onednn


def seconds_per_call(fn, min_time: float = 0.3) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time:
        fn()
        calls += 1
    return elapsed / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--decode", action="store_true", help="the decode step's matmuls, weights streaming")
    ap.add_argument("--layers", type=int, default=10, help="--decode: layers of weights")
    args = ap.parse_args()
    if not onednn.available():
        raise SystemExit("this torch build has no oneDNN (torch.backends.mkldnn)")
    torch.set_num_threads(args.threads)
    if args.decode:
        return decode(args.hidden, args.layers, args.threads)
    h = args.hidden
    shapes = {"q/o": (h, h), "k/v": (h, h // 2), "gate/up": (h, 2 * h), "down": (2 * h, h)}
    mm = lambda a, b: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # noqa: E731  a @ b.T
    print(f"{args.threads} thread(s), fp32, hidden {h}; GFLOP/s torch (MKL) / oneDNN, and the kernel "
          f"slime.models.onednn.linear picks (oneDNN from {onednn.MIN_MACS} multiply-adds); on this CPU "
          f"({onednn.cpu_vendor()}) model.cpu_linear=auto runs {onednn.resolve_cpu_linear('auto')}")
    for rows in (1, 4, 16, 64, 256, 4096):
        cells = []
        for name, (k, n) in shapes.items():
            x, w = torch.randn(rows, k), torch.randn(n, k)
            flops = 2 * rows * k * n
            mkl, dnn = (flops / seconds_per_call(f) / 1e9 for f in (lambda: F.linear(x, w), lambda: mm(x, w)))
            pick = "oneDNN" if onednn.usable(x, w) else "torch"
            cells.append(f"{name} {mkl:4.0f}/{dnn:4.0f} ({dnn / mkl:.2f}x, {pick})")
        print(f"  {rows:5d} rows: " + "  ".join(cells))
    rows = 4096
    print(f"backward at {rows} rows (GFLOP/s torch / oneDNN; max relative error against fp64, torch / oneDNN):")
    for name, (k, n) in shapes.items():
        x, w, g = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
        flops = 2 * rows * k * n
        for what, torch_fn, dnn_fn, exact in (
                ("input grad", lambda: g @ w, lambda: mm(g, w.t()), g.double() @ w.double()),
                ("weight grad", lambda: g.t() @ x, lambda: mm(g.t(), x.t()), g.double().t() @ x.double())):
            mkl, dnn = (flops / seconds_per_call(f) / 1e9 for f in (torch_fn, dnn_fn))
            err = [((f().double() - exact).abs().max() / exact.abs().max()).item() for f in (torch_fn, dnn_fn)]
            print(f"  {name:8s} {what:11s} {mkl:4.0f}/{dnn:4.0f} ({dnn / mkl:.2f}x)  "
                  f"error {err[0]:.1e} / {err[1]:.1e}")


def decode(h: int, layers: int, threads: int, reps: int = 9) -> None:
    """GFLOP/s of all layers' matmuls in turn, per weight layout (see the module's --decode)."""
    from slime.models.decode_step import mm_transposed, transposed

    shapes = [(h + h, h), (h, h), (4 * h, h), (h, 2 * h)]  # (out, in): q+k+v (2 of 4 heads for kv), o, gate+up, down
    weights = [torch.randn(shape) for _ in range(layers) for shape in shapes]
    kernels = {"F.linear": (lambda w: w, lambda x, w: F.linear(x, w)),
               "transposed": (transposed, lambda x, w: mm_transposed(x, w, None)),
               "oneDNN packed": (onednn.pack, lambda x, w: onednn._mm_nt(x, w))}
    print(f"{threads} thread(s), fp32, decode-step matmuls of {layers} layers of hidden {h} "
          f"({sum(w.numel() for w in weights) * 4 / 2 ** 20:.0f} MB of weights); GFLOP/s, and the ratio to F.linear:")
    packs = {name: [pack(w) for w in weights] for name, (pack, _) in kernels.items()}
    for rows in (16, 32, 64, 128, 448):
        inputs = [torch.randn(rows, w.shape[1]) for w in weights]
        flops = sum(2 * rows * w.numel() for w in weights)
        times = {name: [] for name in kernels}
        for _ in range(reps):  # alternating, medians: this machine's speed moves from minute to minute
            for name, (_, mm) in kernels.items():
                times[name].append(seconds_per_call(lambda: [mm(x, p) for p, x in zip(packs[name], inputs)], 0.1))
        rates = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
        print(f"  {rows:4d} rows: " + "  ".join(f"{name} {rate:4.0f} ({rate / rates['F.linear']:.2f}x)"
                                                 for name, rate in rates.items()))


if __name__ == "__main__":
    main()
