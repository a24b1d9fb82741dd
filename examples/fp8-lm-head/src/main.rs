//! `kiln` with the example plugin linked. Without the `use ... as _` line the linker drops
//! the plugin crate, and its exporter with it.

use kiln_example_fp8_lm_head as _;

fn main() -> std::process::ExitCode {
    kiln::cli::main()
}
