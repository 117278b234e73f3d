#!/usr/bin/env bash
# The GPU checks of issues 13, 15 and 16 in one call on a machine with CUDA (the device lent to
# some sessions: torch with CUDA, pytest, transformers and lightning preinstalled, no package
# index). Steps run in priority order, each under its own time limit, and a step is not started
# when what is left of BUDGET seconds cannot hold its limit; logs, results and a summary land in
# benchmarks/results/gpu-<date>, or, when $OUT is set (the device tool's output folder, which
# takes few files), in /tmp/gpu_check packed after each step into $OUT/gpu_check.tgz, beside
# $OUT/summary.txt.
#
#   bash scripts/gpu_check.sh                      # every step that fits in BUDGET=570 s
#   BUDGET=300 bash scripts/gpu_check.sh tests     # the named steps only
#
# Steps:
# - tests: pytest -m gpu. The torn-state tests one at a time, then the SIGKILL/resume ones in
#   parallel where pytest-xdist is installed: plain loop, Lightning, Transformers, FSDP2/FSDP1
#   Sharded state, FileParts, and DeepSpeed engines and Lightning's DeepSpeedStrategy where
#   DeepSpeed is (carry the wheels of scripts/gpu_wheels.sh as .whl).
# - bench_gpu: blocking vs the D2H floor, torn tensors, warm restore and where it goes, the
#   plain-loop overhead.
# - restore: bench_gpu without the plain loop (measured on the H200 already), in less time.
# - stall: whether the host buffers allocated ahead of the first save hold up training steps.
# - lightning, transformers: the adapters' overhead vs ModelCheckpoint and save_steps.
# - deepspeed: the DeepSpeed adapter's overhead and restore vs engine.save_checkpoint (default
#   engine) on the GPU (carry .whl).
# - deepspeed_async: the same, once, with DeepSpeed's decoupled (async) engine too; its async-io
#   op is built there first (libaio from .whl; the build took 6 min on 2 loaded CPU cores here).
# Copy the figures into docs/performance.md ("On a GPU") with the GPU, torch version and date.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ]; then out=/tmp/gpu_check; rm -rf "$out"; else out="benchmarks/results/gpu-$(date -u +%F)"; fi
mkdir -p "$out"
pack() {  # what comes back from the device: one archive and the summary
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/gpu_check.tgz" -C "$out" . && cp "$out/summary.txt" "$OUT/" 2>/dev/null
  return 0
}
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
# wheels that machine lacks (DeepSpeed and its needs), gathered by scripts/gpu_wheels.sh and
# carried as .whl/: installed into a folder of their own, ahead on the path
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .whl/*.whl &&
    export PYTHONPATH="/tmp/gpu_check_site:$PYTHONPATH"
fi
if [ -d .whl/libaio ]; then  # for DeepSpeed's async-io op, built there (gpu_wheels.sh)
  aio="$PWD/.whl/libaio"
  export CPATH="$aio/include${CPATH:+:$CPATH}" CFLAGS="-I$aio/include ${CFLAGS:-}"
  export LIBRARY_PATH="$aio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}" LDFLAGS="-L$aio/lib ${LDFLAGS:-}"
  export LD_LIBRARY_PATH="$aio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
budget="${BUDGET:-570}"
start=$SECONDS

declare -A limit=([tests]=400 [bench_gpu]=240 [restore]=150 [stall]=160 [lightning]=180
                 [transformers]=150 [deepspeed]=200 [deepspeed_async]=360)
# every step when none is named (BUDGET then runs out: name them, a few a call)
order=(tests bench_gpu stall lightning transformers deepspeed deepspeed_async restore)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("${order[@]}")
for s in "${steps[@]}"; do
  [ -n "${limit[$s]:-}" ] || { echo "unknown step '$s'; steps: ${order[*]}" >&2; exit 2; }
done

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  "$py" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>/dev/null ||
    echo "no deepspeed: its GPU tests skip (scripts/gpu_wheels.sh, then carry .whl)"
  date -u +%FT%TZ
  git rev-parse --short HEAD 2>/dev/null || true
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
cp "$out/machine.txt" "$out/summary.txt"
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
    tests)
      # the torn-state tests alone (their controls time a copy against kernels), then the
      # SIGKILL/resume ones (subprocesses, deterministic) several at a time
      local par=""
      "$py" -c "import xdist" 2>/dev/null && par="-n 12"
      local common="-m gpu -q -p no:cacheprovider -rA --durations=30"
      local first="$py -m pytest $common tests/test_gpu.py tests/test_gpu_torn.py tests/test_gpu_since_h200.py -k 'not sigkill'"
      local then="$py -m pytest $common $par tests/test_gpu.py tests/test_gpu_deepspeed.py tests/test_dcp_sharded.py tests/test_part_blobs.py -k 'sigkill or frozen_layer'"
      cmd=(bash -c "$first; a=\$?; $then; b=\$?; echo \"exit codes \$a \$b\"; [ \$a = 0 ] && [ \$b = 0 ]") ;;
    bench_gpu) cmd=("$py" benchmarks/bench_gpu.py --sizes 1600 --reps 3 --loop-mb 1600
                    --loop-steps 60 --loop-every 20 --out "$out") ;;
    restore) cmd=("$py" benchmarks/bench_gpu.py --sizes 1600 --reps 2 --loop-mb 0 --out "$out/restore") ;;
    stall) cmd=("$py" benchmarks/bench_gpu_stall.py --mb 1600 --steps 24 --rounds 1 --out "$out") ;;
    transformers) cmd=("$py" benchmarks/bench_transformers.py --device cuda --n-layer 12
                       --seq 512 --batch 16 --steps 45 --every 15 --reps 1 --out "$out") ;;
    deepspeed) cmd=("$py" benchmarks/bench_deepspeed.py --device cuda --dtype bf16 --mb 400
                    --batch 65536 --steps 30 --every 10 --reps 2 --no-decoupled --overlap --out "$out") ;;
    deepspeed_async) cmd=(bash -c "DS_ACCELERATOR=cuda $py -c 'from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load()' && $py benchmarks/bench_deepspeed.py --device cuda --dtype bf16 --mb 400 --batch 65536 --steps 30 --every 10 --reps 1 --out $out/async") ;;
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
  pack
}

for s in "${steps[@]}"; do run_step "$s"; done
echo "total $((SECONDS - start)) s; summary in $out/summary.txt" | tee -a "$out/summary.txt"
pack
