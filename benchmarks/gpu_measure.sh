#!/usr/bin/env bash
# The GPU tables of BENCHMARKS.md that the GPU report does not make, in one
# command of under ten minutes on an H100-class GPU, most wanted first:
#   1. the 8-bit update step's costs on bench.py's 8.4M-parameter workload
#      (bytes, host time, the device's kernel time; the Pallas kernel too);
#   2. the float8 profile: bfloat16 against float8 tokens/s and the time
#      split at d_model 4096, 1024 and 2048;
#   3. float8 against bfloat16 for one layer of each shape (where float8
#      pays: the value for Float8Matmul's min_size);
#   4. the 8-bit update step's costs on 134M parameters in 8 leaves, where
#      the step is bound by memory rather than by kernel launches.
# Each writes its report and its log to $1 (default benchmarks/out/gpu) and
# has a time limit of its own, so a slow one leaves the others' reports.
# --small runs every command on tiny sizes (a CPU, a few minutes: what
# tests/test_benchmarks.py runs); its numbers measure nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
small=0
if [ "${1:-}" = "--small" ]; then small=1; shift; fi
out="${1:-benchmarks/out/gpu}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$small" = 1 ]; then
  costs=(--quick) costs_large=(--quick --layers 2 --width 64) profile=(--small)
  sizes=(--small) limit=() 
else
  costs=(--calls 10) costs_large=(--calls 10 --layers 4 --width 4096)
  profile=(--sizes 4096:2:32:2048:4,1024:8:16:1024:8,2048:4:16:2048:4)
  sizes=(--calls 10 --rounds 2 --warmup 2 --shapes
    8192:1024:1024,8192:1024:4096,8192:4096:1024,8192:2048:2048,8192:2048:8192,8192:8192:2048,8192:4096:4096,8192:4096:16384,8192:16384:4096)
  limit=(timeout)
fi
status=0
step() {  # step NAME SECONDS COMMAND...: its log in $out/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name (limit ${seconds} s)"
  local t=$SECONDS
  if [ ${#limit[@]} -gt 0 ]; then
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
  else
    "$@" 2>&1 | tee "$out/$name.log"
  fi
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t)) s"
  [ $rc = 0 ] || status=1
}
step quantize_state_costs 100 "$py" benchmarks/quantize_state.py --sections costs \
  "${costs[@]}" --out "$out/quantize_state_costs.md"
step float8_profile 300 "$py" benchmarks/float8_profile.py "${profile[@]}" \
  --out "$out/float8_profile.md"
step float8_sizes 120 "$py" benchmarks/float8_sizes.py "${sizes[@]}" \
  --out "$out/float8_sizes.md"
step quantize_state_costs_large 60 "$py" benchmarks/quantize_state.py --sections costs \
  "${costs_large[@]}" --out "$out/quantize_state_costs_large.md"
exit $status
