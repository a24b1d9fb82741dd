//! `kiln` in the plugin's package but without referencing the plugin: its entries vanish,
//! which is the pitfall the README warns about (and `tests/binaries.rs` pins).

fn main() -> std::process::ExitCode {
    kiln::cli::main()
}
