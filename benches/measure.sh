# Sourced by the benchmark scripts: `timed LABEL COMMAND...` runs COMMAND under
# `/usr/bin/time -v` with its output in "$work/LABEL.out" / "$work/LABEL.time", and sets
# `wall` (m:ss) and `rss_mb` (peak resident memory).
timed() {
  local label=$1; shift
  /usr/bin/time -v "$@" > "$work/$label.out" 2> "$work/$label.time"
  wall=$(grep 'Elapsed (wall clock)' "$work/$label.time" | awk '{print $NF}')
  local rss
  rss=$(grep 'Maximum resident set size' "$work/$label.time" | awk '{print $NF}')
  rss_mb=$(awk -v k="$rss" 'BEGIN { printf "%.0f", k / 1024 }')
}
