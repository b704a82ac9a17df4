# Bounded steps for the device scripts (sourced, not run): `run NAME LIMIT_S COMMAND...` runs COMMAND under
# `timeout` with its output in $OUT/NAME.log, records the exit status and seconds, and prints the log's last
# $TAIL_LINES lines; `print_steps` prints the short table of every step, last.
declare -a NAMES RCS SECS
run() {  # name limit command...
  local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  echo "=== $name: $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?; NAMES+=("$name"); RCS+=("$rc"); SECS+=("$(( $(date +%s) - t0 ))")
  tail -n "${TAIL_LINES:-6}" "$OUT/$name.log"
}
print_steps() {
  echo; printf '%-10s %5s %7s\n' step rc seconds
  for i in "${!NAMES[@]}"; do printf '%-10s %5s %7s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"; done
}
