//! `scripts/check-layers.py` (run by CI): the runtime's top-level folders import each other
//! without a cycle, and the check finds one when there is.

use std::path::Path;
use std::process::Command;

fn check(root: &Path) -> std::process::Output {
    Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/check-layers.py"
        ))
        .arg(root)
        .output()
        .expect("python3 runs")
}

#[test]
fn the_runtime_has_no_import_cycle_between_its_folders() {
    let out = check(&Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime/src"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("formats -> "), "{text}");
}

#[test]
fn a_cycle_is_found_and_each_edge_named_with_its_line() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path();
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod a;\npub mod b;\n").unwrap();
    std::fs::write(src.join("a/mod.rs"), "use crate::b::B;\npub struct A;\n").unwrap();
    // b uses a only in a comment and in tests: no edge yet.
    std::fs::write(
        src.join("b.rs"),
        "// crate::a::A\npub struct B;\n#[cfg(test)]\nmod t { use crate::a::A; }\n",
    )
    .unwrap();
    let ok = check(src);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    std::fs::write(src.join("b.rs"), "pub struct B(crate::a::A);\n").unwrap();
    let bad = check(src);
    let text = String::from_utf8_lossy(&bad.stdout);
    assert_eq!(bad.status.code(), Some(1), "{text}");
    assert!(text.contains("cycle among a, b"), "{text}");
    assert!(text.contains("a -> b  (a/mod.rs:1)"), "{text}");
    assert!(text.contains("b -> a  (b.rs:1)"), "{text}");
}
