#!/usr/bin/env bash
# Launch a run on every local GPU, or on CPU ranks over gloo when there is no GPU.
#   bash run.sh examples/cpu_tiny_grpo.yaml [section.key=value ...]
# NPROC overrides the rank count (default: number of GPUs, or 2 on CPU); MASTER_PORT the rendezvous
# port (default 29500; give each of two concurrent runs its own).
set -euo pipefail
if [[ $# -eq 0 || $1 == -h || $1 == --help ]]; then  # the header above; without arguments, as an error
  fd=$(( $# == 0 ? 2 : 1 ))
  { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'
    echo "usage: run.sh CONFIG.yaml [section.key=value ...] [--dry-run]; config keys: python run.py --help"; } >&"$fd"
  exit $(( $# == 0 ? 2 : 0 ))
fi
config=$1
shift
if [[ $config == -* || ! -f $config ]]; then
  echo "run.sh: the first argument must be the run config (a YAML file), got '$config'" >&2
  echo "usage: run.sh CONFIG.yaml [section.key=value ...] [--dry-run]" >&2
  exit 2
fi
config=$(realpath "$config")  # the repo root becomes the working directory (paths inside configs are relative to it)
cd "$(dirname "$0")"

# --dry-run anywhere among the arguments: print the layout and memory per GPU for the rank count below, launch nothing.
dry_run=0
for arg in "$@"; do [[ $arg == --dry-run ]] && dry_run=1; done

gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ $gpus -gt 0 ]]; then
  nproc=${NPROC:-$gpus}
else
  nproc=${NPROC:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
if ! [[ $nproc =~ ^[1-9][0-9]*$ ]]; then
  echo "run.sh: NPROC=$nproc must be a rank count >= 1" >&2
  exit 2
fi
# DeepSpeed's --num_gpus N takes GPUs 0..N-1 whatever CUDA_VISIBLE_DEVICES says: name the visible ones instead.
ranks=(--num_gpus "$nproc")
if [[ $gpus -gt 0 && -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  # DeepSpeed's --include takes GPU indices only: a GPU's UUID (GPU-...) is turned into its index; a MIG
  # instance (MIG-...) has none, and torchrun, which leaves CUDA_VISIBLE_DEVICES as it is, launches on those.
  for i in "${!visible[@]}"; do
    id=${visible[$i]// /}
    if [[ ! $id =~ ^[0-9]+$ ]]; then
      index=
      if [[ $id == GPU-* ]]; then
        index=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null |
          awk -F', *' -v id="$id" 'index($2, id) == 1 {print $1; exit}' || true)
      fi
      if [[ -z $index ]]; then
        what="not a GPU index (a MIG instance has none)"
        [[ $id == GPU-* ]] && what="a UUID nvidia-smi does not list"
        echo "run.sh: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES names '$id', $what; DeepSpeed's" \
          "launcher takes indices only. Give indices (nvidia-smi -L lists them) or launch with torchrun:" \
          "torchrun --nproc_per_node $nproc run.py --config $config ... (docs/multi_node.md)" >&2
        exit 2
      fi
      id=$index
    fi
    visible[$i]=$id
  done
  ranks=(--include "localhost:$(IFS=,; echo "${visible[*]:0:$nproc}")")
fi
if [[ $gpus -gt 0 && $nproc -gt $gpus && $dry_run == 0 ]]; then
  shown="$gpus GPU(s)${CUDA_VISIBLE_DEVICES:+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}"
  echo "run.sh: NPROC=$nproc ranks, but this node shows $shown: run.sh starts one node; for several," \
    "launch with torchrun or DeepSpeed's hostfile (docs/multi_node.md)" >&2
  exit 2
fi
if [[ $dry_run == 1 ]]; then
  if [[ -z ${NPROC:-} ]]; then
    why=$([[ $gpus == 0 ]] && echo "no GPU here: the CPU default" || echo "this machine's GPUs")
    echo "run.sh: planning for $nproc ranks ($why); NPROC=N plans for N" >&2
  fi
  args=()
  for arg in "$@"; do [[ $arg != --dry-run ]] && args+=("$arg"); done
  exec python run.py --config "$config" --dry-run --num-gpus "$nproc" "${args[@]}"
fi
# A mistake in the config or an override is said here, once, before the assets below take minutes to build and
# before every rank would print it.
python run.py --config "$config" --check "$@" || exit 2
# Rank 0 listens on MASTER_PORT: one held by another run (two runs on the default) is said here, not as torch's
# EADDRINUSE traceback from every rank.
port=${MASTER_PORT:-29500}
python - "$port" <<'EOF' || exit 2
import socket, sys
port = sys.argv[1]
if not port.isdigit() or not 0 < int(port) < 65536:
    sys.exit(f"run.sh: MASTER_PORT={port} must be a TCP port number (1-65535)")
with socket.socket() as s, socket.socket() as free:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds: TIME_WAIT is no obstacle
    try:
        s.bind(("", int(port)))
    except OSError as e:
        free.bind(("", 0))
        sys.exit(f"run.sh: MASTER_PORT={port} is in use ({e.strerror}), by another run? Give this run a free port "
                 f"of its own, e.g. MASTER_PORT={free.getsockname()[1]} bash run.sh ...")
EOF
# The CPU demo's model and data are made by data_tools/ on first use (deterministic, no downloads), where the
# config or an override names them.
wanted=$(cat "$config"; printf '%s\n' "$@")
if grep -q "data/tiny-random" <<< "$wanted" && [[ ! -f data/tiny-random/config.json ]]; then
  python data_tools/make_tiny_model.py --out data/tiny-random
fi
if grep -q "data/arith/" <<< "$wanted" && [[ ! -f data/arith/train.jsonl ]]; then
  python data_tools/make_arithmetic.py --out-dir data/arith --n-train 5000 --n-eval 500 --seed 0
fi
if grep -q "data/arith-chat/" <<< "$wanted" && [[ ! -f data/arith-chat/train.jsonl ]]; then
  python data_tools/make_arithmetic.py --out-dir data/arith-chat --n-train 2000 --n-eval 200 --seed 0 --format chat
fi
if grep -q "data/tiny-vl/" <<< "$wanted" && [[ ! -f data/tiny-vl/train.jsonl ]]; then
  python data_tools/make_vl_task.py --out-dir data/tiny-vl --n-train 3000 --n-eval 300 --seed 0
fi
# The shipped tiny-arith model (assets/) is rebuilt only if it was deleted (a few minutes).
if grep -qE "assets/tiny-arith([^-]|$)" <<< "$wanted" && [[ ! -f assets/tiny-arith/config.json ]]; then
  python data_tools/build_tiny_arith.py
fi
if grep -qE "assets/tiny-vl([^-]|$)" <<< "$wanted" && [[ ! -f assets/tiny-vl/config.json ]]; then
  python data_tools/build_tiny_vl.py
fi
# A GGUF model is turned into an HF directory once; later runs reuse it.
if grep -q "data/smollm2-135m-hf" <<< "$wanted" && [[ ! -f data/smollm2-135m-hf/config.json ]]; then
  python data_tools/gguf_to_hf.py --out data/smollm2-135m-hf
fi

echo "run.sh: $nproc rank(s) on $([[ $gpus -gt 0 ]] && echo GPU || echo CPU/gloo)"

# The launcher runs in a process group of its own (job control), and a SIGTERM or SIGINT sent to this
# script (a scheduler, `kill PID`, Ctrl-C) is passed on to every rank at once: each finishes its step,
# saves a checkpoint and exits non-zero. A second signal is passed on too, and the ranks exit at once.
# (DeepSpeed's outer runner would die on the signal without passing it on, leaving the ranks running.)
# Rank 0 writes this file when the run has finished: every rank exiting 0 without it (os._exit(0) in a reward or
# generate function ends a process before any handler runs) is a failure, not a success to the scheduler.
export SLIME_DONE_FILE=$(mktemp -u "${TMPDIR:-/tmp}/slime-done.XXXXXX")
export SLIME_RUN_SH_PID=$$  # the ranks exit when this script is gone (a kill -9 cannot be passed on)
set -m +e
deepspeed "${ranks[@]}" --master_port "$port" run.py --config "$config" "$@" &
launcher=$!
forward() {
  # To every rank at once: DeepSpeed's node launcher signals its ranks one after the other, each after the last
  # has exited or 30 s have passed, so a rank hung in a collective held the next one's signal (and its stack dump)
  # back. The node launcher then sees the ranks exit and ends; before there are ranks, it gets the signal itself.
  local node_launcher ranks
  node_launcher=$(pgrep -P "$launcher" | head -n 1)
  ranks=$([[ -n $node_launcher ]] && pgrep -P "$node_launcher" | tr '\n' ' ')
  echo "run.sh: $1 received, passing it on to the ranks" >&2
  # shellcheck disable=SC2086
  kill "-$1" ${ranks:-${node_launcher:-$launcher}} 2>/dev/null || true
}
trap 'forward TERM' TERM
trap 'forward INT' INT
while :; do
  wait "$launcher"
  status=$?
  kill -0 "$launcher" 2>/dev/null || break  # gone: $status is its exit code; alive: a signal interrupted `wait`
done
wait "$launcher" 2>/dev/null
last=$?
[[ $last -ne 127 ]] && status=$last  # 127: already reaped above
if [[ $status -eq 0 && ! -f $SLIME_DONE_FILE ]]; then
  echo "run.sh: every rank exited with code 0, but the run did not finish (rank 0 never reached the end): a process" \
    "ended early without an error, e.g. os._exit() in a reward or generate function; see the log above" >&2
  status=1
fi
rm -f "$SLIME_DONE_FILE"
exit "$status"
