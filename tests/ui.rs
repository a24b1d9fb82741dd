//! Every compile error the attribute macros emit, pinned with trybuild (`tests/ui/*.stderr`).
//! Regenerate after an intended change with `TRYBUILD=overwrite cargo test --test ui`.

#[test]
fn macro_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/ui-pass/*.rs");
}
