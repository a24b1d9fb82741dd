//! Models the export-writer tests share: the compat suite's tiny families, copied with a small
//! byte-level tokenizer (the writers embed or copy one; the compat inputs have none).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A byte-level BPE tokenizer of `vocab` ids (`<s>`, `</s>`, then byte symbols) for the tiny
/// compat models, whose vocabularies are 256.
pub fn write_tokenizer(dir: &Path, vocab: usize) {
    let mut v = serde_json::Map::new();
    let symbols = (b'!'..=b'~').chain(0xa1..=0xac).chain(0xae..=0xff);
    for (i, b) in symbols.take(vocab - 2).enumerate() {
        v.insert(char::from(b).to_string(), (i + 2).into());
    }
    let tok = serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<s>", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false},
            {"id": 1, "content": "</s>", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": v, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let cfg = serde_json::json!({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true,
        "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
}

/// A compat model's input, copied with a tokenizer.
pub fn family(name: &str, tmp: &Path) -> PathBuf {
    let src = root().join("tests/compat").join(name).join("model");
    let dir = tmp.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    write_tokenizer(&dir, 256);
    dir
}

/// Exports `model` to `out` through `writer` in `format` (replacing `out`).
pub fn export(
    writer: &str,
    model: &Path,
    out: &Path,
    format: &str,
) -> kiln_runtime::export::run::ExportSummary {
    use kiln_runtime::export::recipe::{Format, Recipe};
    use kiln_runtime::export::run::{ExportOptions, OutputFormat, run};
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: writer.into(),
            format: format.into(),
        }),
        force: true,
        ..ExportOptions::new(model, out, Recipe::new(Format::Nvfp4))
    };
    run(&options).unwrap_or_else(|e| panic!("{}: {writer} {format}: {e}", model.display()))
}

/// Whether `python` imports `module`; when it does not, `require` (an environment variable
/// CI sets) makes that a failure, else the caller skips its consumer check and says so.
pub fn python_has(python: &str, module: &str, require: &str, install: &str) -> bool {
    let ok = std::process::Command::new(python)
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os(require).is_none(),
            "{require} is set but {python} cannot import {module} ({install})"
        );
        eprintln!("skipped the {module} half: {python} cannot import it ({install})");
    }
    ok
}

/// Runs `script` with `args` under `python` and fails with its output unless it succeeds.
pub fn run_check(python: &str, script: &str, args: &[&std::ffi::OsStr], what: &str) {
    let out = std::process::Command::new(python)
        .arg(root().join(script))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what}: the check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // What it measured, for `--nocapture`.
    print!("{}", String::from_utf8_lossy(&out.stdout));
}
