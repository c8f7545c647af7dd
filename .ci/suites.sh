# Sourced by .ci/run: run every suite, remember each one's summary, status
# and wall time, and fail at the end if any failed. A suite's failure never
# stops the next suite from running, and never goes unreported in the exit
# status.

summaries=()
failed=()
started=$SECONDS

# minutes SECONDS: the duration as M:SS.
minutes() {
  printf '%d:%02d' $(($1 / 60)) $(($1 % 60))
}

# suite NAME COMMAND...: runs COMMAND (its output shown as it comes), then
# records pytest's closing line, whether COMMAND exited 0 and its wall time.
suite() {
  local name=$1
  shift
  local log status=0 start=$SECONDS
  log=$(mktemp)
  echo "=== suite $name: $*"
  "$@" 2>&1 | tee "$log" || status=$?
  local last wall
  last=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 || true)
  rm -f "$log"
  wall=$(minutes $((SECONDS - start)))
  echo "=== suite $name: exit $status, $wall wall"
  summaries+=("$name: ${last:-no pytest summary} (exit $status, $wall wall)")
  if [ "$status" -ne 0 ]; then
    failed+=("$name")
  fi
}

# finish: prints every suite's summary and the whole run's wall time
# (environments included); exits 1 if any suite failed, and also if none ran.
finish() {
  echo "=== summaries"
  local line
  for line in "${summaries[@]}"; do
    echo "$line"
  done
  echo "total: $(minutes $((SECONDS - started))) wall"
  if [ "${#summaries[@]}" -eq 0 ]; then
    echo "no suite ran"
    exit 1
  fi
  if [ "${#failed[@]}" -ne 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
  fi
}
