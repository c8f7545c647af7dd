#!/usr/bin/env bash
# The GPU tables of BENCHMARKS.md that the GPU report does not make, each
# with a time limit of its own, so a slow one leaves the others' reports:
#   costs        the 8-bit update step's costs on bench.py's 8.4M-parameter
#                workload: bytes, host time, the device's kernel time, the
#                Pallas kernel too, with update and apply_gradients (165 s on
#                an H200 before apply_gradients' row);
#   profile      the float8 profile: bfloat16 against float8 tokens/s and the
#                time split at d_model 4096, 1024 and 2048 (about 130 s a size:
#                2048, the last, may not fit its limit);
#   threshold    the profile at d_model 1024 and 2048 with
#                Float8Matmul(min_size=4096), without the loss (about 60 s a size);
#   sizes        float8 against bfloat16 for one layer of each shape, where
#                float8 pays: the value for Float8Matmul's min_size (about 30 s
#                a shape);
#   costs_large  the 8-bit update step's costs on 134M parameters in 8 leaves,
#                bound by memory rather than by kernel launches.
# Usage: gpu_measure.sh [--small] [DIR [STEP...]]; DIR defaults to
# benchmarks/out/gpu, the steps to all five. Their time limits add up to
# two 10-minute commands: "costs profile" in one (590 s at most) and
# "threshold sizes costs_large" in the next (600 s at most). Each step writes its report
# and its log (STEP.log) to DIR. --small runs each on tiny sizes (a CPU, a
# few minutes; tests/test_benchmarks.py runs costs_large so); its numbers
# mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
small=0
if [ "${1:-}" = "--small" ]; then small=1; shift; fi
out="${1:-benchmarks/out/gpu}"
[ $# -gt 0 ] && shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(costs profile threshold sizes costs_large)
for step in "${steps[@]}"; do
  case "$step" in
    costs | profile | threshold | sizes | costs_large) ;;
    *)
      echo "unknown step: $step (costs, profile, threshold, sizes, costs_large)" >&2
      exit 2
      ;;
  esac
done
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$small" = 1 ]; then
  costs=(--quick) costs_large=(--quick --layers 2 --width 64) profile=(--small)
  threshold=(--small --min-size 40 --loss-steps 0) sizes=(--small)
else
  costs=(--calls 5) costs_large=(--calls 5 --layers 4 --width 4096)
  profile=(--sizes 4096:2:32:2048:4,1024:8:16:1024:8,2048:4:16:2048:4)
  threshold=(--sizes 1024:8:16:1024:8,2048:4:16:2048:4 --min-size 4096 --loss-steps 0)
  sizes=(--calls 10 --rounds 2 --warmup 2 --shapes
    8192:1024:1024,8192:1024:4096,8192:4096:1024,8192:2048:2048,8192:2048:8192,8192:8192:2048,8192:4096:4096,8192:4096:16384,8192:16384:4096)
fi
status=0
run() {  # run NAME SECONDS COMMAND...: its output also in $out/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name (limit ${seconds} s)"
  local t=$SECONDS
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t)) s"
  [ $rc = 0 ] || status=1
}
for step in "${steps[@]}"; do
  case "$step" in
    costs) run costs 220 "$py" benchmarks/quantize_state.py --sections costs \
      "${costs[@]}" --out "$out/quantize_state_costs.md" ;;
    profile) run profile 370 "$py" benchmarks/float8_profile.py "${profile[@]}" \
      --out "$out/float8_profile.md" ;;
    threshold) run threshold 180 "$py" benchmarks/float8_profile.py "${threshold[@]}" \
      --out "$out/float8_threshold.md" ;;
    sizes) run sizes 300 "$py" benchmarks/float8_sizes.py "${sizes[@]}" \
      --out "$out/float8_sizes.md" ;;
    costs_large) run costs_large 120 "$py" benchmarks/quantize_state.py \
      --sections costs "${costs_large[@]}" --out "$out/quantize_state_costs_large.md" ;;
  esac
done
exit $status
