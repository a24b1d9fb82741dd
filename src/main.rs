//! The `kiln` command line.

fn main() -> std::process::ExitCode {
    kiln::cli::main()
}
