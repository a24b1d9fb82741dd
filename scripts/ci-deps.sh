#!/usr/bin/env bash
# Installs what .ci/run needs beyond the Rust toolchain the machine ships with.
# Today: only the rustfmt and clippy components (no system packages yet).
set -euo pipefail
need=()
cargo fmt --version >/dev/null 2>&1 || need+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || need+=(clippy)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci-deps: installing rust components: ${need[*]}"
  rustup component add "${need[@]}"
fi
