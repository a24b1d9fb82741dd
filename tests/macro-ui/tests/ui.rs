//! Every compile error the attribute macros emit, pinned with trybuild (`tests/ui/*.stderr`).
//! Regenerate after an intended change with
//! `TRYBUILD=overwrite cargo test -p kiln-macro-ui --test ui` and review the diff.
//!
//! The cases build against `kiln` without its default features — the plugin surface alone —
//! so trybuild's own build does not compile candle and the command line.

#[test]
fn macro_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/ui-pass/*.rs");
}
