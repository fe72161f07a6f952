#!/usr/bin/env bash
# The GPU lane: every check that needs a CUDA device, as one script for a lent machine's short lease (one call).
# Each part has its own time limit and writes its output under $OUT as it goes, so a part that hangs or fails
# leaves the others' results. Run from the repository root on the GPU machine:
#
#   OUT=/some/folder bash bench/gpu_lane.sh [parts...]      parts: new memory beside train rest (default: all, in order)
#
# Python packages the machine lacks (pydantic, crc32c, ...) travel as wheels in .whl/ (see BENCHMARKS.md, the GPU lane).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-${TMPDIR:-/tmp}/hpkit-gpu-lane}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HPKIT_GPU_TESTS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hpkit-site .whl/*.whl \
    || { echo "gpu_lane: the wheels in .whl did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/hpkit-site
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
TMPDIR=$(mktemp -d) && export TMPDIR

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(new memory beside train rest)

step() {  # name, seconds, command...: one part, its output in $OUT/name.txt, its status on stdout
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  echo "gpu_lane: $name rc=$rc in $(($(date +%s) - start)) s"
  tail -n 6 "$OUT/$name.txt"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  df -h /dev/shm | tail -n 1
  nproc
  free -g | sed -n 2p
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

pytest=(python3 -m pytest -q -p no:cacheprovider -m gpu)
for part in "${parts[@]}"; do
  case $part in
    new) # tests never run on a GPU yet
      step tests-new 240 "${pytest[@]}" tests/gpu/test_cuda_memory_checkpoint.py tests/gpu/test_cuda_warm.py ;;
    memory) # what an in-memory checkpoint costs a GPU step, and its restore
      step memory-125m 150 python3 bench/gpu_memory_checkpoint.py --model 125M --batch 4 --seq-len 2048
      step memory-1b 280 python3 bench/gpu_memory_checkpoint.py --model 1B --batch 2 --seq-len 2048 --rounds 1 --block 2 \
        --restores 1 --auto-max-steps 60 ;;
    beside) # where a save's cost goes: each way of writing beside GPU steps, then the Trainer's steps beside a save
      step beside-ways 120 python3 bench/gpu_write_beside.py --gib 1.5
      step beside-trainer 150 python3 bench/gpu_write_beside.py --trainer 125M
      step beside-split 120 python3 bench/gpu_write_beside.py --trainer 125M --split
      step read-125m 120 python3 bench/bench_checkpoint_read.py --model 125M --rounds 3 ;;
    train) # hpkit train's own figures on the 1B shape, for hpkit plan's check against GPU runs
      mkdir -p "$TMPDIR/train-1b"
      cat >"$TMPDIR/train-1b/job.yaml" <<YAML
name: gpu-lane-1b
output_dir: $TMPDIR/train-1b
parallelism: {dp_shard: 1}
model: {name: 1B, seq_len: 2048}
train: {steps: 14, local_batch_size: 2, mixed_precision: bf16, activation_checkpoint: none, tensorboard: false}
YAML
      step train-1b 180 python3 -m hpkit train --config "$TMPDIR/train-1b/job.yaml"
      step mfu-1b 120 python3 bench/gpu_mfu.py --batch 2 --seq-len 2048 ;;
    rest) # the rest of tests/gpu
      step tests-rest 360 "${pytest[@]}" tests/gpu --ignore=tests/gpu/test_cuda_memory_checkpoint.py \
        --ignore=tests/gpu/test_cuda_warm.py ;;
    *) echo "gpu_lane: unknown part $part (new, memory, beside, train, rest)" >&2 ;;
  esac
done
rm -rf "$TMPDIR"
