//! Reading checkpoints, and every malformed-input case with the message it must give.

use super::*;
use safetensors::tensor::TensorView;
use std::fs;

const CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8,"num_attention_heads":2,
  "num_key_value_heads":1,"torch_dtype":"bfloat16"}"#;

/// Writes `tensors` (name, dtype, shape, bytes) with the `safetensors` crate itself, so the
/// parser is checked against an independent writer.
fn write_safetensors(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A raw safetensors file with a hand-written header and `data` bytes.
fn write_raw(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    fs::write(path, bytes).unwrap();
}

fn model(dir: &Path) {
    fs::write(dir.join("config.json"), CONFIG).unwrap();
    write_safetensors(
        &dir.join(SINGLE_FILE),
        &[
            ("lm_head.weight", Dtype::BF16, vec![4, 8], (0..64).collect()),
            (
                "model.norm.weight",
                Dtype::F32,
                vec![8],
                (0..32).map(|i| i as u8 * 3).collect(),
            ),
        ],
    );
}

fn open_err(dir: &Path) -> String {
    Checkpoint::open(dir).unwrap_err().to_string()
}

#[test]
fn a_single_file_checkpoint_reads_lazily_and_exactly() {
    let dir = tempfile::tempdir().unwrap();
    model(dir.path());
    let c = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(c.config().architecture(), Some("LlamaForCausalLM"));
    assert_eq!(c.config().dtype(), Some("bfloat16"));
    let names: Vec<&str> = c.tensors().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["lm_head.weight", "model.norm.weight"]);
    let t = c.tensor("lm_head.weight").unwrap();
    assert_eq!(
        (t.dtype, t.shape.clone(), t.byte_len(), t.numel()),
        (Dtype::BF16, vec![4, 8], 64, 32)
    );
    let mut buf = Vec::new();
    c.read("lm_head.weight", &mut buf).unwrap();
    assert_eq!(buf, (0..64).collect::<Vec<u8>>());
    c.read("model.norm.weight", &mut buf).unwrap();
    assert_eq!(buf[..4], [0, 3, 6, 9]);
    assert_eq!(c.data_bytes(), 96);
    assert!(
        c.read("missing", &mut buf)
            .unwrap_err()
            .to_string()
            .contains("tensor `missing`: no such tensor")
    );
}

#[test]
fn opening_and_reading_never_modify_the_input() {
    let dir = tempfile::tempdir().unwrap();
    model(dir.path());
    let snapshot = |d: &Path| -> Vec<(String, Vec<u8>, std::time::SystemTime)> {
        let mut v: Vec<_> = fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    fs::read(e.path()).unwrap(),
                    e.metadata().unwrap().modified().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let before = snapshot(dir.path());
    let c = Checkpoint::open(dir.path()).unwrap();
    let mut buf = Vec::new();
    c.read("lm_head.weight", &mut buf).unwrap();
    drop(c);
    assert_eq!(snapshot(dir.path()), before);
}

fn sharded(dir: &Path, index: &str) {
    fs::write(dir.join("config.json"), CONFIG).unwrap();
    write_safetensors(
        &dir.join("model-00001-of-00002.safetensors"),
        &[("a.weight", Dtype::F16, vec![2, 2], vec![1; 8])],
    );
    write_safetensors(
        &dir.join("model-00002-of-00002.safetensors"),
        &[("b.weight", Dtype::F32, vec![2], vec![2; 8])],
    );
    fs::write(dir.join(INDEX_FILE), index).unwrap();
}

const GOOD_INDEX: &str = r#"{"metadata":{"total_size":16},"weight_map":{
  "a.weight":"model-00001-of-00002.safetensors","b.weight":"model-00002-of-00002.safetensors"}}"#;

#[test]
fn a_sharded_checkpoint_maps_every_tensor_to_its_shard() {
    let dir = tempfile::tempdir().unwrap();
    sharded(dir.path(), GOOD_INDEX);
    let c = Checkpoint::open(dir.path()).unwrap();
    let mut buf = Vec::new();
    c.read("b.weight", &mut buf).unwrap();
    assert_eq!(buf, [2; 8]);
    assert_eq!(c.len(), 2);
}

#[test]
fn index_errors_name_the_index_and_what_is_wrong() {
    let cases = [
        (
            GOOD_INDEX.replace("model-00002-of-00002", "model-00003-of-00002"),
            "names shard `model-00003-of-00002.safetensors`, which does not exist",
        ),
        (
            GOOD_INDEX.replace("\"b.weight\"", "\"c.weight\""),
            "does not list tensor `b.weight` of shard `model-00002-of-00002.safetensors`",
        ),
        (
            GOOD_INDEX.replace("}}", ",\"z.weight\":\"model-00001-of-00002.safetensors\"}}"),
            "lists tensor `z.weight` in `model-00001-of-00002.safetensors`, which does not contain it",
        ),
        (
            GOOD_INDEX.replace("model-00001-of-00002.safetensors", "../x.safetensors"),
            "is not a plain file name",
        ),
        (
            "{\"weight_map\": 3}".to_string(),
            "missing object field `weight_map`",
        ),
        ("{not json".to_string(), "invalid JSON"),
    ];
    for (index, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        sharded(dir.path(), &index);
        let err = open_err(dir.path());
        assert!(
            err.contains(INDEX_FILE) && err.contains(want),
            "{err}\n  should contain: {want}"
        );
    }
}

/// Writes one (possibly malformed) weights file.
type WriteFile = Box<dyn Fn(&Path)>;

#[test]
fn safetensors_header_errors_name_the_file_and_tensor() {
    let good = r#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
    let cases: Vec<(WriteFile, &str)> = vec![
        (
            Box::new(|p| fs::write(p, [1u8, 2, 3]).unwrap()),
            "3 bytes: too short for the 8-byte header length",
        ),
        (
            Box::new(|p| {
                let mut b = 1000u64.to_le_bytes().to_vec();
                b.extend_from_slice(b"{}");
                fs::write(p, b).unwrap()
            }),
            "header length 1000 runs past the end of the file (10 bytes; truncated?)",
        ),
        (
            Box::new(|p| write_raw(p, "{\"w\": [nope", &[])),
            "header is not a JSON object",
        ),
        (
            Box::new(move |p| write_raw(p, good, &[0; 5])),
            "tensor `w`: data_offsets [0, 8] run past the end of the data (5 bytes; truncated?)",
        ),
        (
            Box::new(|p| {
                write_raw(
                    p,
                    r#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,6]}}"#,
                    &[0; 6],
                )
            }),
            "tensor `w`: holds 6 bytes, but shape [2, 2] of BF16 needs 8",
        ),
        (
            Box::new(|p| {
                write_raw(
                    p,
                    r#"{"w":{"dtype":"BF16","shape":[2],"data_offsets":[4,0]}}"#,
                    &[0; 4],
                )
            }),
            "tensor `w`: data_offsets [4, 0] end before they start",
        ),
        (
            Box::new(|p| {
                write_raw(
                    p,
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                    &[0; 12],
                )
            }),
            "tensor `b`: data overlaps tensor `a`",
        ),
        (
            Box::new(|p| {
                write_raw(
                    p,
                    r#"{"w":{"dtype":"Q8","shape":[2],"data_offsets":[0,2]}}"#,
                    &[0; 2],
                )
            }),
            "tensor `w`: malformed entry: unknown variant `Q8`",
        ),
    ];
    for (write, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("config.json"), CONFIG).unwrap();
        write(&dir.path().join(SINGLE_FILE));
        let err = open_err(dir.path());
        assert!(
            err.contains(SINGLE_FILE) && err.contains(want),
            "{err}\n  should contain: {want}"
        );
    }
}

#[test]
fn a_truncated_real_file_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    model(dir.path());
    let path = dir.path().join(SINGLE_FILE);
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let err = open_err(dir.path());
    assert!(
        err.contains("run past the end of the data") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn config_errors_name_the_field() {
    let cases = [
        (r#"{"hidden_size":8}"#, "field `architectures` is missing"),
        (
            r#"{"architectures":[]}"#,
            "field `architectures` must be a non-empty list",
        ),
        (
            r#"{"architectures":["X"],"hidden_size":"8"}"#,
            "field `hidden_size` must be a non-negative integer",
        ),
        (
            r#"{"architectures":["X"],"hidden_size":10,"num_attention_heads":4}"#,
            "`hidden_size` 10 is not divisible by `num_attention_heads` 4",
        ),
        (
            r#"{"architectures":["X"],"hidden_size":8,"num_attention_heads":4,"num_key_value_heads":3}"#,
            "`num_attention_heads` 4 is not a multiple of `num_key_value_heads` 3",
        ),
        (
            r#"{"architectures":["X"],"torch_dtype":"int8"}"#,
            "field `torch_dtype` is \"int8\"",
        ),
        ("[1, 2]", "not a JSON object"),
        ("{", "invalid JSON"),
    ];
    for (text, want) in cases {
        let err = ModelConfig::parse(Path::new("m/config.json"), text)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("m/config.json: ") && err.contains(want),
            "{err}\n  should contain: {want}"
        );
    }
    // transformers 5 writes `dtype`; a head_dim makes an indivisible hidden_size fine.
    let c = ModelConfig::parse(Path::new("c"), r#"{"model_type":"llama","dtype":"float16","hidden_size":10,"num_attention_heads":4,"head_dim":3}"#).unwrap();
    assert_eq!((c.architecture(), c.dtype()), (None, Some("float16")));
}

#[test]
fn missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = open_err(dir.path());
    assert!(
        err.contains("config.json") && err.contains("No such file"),
        "{err}"
    );
    fs::write(dir.path().join("config.json"), CONFIG).unwrap();
    let err = open_err(dir.path());
    assert!(
        err.ends_with("no model.safetensors or model.safetensors.index.json"),
        "{err}"
    );
}
