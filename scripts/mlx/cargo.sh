#!/usr/bin/env bash
# cargo with kiln's MLX build on Linux (scripts/mlx/setup.sh first), e.g.
#   scripts/mlx/cargo.sh test --features mlx
# The patched crates change Cargo.lock's sources for mlx-sys / mlx-rs while cargo runs; the
# committed lock file is put back afterwards.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CFG="$ROOT/target/mlx/cargo.toml"
[ -e "$CFG" ] || { echo "run scripts/mlx/setup.sh first" >&2; exit 1; }
cp "$ROOT/Cargo.lock" "$ROOT/target/mlx/Cargo.lock.committed"
restore() { cp "$ROOT/target/mlx/Cargo.lock.committed" "$ROOT/Cargo.lock"; }
trap restore EXIT
cd "$ROOT"
# After the subcommand, so that external ones (clippy) pass it on too.
sub=$1
shift
cargo "$sub" --config "$CFG" "$@"
