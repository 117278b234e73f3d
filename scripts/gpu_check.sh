#!/usr/bin/env bash
# The GPU checks of issues 13, 15 and 16 in one call on a machine with CUDA (the device lent to
# some sessions: torch with CUDA, pytest, transformers and lightning preinstalled, no package
# index). Steps run in priority order, each under its own time limit, and a step is not started
# when what is left of BUDGET seconds cannot hold its limit; logs, results and a summary land in
# the output folder ($OUT when set, else benchmarks/results/gpu-<date>).
#
#   bash scripts/gpu_check.sh                      # every step that fits in BUDGET=570 s
#   BUDGET=300 bash scripts/gpu_check.sh tests     # the named steps only
#
# Steps: tests (pytest -m gpu), bench_gpu (blocking vs the D2H floor, torn tensors, warm
# restore, the plain-loop overhead), transformers, lightning (adapters' overhead vs the
# Trainer's save_steps and ModelCheckpoint). The tests include FSDP2 Sharded state on CUDA.
# Copy the figures into docs/performance.md ("On a GPU") with the GPU, torch version and date.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu-$(date -u +%F)}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
budget="${BUDGET:-570}"
start=$SECONDS

declare -A limit=([tests]=420 [bench_gpu]=200 [transformers]=150 [lightning]=120)
order=(tests bench_gpu transformers lightning)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("${order[@]}")
for s in "${steps[@]}"; do
  [ -n "${limit[$s]:-}" ] || { echo "unknown step '$s'; steps: ${order[*]}" >&2; exit 2; }
done

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  date -u +%FT%TZ
  git rev-parse --short HEAD 2>/dev/null || true
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
if [ -z "${GPU_CHECK_ON_CPU:-}" ]; then  # (set only to try the script's plumbing on a CPU)
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    { echo "no CUDA device here: nothing to check" >&2; exit 2; }
fi

run_step() {
  local name=$1 lim=${limit[$1]}
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt "$lim" ]; then
    echo "$name: skipped (${left} s of the budget left, its limit is ${lim} s)" | tee -a "$out/summary.txt"
    return
  fi
  local cmd
  case $name in
    tests) cmd=("$py" -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_gpu.py
                tests/test_dcp_sharded.py tests/test_part_blobs.py) ;;
    bench_gpu) cmd=("$py" benchmarks/bench_gpu.py --sizes 1600 --reps 3 --loop-mb 1600
                    --loop-steps 60 --loop-every 20 --out "$out") ;;
    transformers) cmd=("$py" benchmarks/bench_transformers.py --device cuda --n-layer 12
                       --seq 512 --batch 16 --steps 45 --every 15 --reps 1 --out "$out") ;;
    lightning) cmd=("$py" benchmarks/bench_lightning.py --device cuda --mb 1600 --batch 8192
                    --steps 30 --every 10 --reps 1 --out "$out") ;;
  esac
  echo "== $name (limit ${lim} s): ${cmd[*]}"
  local t0=$SECONDS
  timeout --kill-after=10 "$lim" "${cmd[@]}" > "$out/$name.log" 2>&1
  local rc=$?
  local why=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (ran past its limit)"
  echo "$name: rc=$rc$why in $((SECONDS - t0)) s; log $out/$name.log" | tee -a "$out/summary.txt"
  tail -n 8 "$out/$name.log"
}

for s in "${steps[@]}"; do run_step "$s"; done
echo "total $((SECONDS - start)) s; summary in $out/summary.txt"
