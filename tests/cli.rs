//! The `kiln` binary itself: `kiln registry` output and exit codes.

use std::process::Command;

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

#[test]
fn registry_json_lists_every_registry_and_the_collection_mechanism() {
    let out = kiln(&["registry", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let expected = if cfg!(feature = "inventory") {
        "inventory"
    } else {
        "linkme"
    };
    assert_eq!(doc["collection"], expected);
    for kind in ["exporters", "trainers", "architectures"] {
        assert!(doc[kind].is_array(), "{kind} missing from {doc}");
    }
}

#[test]
fn registry_of_one_kind_prints_only_that_table() {
    let out = kiln(&["registry", "trainers"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("trainers ("), "{text}");
    assert!(!text.contains("exporters ("), "{text}");
    assert!(text.contains("backend candle:"), "{text}");
}

#[test]
fn bad_usage_exits_2_with_a_message() {
    let out = kiln(&["registry", "modules"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("invalid value 'modules'"), "{err}");
    assert!(err.contains("exporters, trainers, architectures"), "{err}");
}
