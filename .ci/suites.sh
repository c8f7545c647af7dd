# Sourced by .ci/run: run every suite, remember each one's summary and
# status, and fail at the end if any failed. A suite's failure never stops
# the next suite from running, and never goes unreported in the exit status.

summaries=()
failed=()

# suite NAME COMMAND...: runs COMMAND (its output shown as it comes), then
# records pytest's closing line and whether COMMAND exited 0.
suite() {
  local name=$1
  shift
  local log status=0
  log=$(mktemp)
  echo "=== suite $name: $*"
  "$@" 2>&1 | tee "$log" || status=$?
  local last
  last=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 || true)
  rm -f "$log"
  summaries+=("$name: ${last:-no pytest summary} (exit $status)")
  if [ "$status" -ne 0 ]; then
    failed+=("$name")
  fi
}

# finish: prints every suite's summary; exits 1 if any suite failed, and
# also if none ran.
finish() {
  echo "=== summaries"
  local line
  for line in "${summaries[@]}"; do
    echo "$line"
  done
  if [ "${#summaries[@]}" -eq 0 ]; then
    echo "no suite ran"
    exit 1
  fi
  if [ "${#failed[@]}" -ne 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
  fi
}
