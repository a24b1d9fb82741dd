//! The bad-input matrix: every kind of malformed input × every command that reads it, each
//! with the exact error it gives (a line of stderr naming the file, tensor or field) and its
//! exit code. A panic, a success, or any other message fails the test.
//!
//! `KILN_BAD_INPUT_PRINT=1` prints what each case gives instead of checking (to update the table
//! after a deliberate change of wording).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// A copy of the tiny Llama (with a tokenizer) in `dir/name`.
fn model(dir: &Path, name: &str) -> PathBuf {
    let m = common::family("llama-tiny", dir);
    let to = dir.join(name);
    std::fs::rename(&m, &to).unwrap();
    to
}

/// The safetensors file's header (as JSON) and its data.
fn split(bytes: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
        bytes[8 + n..].to_vec(),
    )
}

fn join(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let mut text = serde_json::to_vec(header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    out
}

/// Rewrites `model.safetensors` of `m` with `edit`.
fn edit_weights(m: &Path, edit: impl FnOnce(Vec<u8>) -> Vec<u8>) {
    let f = m.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, edit(bytes)).unwrap();
}

fn edit_header(m: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    edit_weights(m, |bytes| {
        let (mut h, data) = split(&bytes);
        edit(&mut h);
        join(&h, &data)
    });
}

fn edit_config(m: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let f = m.join("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&f).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(&f, c.to_string()).unwrap();
}

const GATE: &str = "model.layers.1.mlp.gate_proj.weight";

/// `kiln train` for one sft step, replacing its output.
const TRAIN: [&str; 7] = [
    "train",
    "--task",
    "sft",
    "--max-steps",
    "1",
    "--quiet",
    "--force",
];

/// The malformed models: name, and how the good copy is broken.
type Breaks = Box<dyn Fn(&Path)>;

fn broken_models() -> Vec<(&'static str, Breaks)> {
    vec![
        (
            "truncated-data",
            Box::new(|m| edit_weights(m, |b| b[..b.len() * 2 / 3].to_vec())),
        ),
        (
            "huge-header-length",
            Box::new(|m| {
                edit_weights(m, |mut b| {
                    b[..8].copy_from_slice(&(1u64 << 62).to_le_bytes());
                    b
                })
            }),
        ),
        (
            "broken-header-json",
            Box::new(|m| {
                edit_weights(m, |mut b| {
                    b[8] = b'[';
                    b
                })
            }),
        ),
        (
            "offsets-past-the-end",
            Box::new(|m| {
                edit_header(m, |h| {
                    let o = h[GATE]["data_offsets"].as_array_mut().unwrap();
                    let end = o[1].as_u64().unwrap();
                    o[1] = (end + (1 << 20)).into();
                })
            }),
        ),
        (
            "unknown-dtype",
            Box::new(|m| edit_header(m, |h| h[GATE]["dtype"] = "F99".into())),
        ),
        (
            "shape-against-config",
            Box::new(|m| {
                edit_header(m, |h| {
                    h[GATE]["shape"].as_array_mut().unwrap().reverse();
                })
            }),
        ),
        (
            "missing-tensor",
            Box::new(|m| {
                edit_header(m, |h| {
                    h.as_object_mut().unwrap().remove(GATE);
                })
            }),
        ),
        (
            "config-not-a-number",
            Box::new(|m| edit_config(m, |c| c["hidden_size"] = "big".into())),
        ),
        (
            "config-missing",
            Box::new(|m| std::fs::remove_file(m.join("config.json")).unwrap()),
        ),
        (
            "config-not-json",
            Box::new(|m| std::fs::write(m.join("config.json"), "{\"hidden_size\": 128,").unwrap()),
        ),
    ]
}

/// The commands that read a model folder, given the model, a good export of the good model
/// and a scratch output folder.
fn model_commands(
    m: &Path,
    good_export: &Path,
    out: &Path,
    data: &Path,
) -> Vec<(&'static str, Vec<String>)> {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let v = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    vec![
        (
            "export",
            [
                v(&["export", "--format", "int8-wo", "--force", "--model"]),
                vec![s(m), "--out".into(), s(out)],
            ]
            .concat(),
        ),
        ("explain", [v(&["explain", "--model"]), vec![s(m)]].concat()),
        (
            "eval",
            [
                v(&["eval", "--model"]),
                vec![s(m), "--data".into(), s(data)],
            ]
            .concat(),
        ),
        (
            "verify",
            [
                v(&["verify", "--reference"]),
                vec![s(m), "--quantized".into(), s(good_export)],
            ]
            .concat(),
        ),
        (
            "train",
            [
                v(&[&TRAIN[..], &["--model"]].concat()),
                vec![s(m), "--out".into(), s(out)],
            ]
            .concat(),
        ),
        (
            "generate",
            [
                v(&[
                    "generate",
                    "--max-new-tokens",
                    "2",
                    "--prompt",
                    "hi",
                    "--model",
                ]),
                vec![s(m)],
            ]
            .concat(),
        ),
    ]
}

/// What a case gives: exit code and the stderr line that starts with `error:`.
fn outcome(args: &[String]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
        "{args:?} panicked: {stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    // `kiln verify` reports a failed check as a `FAIL` line of its report.
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error"))
        .or_else(|| stdout.lines().find(|l| l.starts_with("FAIL")))
        .unwrap_or("")
        .to_string();
    (out.status.code(), line)
}

/// Replaces the scratch folder in a message with `<TMP>`, so the table is the same on every
/// machine.
fn portable(line: &str, dir: &Path) -> String {
    line.replace(dir.to_str().unwrap(), "<TMP>")
}

#[test]
fn every_bad_input_to_every_command_is_a_named_error() {
    let print = std::env::var_os("KILN_BAD_INPUT_PRINT").is_some();
    let dir = tempfile::tempdir().unwrap();
    let good = model(dir.path(), "good");
    let good_export = dir.path().join("good-export");
    let data = dir.path().join("eval.jsonl");
    std::fs::write(&data, "{\"input_ids\": [1, 2, 3, 4, 5, 6]}\n").unwrap();
    let (code, line) = outcome(
        &[
            "export",
            "--format",
            "int8-wo",
            "--model",
            good.to_str().unwrap(),
            "--out",
            good_export.to_str().unwrap(),
        ]
        .map(String::from),
    );
    assert_eq!(code, Some(0), "{line}");
    let out = dir.path().join("out");
    let mut got = Vec::new();
    for (kind, breaks) in broken_models() {
        let m = model(dir.path(), kind);
        breaks(&m);
        for (command, args) in model_commands(&m, &good_export, &out, &data) {
            let (code, line) = outcome(&args);
            got.push((kind.to_string(), command, code, portable(&line, dir.path())));
        }
    }
    for (kind, data_file, text, command) in bad_files() {
        let path = dir.path().join(data_file);
        std::fs::write(&path, text).unwrap();
        let args = file_command(command, &good, &good_export, &out, &path);
        let (code, line) = outcome(&args);
        got.push((kind.to_string(), command, code, portable(&line, dir.path())));
    }
    if print {
        for (kind, command, code, line) in &got {
            println!(
                "        ({kind:?}, {command:?}, {}, {line:?}),",
                code.unwrap_or(-1)
            );
        }
        return;
    }
    let want = expected();
    assert_eq!(got.len(), want.len(), "the table has a row per case");
    for ((kind, command, code, line), (wk, wc, wcode, wline)) in got.iter().zip(want) {
        assert_eq!((kind.as_str(), *command), (wk, wc));
        assert_eq!(*code, Some(wcode), "{kind} × {command}: {line}");
        assert_eq!(line, wline, "{kind} × {command}");
    }
}

/// Malformed files other than the model: kind, file name, content, the command reading it.
fn bad_files() -> Vec<(&'static str, &'static str, &'static str, &'static str)> {
    vec![
        (
            "calib-not-json",
            "calib.jsonl",
            "{\"input_ids\": [1, 2]}\nnot json\n",
            "export --calib",
        ),
        (
            "calib-bad-ids",
            "calib.jsonl",
            "{\"input_ids\": [1, -2]}\n",
            "export --calib",
        ),
        ("calib-empty", "calib.jsonl", "\n\n", "export --calib"),
        (
            "act-amax-not-json",
            "amax.json",
            "{\"a\": ",
            "export --act-amax",
        ),
        (
            "act-amax-not-a-number",
            "amax.json",
            "{\"model.layers.0.self_attn.q_proj.input_quantizer\": \"x\"}",
            "export --act-amax",
        ),
        (
            "eval-not-json",
            "eval.jsonl",
            "{\"input_ids\": [1, 2]}\n{]\n",
            "eval --data",
        ),
        (
            "train-not-json",
            "train.jsonl",
            "{\"text\": \"a\"}\n{\"text\": \n",
            "train --data",
        ),
        (
            "train-wrong-columns",
            "train.jsonl",
            "{\"text\": \"a\"}\n{\"prompt\": \"a\", \"completion\": \"b\"}\n",
            "train --data",
        ),
        (
            "train-not-a-string",
            "train.jsonl",
            "{\"text\": 3}\n",
            "train --data",
        ),
        (
            "toml-not-toml",
            "train.toml",
            "learning_rate = = 1\n",
            "train --config",
        ),
        (
            "toml-unknown-field",
            "train.toml",
            "learning_rat = 1e-5\n",
            "train --config",
        ),
        (
            "toml-wrong-type",
            "train.toml",
            "max_steps = \"ten\"\n",
            "train --config",
        ),
        (
            "adapter-config-not-json",
            "adapter_config.json",
            "{",
            "train --init-adapter",
        ),
        (
            "adapter-config-rank-0",
            "adapter_config.json",
            "{\"peft_type\": \"LORA\", \"r\": 0, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"]}",
            "train --init-adapter",
        ),
        (
            "adapter-config-not-lora",
            "adapter_config.json",
            "{\"peft_type\": \"IA3\"}",
            "generate --adapter",
        ),
    ]
}

fn file_command(
    command: &str,
    good: &Path,
    good_export: &Path,
    out: &Path,
    file: &Path,
) -> Vec<String> {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let base: Vec<String> = match command {
        "export --calib" => vec!["export", "--format", "fp8", "--force", "--calib"],
        "export --act-amax" => vec!["export", "--format", "fp8", "--force", "--act-amax"],
        "eval --data" => vec!["eval", "--model", good_export.to_str().unwrap(), "--data"],
        "train --data" => [&TRAIN[..], &["--data"]].concat(),
        "train --config" => [&TRAIN[..], &["--config"]].concat(),
        "train --init-adapter" | "generate --adapter" => {
            // The adapter folder holds the malformed config beside valid-looking weights.
            let adapter = file.parent().unwrap().join("adapter");
            std::fs::create_dir_all(&adapter).unwrap();
            std::fs::copy(file, adapter.join("adapter_config.json")).unwrap();
            std::fs::write(adapter.join("adapter_model.safetensors"), b"").unwrap();
            let flag = if command.starts_with("train") {
                "--init-adapter"
            } else {
                "--adapter"
            };
            let mut v: Vec<String> = if command.starts_with("train") {
                TRAIN.map(String::from).to_vec()
            } else {
                ["generate", "--max-new-tokens", "2", "--prompt", "hi"]
                    .map(String::from)
                    .to_vec()
            };
            v.extend([
                "--model".to_string(),
                s(good),
                flag.to_string(),
                s(&adapter),
            ]);
            if command.starts_with("train") {
                v.extend(["--out".to_string(), s(out)]);
            }
            return v;
        }
        _ => unreachable!("{command}"),
    }
    .into_iter()
    .map(str::to_string)
    .collect();
    let mut v = base;
    v.push(s(file));
    match command {
        "export --calib" | "export --act-amax" => {
            v.extend(["--model".into(), s(good), "--out".into(), s(out)])
        }
        "train --data" | "train --config" => {
            v.extend(["--model".into(), s(good), "--out".into(), s(out)])
        }
        _ => {}
    }
    v
}

/// The table: (input kind, command, exit code, the `error:` line).
fn expected() -> Vec<(&'static str, &'static str, i32, &'static str)> {
    vec![
        (
            "truncated-data",
            "export",
            1,
            "error: <TMP>/truncated-data/model.safetensors: tensor `model.layers.1.mlp.down_proj.weight`: data_offsets [426752, 492288] run past the end of the data (480720 bytes; truncated?)",
        ),
        (
            "truncated-data",
            "explain",
            1,
            "error: <TMP>/truncated-data/model.safetensors: tensor `model.layers.1.mlp.down_proj.weight`: data_offsets [426752, 492288] run past the end of the data (480720 bytes; truncated?)",
        ),
        (
            "truncated-data",
            "eval",
            1,
            "error: <TMP>/truncated-data/model.safetensors: tensor `model.layers.1.mlp.down_proj.weight`: data_offsets [426752, 492288] run past the end of the data (480720 bytes; truncated?)",
        ),
        (
            "truncated-data",
            "verify",
            1,
            "error: <TMP>/truncated-data/model.safetensors: tensor `model.layers.1.mlp.down_proj.weight`: data_offsets [426752, 492288] run past the end of the data (480720 bytes; truncated?)",
        ),
        (
            "truncated-data",
            "train",
            1,
            "error: backend 'candle': <TMP>/truncated-data/model.safetensors: tensor `model.layers.1.mlp.down_proj.weight`: data_offsets [426752, 492288] run past the end of the data (480720 bytes; truncated?)",
        ),
        (
            "truncated-data",
            "generate",
            1,
            "error: opening <TMP>/truncated-data: <TMP>/truncated-data/model.safetensors: tensor `model.layers.1.mlp.down_proj.weight`: data_offsets [426752, 492288] run past the end of the data (480720 bytes; truncated?)",
        ),
        (
            "huge-header-length",
            "export",
            1,
            "error: <TMP>/huge-header-length/model.safetensors: header length 4611686018427387904 is over the 100000000-byte limit",
        ),
        (
            "huge-header-length",
            "explain",
            1,
            "error: <TMP>/huge-header-length/model.safetensors: header length 4611686018427387904 is over the 100000000-byte limit",
        ),
        (
            "huge-header-length",
            "eval",
            1,
            "error: <TMP>/huge-header-length/model.safetensors: header length 4611686018427387904 is over the 100000000-byte limit",
        ),
        (
            "huge-header-length",
            "verify",
            1,
            "error: <TMP>/huge-header-length/model.safetensors: header length 4611686018427387904 is over the 100000000-byte limit",
        ),
        (
            "huge-header-length",
            "train",
            1,
            "error: backend 'candle': <TMP>/huge-header-length/model.safetensors: header length 4611686018427387904 is over the 100000000-byte limit",
        ),
        (
            "huge-header-length",
            "generate",
            1,
            "error: opening <TMP>/huge-header-length: <TMP>/huge-header-length/model.safetensors: header length 4611686018427387904 is over the 100000000-byte limit",
        ),
        (
            "broken-header-json",
            "export",
            1,
            "error: <TMP>/broken-header-json/model.safetensors: header is not a JSON object: invalid type: sequence, expected a map at line 1 column 0",
        ),
        (
            "broken-header-json",
            "explain",
            1,
            "error: <TMP>/broken-header-json/model.safetensors: header is not a JSON object: invalid type: sequence, expected a map at line 1 column 0",
        ),
        (
            "broken-header-json",
            "eval",
            1,
            "error: <TMP>/broken-header-json/model.safetensors: header is not a JSON object: invalid type: sequence, expected a map at line 1 column 0",
        ),
        (
            "broken-header-json",
            "verify",
            1,
            "error: <TMP>/broken-header-json/model.safetensors: header is not a JSON object: invalid type: sequence, expected a map at line 1 column 0",
        ),
        (
            "broken-header-json",
            "train",
            1,
            "error: backend 'candle': <TMP>/broken-header-json/model.safetensors: header is not a JSON object: invalid type: sequence, expected a map at line 1 column 0",
        ),
        (
            "broken-header-json",
            "generate",
            1,
            "error: opening <TMP>/broken-header-json: <TMP>/broken-header-json/model.safetensors: header is not a JSON object: invalid type: sequence, expected a map at line 1 column 0",
        ),
        (
            "offsets-past-the-end",
            "export",
            1,
            "error: <TMP>/offsets-past-the-end/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: data_offsets [492288, 1606400] run past the end of the data (722176 bytes; truncated?)",
        ),
        (
            "offsets-past-the-end",
            "explain",
            1,
            "error: <TMP>/offsets-past-the-end/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: data_offsets [492288, 1606400] run past the end of the data (722176 bytes; truncated?)",
        ),
        (
            "offsets-past-the-end",
            "eval",
            1,
            "error: <TMP>/offsets-past-the-end/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: data_offsets [492288, 1606400] run past the end of the data (722176 bytes; truncated?)",
        ),
        (
            "offsets-past-the-end",
            "verify",
            1,
            "error: <TMP>/offsets-past-the-end/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: data_offsets [492288, 1606400] run past the end of the data (722176 bytes; truncated?)",
        ),
        (
            "offsets-past-the-end",
            "train",
            1,
            "error: backend 'candle': <TMP>/offsets-past-the-end/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: data_offsets [492288, 1606400] run past the end of the data (722176 bytes; truncated?)",
        ),
        (
            "offsets-past-the-end",
            "generate",
            1,
            "error: opening <TMP>/offsets-past-the-end: <TMP>/offsets-past-the-end/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: data_offsets [492288, 1606400] run past the end of the data (722176 bytes; truncated?)",
        ),
        (
            "unknown-dtype",
            "export",
            1,
            "error: <TMP>/unknown-dtype/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: malformed entry: unknown variant `F99`, expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, `F8_E8M0`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, `C64`, `F64`, `I64`, `U64`",
        ),
        (
            "unknown-dtype",
            "explain",
            1,
            "error: <TMP>/unknown-dtype/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: malformed entry: unknown variant `F99`, expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, `F8_E8M0`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, `C64`, `F64`, `I64`, `U64`",
        ),
        (
            "unknown-dtype",
            "eval",
            1,
            "error: <TMP>/unknown-dtype/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: malformed entry: unknown variant `F99`, expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, `F8_E8M0`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, `C64`, `F64`, `I64`, `U64`",
        ),
        (
            "unknown-dtype",
            "verify",
            1,
            "error: <TMP>/unknown-dtype/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: malformed entry: unknown variant `F99`, expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, `F8_E8M0`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, `C64`, `F64`, `I64`, `U64`",
        ),
        (
            "unknown-dtype",
            "train",
            1,
            "error: backend 'candle': <TMP>/unknown-dtype/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: malformed entry: unknown variant `F99`, expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, `F8_E8M0`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, `C64`, `F64`, `I64`, `U64`",
        ),
        (
            "unknown-dtype",
            "generate",
            1,
            "error: opening <TMP>/unknown-dtype: <TMP>/unknown-dtype/model.safetensors: tensor `model.layers.1.mlp.gate_proj.weight`: malformed entry: unknown variant `F99`, expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, `F8_E8M0`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, `C64`, `F64`, `I64`, `U64`",
        ),
        (
            "shape-against-config",
            "export",
            1,
            "error: <TMP>/shape-against-config: tensor `model.layers.1.mlp.gate_proj.weight`: shape [128, 256], but config.json implies [256, 128] (hidden_size 128, intermediate_size 256, heads 4 / kv 2 × head_dim 32, vocab_size 256)",
        ),
        (
            "shape-against-config",
            "explain",
            1,
            "error: <TMP>/shape-against-config: tensor `model.layers.1.mlp.gate_proj.weight`: shape [128, 256], but config.json implies [256, 128] (hidden_size 128, intermediate_size 256, heads 4 / kv 2 × head_dim 32, vocab_size 256)",
        ),
        (
            "shape-against-config",
            "eval",
            1,
            "error: loading <TMP>/shape-against-config: <TMP>/shape-against-config: tensor `model.layers.1.mlp.gate_proj.weight`: shape [128, 256], but config.json implies [256, 128] (hidden_size 128, intermediate_size 256, heads 4 / kv 2 × head_dim 32, vocab_size 256)",
        ),
        (
            "shape-against-config",
            "verify",
            1,
            "FAIL `model.layers.1.mlp.gate_proj` is declared W8A16, but `weight` is I8 [256, 128], the format has I8 [128, 256]",
        ),
        (
            "shape-against-config",
            "train",
            1,
            "error: backend 'candle': <TMP>/shape-against-config: tensor `model.layers.1.mlp.gate_proj.weight`: shape [128, 256], but config.json implies [256, 128] (hidden_size 128, intermediate_size 256, heads 4 / kv 2 × head_dim 32, vocab_size 256)",
        ),
        (
            "shape-against-config",
            "generate",
            1,
            "error: <TMP>/shape-against-config: tensor `model.layers.1.mlp.gate_proj.weight`: shape [128, 256], but config.json implies [256, 128] (hidden_size 128, intermediate_size 256, heads 4 / kv 2 × head_dim 32, vocab_size 256)",
        ),
        (
            "missing-tensor",
            "export",
            1,
            "error: <TMP>/missing-tensor: tensor `model.layers.1.mlp.gate_proj.weight`: missing from the checkpoint (its MLP's other projections are there)",
        ),
        (
            "missing-tensor",
            "explain",
            1,
            "error: <TMP>/missing-tensor: tensor `model.layers.1.mlp.gate_proj.weight`: missing from the checkpoint (its MLP's other projections are there)",
        ),
        (
            "missing-tensor",
            "eval",
            1,
            "error: loading <TMP>/missing-tensor: <TMP>/missing-tensor: tensor `model.layers.1.mlp.gate_proj.weight`: missing from the checkpoint (its MLP's other projections are there)",
        ),
        (
            "missing-tensor",
            "verify",
            1,
            "FAIL `model.layers.1.mlp.gate_proj.weight` is in the export but not in the reference",
        ),
        (
            "missing-tensor",
            "train",
            1,
            "error: backend 'candle': <TMP>/missing-tensor: tensor `model.layers.1.mlp.gate_proj.weight`: missing from the checkpoint (its MLP's other projections are there)",
        ),
        (
            "missing-tensor",
            "generate",
            1,
            "error: <TMP>/missing-tensor: tensor `model.layers.1.mlp.gate_proj.weight`: missing from the checkpoint (its MLP's other projections are there)",
        ),
        (
            "config-not-a-number",
            "export",
            1,
            "error: <TMP>/config-not-a-number/config.json: field `hidden_size` must be a non-negative integer, found \"big\"",
        ),
        (
            "config-not-a-number",
            "explain",
            1,
            "error: <TMP>/config-not-a-number/config.json: field `hidden_size` must be a non-negative integer, found \"big\"",
        ),
        (
            "config-not-a-number",
            "eval",
            1,
            "error: <TMP>/config-not-a-number/config.json: field `hidden_size` must be a non-negative integer, found \"big\"",
        ),
        (
            "config-not-a-number",
            "verify",
            1,
            "error: <TMP>/config-not-a-number/config.json: field `hidden_size` must be a non-negative integer, found \"big\"",
        ),
        (
            "config-not-a-number",
            "train",
            1,
            "error: backend 'candle': <TMP>/config-not-a-number/config.json: field `hidden_size` must be a non-negative integer, found \"big\"",
        ),
        (
            "config-not-a-number",
            "generate",
            1,
            "error: opening <TMP>/config-not-a-number: <TMP>/config-not-a-number/config.json: field `hidden_size` must be a non-negative integer, found \"big\"",
        ),
        (
            "config-missing",
            "export",
            1,
            "error: <TMP>/config-missing/config.json: No such file or directory (os error 2)",
        ),
        (
            "config-missing",
            "explain",
            1,
            "error: <TMP>/config-missing/config.json: No such file or directory (os error 2)",
        ),
        (
            "config-missing",
            "eval",
            1,
            "error: <TMP>/config-missing/config.json: No such file or directory (os error 2)",
        ),
        (
            "config-missing",
            "verify",
            1,
            "error: <TMP>/config-missing/config.json: No such file or directory (os error 2)",
        ),
        (
            "config-missing",
            "train",
            1,
            "error: backend 'candle': <TMP>/config-missing/config.json: No such file or directory (os error 2)",
        ),
        (
            "config-missing",
            "generate",
            1,
            "error: opening <TMP>/config-missing: <TMP>/config-missing/config.json: No such file or directory (os error 2)",
        ),
        (
            "config-not-json",
            "export",
            1,
            "error: <TMP>/config-not-json/config.json: invalid JSON: EOF while parsing a value at line 1 column 20",
        ),
        (
            "config-not-json",
            "explain",
            1,
            "error: <TMP>/config-not-json/config.json: invalid JSON: EOF while parsing a value at line 1 column 20",
        ),
        (
            "config-not-json",
            "eval",
            1,
            "error: <TMP>/config-not-json/config.json: invalid JSON: EOF while parsing a value at line 1 column 20",
        ),
        (
            "config-not-json",
            "verify",
            1,
            "error: <TMP>/config-not-json/config.json: invalid JSON: EOF while parsing a value at line 1 column 20",
        ),
        (
            "config-not-json",
            "train",
            1,
            "error: backend 'candle': <TMP>/config-not-json/config.json: invalid JSON: EOF while parsing a value at line 1 column 20",
        ),
        (
            "config-not-json",
            "generate",
            1,
            "error: opening <TMP>/config-not-json: <TMP>/config-not-json/config.json: invalid JSON: EOF while parsing a value at line 1 column 20",
        ),
        (
            "calib-not-json",
            "export --calib",
            1,
            "error: --calib: <TMP>/calib.jsonl: line 2: not JSON: expected ident at line 1 column 2",
        ),
        (
            "calib-bad-ids",
            "export --calib",
            1,
            "error: --calib: <TMP>/calib.jsonl: line 1: `input_ids` must be a list of token ids",
        ),
        (
            "calib-empty",
            "export --calib",
            1,
            "error: --calib: <TMP>/calib.jsonl: no calibration samples",
        ),
        (
            "act-amax-not-json",
            "export --act-amax",
            1,
            "error: <TMP>/amax.json: expected a JSON object of amax values: EOF while parsing a value at line 1 column 6",
        ),
        (
            "act-amax-not-a-number",
            "export --act-amax",
            1,
            "error: <TMP>/amax.json: `model.layers.0.self_attn.q_proj.input_quantizer`: expected a non-negative number, found \"x\"",
        ),
        (
            "eval-not-json",
            "eval --data",
            1,
            "error: --data: <TMP>/eval.jsonl: line 2: not JSON: key must be a string at line 1 column 2",
        ),
        (
            "train-not-json",
            "train --data",
            1,
            "error: <TMP>/train.jsonl:2: not valid JSON: EOF while parsing a value at line 1 column 9",
        ),
        (
            "train-wrong-columns",
            "train --data",
            1,
            "error: <TMP>/train.jsonl:2: missing `text` (the file's first example has the text columns)",
        ),
        (
            "train-not-a-string",
            "train --data",
            1,
            "error: <TMP>/train.jsonl:1: `text` must be a string, found 3",
        ),
        (
            "toml-not-toml",
            "train --config",
            1,
            "error: <TMP>/train.toml: not valid TOML: TOML parse error at line 1, column 17",
        ),
        (
            "toml-unknown-field",
            "train --config",
            1,
            "error: <TMP>/train.toml: config field `learning_rat`: unknown setting; did you mean `learning_rate`?",
        ),
        (
            "toml-wrong-type",
            "train --config",
            1,
            "error: <TMP>/train.toml: config field `max_steps`: expected a non-negative integer, found \"ten\"",
        ),
        (
            "adapter-config-not-json",
            "train --init-adapter",
            1,
            "error: backend 'candle': <TMP>/adapter/adapter_config.json: EOF while parsing an object at line 1 column 1",
        ),
        (
            "adapter-config-rank-0",
            "train --init-adapter",
            1,
            "error: backend 'candle': <TMP>/adapter/adapter_config.json: `r` must be a positive integer",
        ),
        (
            "adapter-config-not-lora",
            "generate --adapter",
            1,
            "error: loading the adapter <TMP>/adapter: <TMP>/adapter/adapter_config.json: `peft_type` is not \"LORA\"",
        ),
    ]
}
