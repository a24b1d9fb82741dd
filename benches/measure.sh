#!/usr/bin/env bash
# Sourced by the export benchmarks: `measure LABEL COMMAND...` runs COMMAND under
# /usr/bin/time and prints a Markdown row `| LABEL | wall time | peak RSS |` (W: a work folder).
measure() {
  local label=$1; shift
  sync
  /usr/bin/time -f "%e %M" -o "$W/time" "$@" >"$W/log" 2>&1 || { cat "$W/log"; exit 1; }
  read -r secs kb <"$W/time"
  printf '| %s | %.1f s | %.0f MB |\n' "$label" "$secs" "$((kb / 1024))"
}
