//! `kiln` with the plugin crate linked: `use ... as _` is what keeps its entries.

use kiln_test_plugin as _;

fn main() -> std::process::ExitCode {
    kiln::cli::main()
}
