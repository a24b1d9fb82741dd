//! `kiln` with the example format linked. Without the `use ... as _` line the linker drops
//! the plugin crate, and its writer and reader with it.

use kiln_example_int8_rows as _;

fn main() -> std::process::ExitCode {
    kiln::cli::main()
}
