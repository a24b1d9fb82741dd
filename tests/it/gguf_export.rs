//! `--output-format gguf`: every file type on the demo model and the Llama, Mistral, Qwen2,
//! Qwen3, Qwen3-MoE (per-expert and fused) and Mixtral families, each file read back by kiln
//! and checked by llama.cpp's gguf-py (`tests/gguf/check_export.py`: names, Q/K row order,
//! llama-quantize's type mix, bytes equal to gguf-py's quantizers where it has them, decoded
//! values, metadata). CI sets `KILN_REQUIRE_GGUF_PY=1` so the gguf-py half cannot skip.

use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::export::recipe::Format;
use kiln_runtime::export::recipe::{KvCache, Recipe};
use kiln_runtime::export::run::OutputFormat;
use kiln_runtime::export::run::{ExportOptions, run};
use kiln_runtime::formats::gguf::container::GgufFile;
use std::path::Path;

use crate::common;
use common::family;

fn export(model: &Path, out: &Path, format: &str) -> kiln_runtime::export::run::ExportSummary {
    common::export("gguf", model, out, format)
}

/// kiln reads its own file back, then gguf-py checks it against the input.
fn check(model: &Path, file: &Path, format: &str) {
    let g = GgufFile::open(file).unwrap_or_else(|e| panic!("{e}"));
    assert!(!g.tensors.is_empty());
    for t in &g.tensors {
        g.read(t).unwrap_or_else(|e| panic!("{}: {e}", t.name));
    }
    let install = "pip install gguf==0.19.0";
    if common::python_has("python3", "gguf", "KILN_REQUIRE_GGUF_PY", install) {
        common::run_check(
            "python3",
            "tests/gguf/check_export.py",
            &[model.as_os_str(), file.as_os_str(), format.as_ref()],
            &format!("{} {format}", model.display()),
        );
    }
}

const ALL: [&str; 12] = [
    "q4-k-m",
    "q5-k-m",
    "q6-k",
    "q8-0",
    "q4-0",
    "q4-1",
    "q5-0",
    "q5-1",
    "mxfp4-moe",
    "f16",
    "bf16",
    "f32",
];

#[test]
fn every_file_type_on_the_demo_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    write_demo_model(&model, DemoConfig::default()).unwrap();
    for format in ALL {
        let out = tmp.path().join(format);
        let s = export(&model, &out, format);
        assert_eq!(s.files, ["model.gguf"]);
        check(&model, &out.join("model.gguf"), format);
    }
}

#[test]
fn q4_k_m_mix_on_the_demo_model() {
    // 4 layers: use_more_bits picks layers 2 and 3 for attn_v and ffn_down; output is Q6_K.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    write_demo_model(&model, DemoConfig::default()).unwrap();
    let s = export(&model, &tmp.path().join("out"), "q4-k-m");
    let six: Vec<&str> = s
        .quantized
        .iter()
        .filter(|(_, t)| *t == "Q6_K")
        .map(|(m, _)| m.as_str())
        .collect();
    assert_eq!(
        six,
        [
            "lm_head",
            "model.layers.2.mlp.down_proj",
            "model.layers.2.self_attn.v_proj",
            "model.layers.3.mlp.down_proj",
            "model.layers.3.self_attn.v_proj",
        ]
    );
    assert_eq!(s.quantized["model.embed_tokens"], "Q4_K");
    assert_eq!(s.quantized.len(), 30);
    assert!(s.excluded.is_empty(), "{:?}", s.excluded);
}

#[test]
fn every_family() {
    let tmp = tempfile::tempdir().unwrap();
    for name in [
        "llama-tiny",
        "llama-tied-tiny",
        "mistral-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
        "qwen3-moe-tiny",
        "qwen3-moe-fused-tiny",
        "mixtral-tiny",
        "llama3-rope-tiny",
    ] {
        let model = family(name, tmp.path());
        for format in ["q8-0", "q4-k-m", "mxfp4-moe", "bf16"] {
            let out = tmp.path().join(format!("{name}-{format}"));
            export(&model, &out, format);
            check(&model, &out.join("model.gguf"), format);
            read_back(&model, &out, format, name != "qwen3-moe-fused-tiny");
        }
    }
}

/// `kiln verify` and `kiln eval`'s loader read the GGUF file back: the config rebuilt from its
/// metadata, every tensor under its Hugging Face name (Q/K rows restored, experts unstacked).
/// From the lossless BF16 file the model gives the original's logits exactly — every name,
/// row order and config field came back; `logits`: the reference itself runs in kiln (the
/// fused-expert transformers 5 checkpoint does not).
fn read_back(model: &Path, out: &Path, format: &str, logits: bool) {
    use kiln_runtime::model::DecoderModel;
    use kiln_runtime::model::candle::{DType, Device, Tensor};
    let report = kiln_runtime::formats::verify(model, out).unwrap();
    assert!(
        report.problems.is_empty(),
        "{}: {:?}",
        out.display(),
        report.problems
    );
    if format == "bf16" {
        assert!(report.weight_errors.is_empty());
    } else {
        assert!(!report.weight_errors.is_empty());
        for (m, e) in &report.weight_errors {
            assert!(
                *e < 0.3,
                "{} {format}: `{m}` decodes {e:.3} away",
                out.display()
            );
        }
    }
    if !(logits && format == "bf16") {
        return;
    }
    let ids: Vec<u32> = (0..16).map(|i| (i * 37 + 11) % 256).collect();
    let x = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let run = |m: DecoderModel| -> Vec<f32> {
        m.forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let c = kiln_runtime::checkpoint::Checkpoint::open(model).unwrap();
    let want = run(DecoderModel::load(&c, DType::F32, &Device::Cpu).unwrap());
    let gguf = out.join("model.gguf");
    let got =
        run(kiln_runtime::formats::load_model(&gguf, DType::F32, &Device::Cpu, true).unwrap());
    if model.ends_with("llama3-rope-tiny") {
        // llama3 RoPE comes back as llama.cpp's per-frequency factors, whose f32 rounding is
        // not transformers' blend: equal to rounding.
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{}: max |Δ| {worst}", out.display());
    } else {
        assert_eq!(got, want, "{}", out.display());
    }
}

#[test]
fn the_bytes_do_not_depend_on_the_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let model = family("qwen3-moe-tiny", tmp.path());
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| export(&model, &tmp.path().join("one"), "q4-k-m"));
    let many = export(&model, &tmp.path().join("many"), "q4-k-m");
    let read = |p: &Path| std::fs::read(p.join("model.gguf")).unwrap();
    assert_eq!(read(&one.out), read(&many.out));
}

fn error(model: &Path, out: &Path, writer: &str, format: &str, recipe: Recipe) -> String {
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: writer.into(),
            format: format.into(),
        }),
        ..ExportOptions::new(model, out, recipe)
    };
    let e = run(&options).expect_err("the export must fail").to_string();
    assert!(!out.exists(), "{e}: a failed export left {}", out.display());
    e
}

#[test]
fn what_gguf_cannot_express_is_a_named_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let llama = family("llama-tiny", tmp.path());
    let e = error(&llama, &out, "gguf", "iq1-s", Recipe::new(Format::Nvfp4));
    assert!(
        e.starts_with("the gguf writer has no format `iq1-s` (it writes: q4-k-m, q5-k-m, q6-k,"),
        "{e}"
    );
    let e = error(&llama, &out, "onnx", "int8", Recipe::new(Format::Nvfp4));
    assert!(
        e.starts_with("unknown output format `onnx` (this build writes: "),
        "{e}"
    );
    assert!(e.contains("gguf") && e.contains("modelopt"), "{e}");
    let kv = Recipe {
        kv_cache: Some(KvCache::Fp8),
        ..Recipe::new(Format::Nvfp4)
    };
    let e = error(&llama, &out, "gguf", "q8-0", kv);
    assert!(e.contains("cannot express --kv-cache"), "{e}");
    let gpt_oss = family("gpt-oss-tiny", tmp.path());
    let e = error(&gpt_oss, &out, "gguf", "q8-0", Recipe::new(Format::Nvfp4));
    assert!(
        e.starts_with("the gguf writer cannot express the `GptOssForCausalLM` architecture (it writes: LlamaForCausalLM,"),
        "{e}"
    );
    // A model without a tokenizer: the file would not load in llama.cpp.
    std::fs::remove_file(llama.join("tokenizer.json")).unwrap();
    let e = error(&llama, &out, "gguf", "q8-0", Recipe::new(Format::Nvfp4));
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn excluded_modules_keep_their_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let model = family("llama-tiny", tmp.path());
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: "gguf".into(),
            format: "q8-0".into(),
        }),
        ..ExportOptions::new(
            &model,
            tmp.path().join("out"),
            Recipe {
                exclude: vec!["model.layers.0.*".into()],
                ..Recipe::new(Format::Nvfp4)
            },
        )
    };
    let s = run(&options).unwrap();
    let g = GgufFile::open(&s.out.join("model.gguf")).unwrap();
    let ty = |n: &str| g.tensor(n).unwrap().ggml_type;
    assert_eq!(ty("blk.0.attn_q.weight"), 30, "BF16, as the checkpoint");
    assert_eq!(ty("blk.1.attn_q.weight"), 8, "Q8_0");
    assert!(!s.quantized.contains_key("model.layers.0.self_attn.q_proj"));
    // The report states what the writer left unquantized.
    assert_eq!(s.excluded, ["model.layers.0*"]);
}

#[test]
fn a_sentencepiece_vocabulary_is_written_as_the_converter_writes_it() {
    // A Llama with only a SentencePiece tokenizer.model (tests/gguf/sentencepiece, made by
    // scripts/gguf/sentencepiece_fixture.py): `llama` tokens with scores and piece types,
    // tokenizer_config.json's added tokens, `add_space_prefix`, special ids from config.json.
    use kiln_runtime::formats::gguf::container::Value;
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("llama-sp");
    std::fs::create_dir_all(&model).unwrap();
    for dir in ["tests/compat/llama-tiny/model", "tests/gguf/sentencepiece"] {
        for f in std::fs::read_dir(common::root().join(dir)).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
        }
    }
    let out = tmp.path().join("q8-0");
    export(&model, &out, "q8-0");
    let file = out.join("model.gguf");
    let g = GgufFile::open(&file).unwrap();
    let md = |k: &str| g.metadata.get(k).unwrap_or_else(|| panic!("{k} missing"));
    assert_eq!(md("tokenizer.ggml.model").as_str(), Some("llama"));
    assert_eq!(md("tokenizer.ggml.pre").as_str(), Some("default"));
    assert!(!g.metadata.contains_key("tokenizer.ggml.merges"));
    let Value::Array(tokens) = md("tokenizer.ggml.tokens") else {
        panic!("tokens")
    };
    let Value::Array(types) = md("tokenizer.ggml.token_type") else {
        panic!("types")
    };
    assert_eq!(tokens.len(), 256);
    let token = |i: usize| tokens[i].as_str().unwrap().to_string();
    let kind = |i: usize| match types[i] {
        Value::I32(t) => t,
        ref v => panic!("{v:?}"),
    };
    // unknown, control (bos), control (added, special), user-defined with `▁` as a space, padding
    assert_eq!((token(0), kind(0)), ("<unk>".into(), 2));
    assert_eq!((token(1), kind(1)), ("<s>".into(), 3));
    assert_eq!((token(230), kind(230)), ("<|im_end|>".into(), 3));
    assert_eq!((token(231), kind(231)), (" kiln".into(), 4));
    assert_eq!((token(255), kind(255)), ("[PAD255]".into(), 5));
    assert!(matches!(
        md("tokenizer.ggml.add_space_prefix"),
        Value::Bool(true)
    ));
    assert_eq!(md("tokenizer.ggml.bos_token_id").as_u64(), Some(1));
    assert_eq!(md("tokenizer.ggml.eos_token_id").as_u64(), Some(2));
    // gguf-py reads the file; the sentencepiece library's reading of the model gives the same
    // tokens, scores and types.
    check(&model, &file, "q8-0");
    // The file reads back and runs.
    let report = kiln_runtime::formats::verify(&model, &out).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// A GGUF metadata value as JSON (what gguf-py's `contents()` gives).
fn as_json(v: &kiln_runtime::formats::gguf::container::Value) -> serde_json::Value {
    use kiln_runtime::formats::gguf::container::Value;
    match v {
        Value::U8(x) => (*x).into(),
        Value::I8(x) => (*x).into(),
        Value::U16(x) => (*x).into(),
        Value::I16(x) => (*x).into(),
        Value::U32(x) => (*x).into(),
        Value::I32(x) => (*x).into(),
        Value::U64(x) => (*x).into(),
        Value::I64(x) => (*x).into(),
        Value::F32(x) => f64::from(*x).into(),
        Value::Bool(x) => (*x).into(),
        Value::String(s) => s.clone().into(),
        Value::Array(a) => a.iter().map(as_json).collect(),
        other => panic!("unexpected metadata value {other:?}"),
    }
}

#[test]
fn tokenizer_keys_are_the_converters() {
    // tests/gguf/converter_tokenizer.json holds what llama.cpp's convert_hf_to_gguf.py wrote
    // for three tokenizers, one per vocabulary path (scripts/gguf/converter_tokenizer_keys.py):
    // the demo's byte-level BPE, a SentencePiece tokenizer.model, and a byte-fallback BPE
    // tokenizer.json without tokenizer.model (`LlamaHfVocab`). kiln writes the same keys and
    // values, with two differences it means: an empty merge list for a vocabulary without
    // merges (llama.cpp refuses a BPE file without the key; the converter omits it), and the
    // token lists padded with unused `[PADi]` up to config.json's vocab_size (the converter's
    // `LlamaHfVocab` stops at the tokenizer's size, and llama.cpp then refuses the file).
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/gguf/converter_tokenizer.json"))
            .unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for (case, fixture) in [
        ("bpe", None),
        ("sentencepiece", Some("tests/gguf/sentencepiece")),
        ("llama-hf", Some("tests/gguf/llama-hf")),
    ] {
        let model = tmp.path().join(case);
        match fixture {
            None => {
                std::fs::create_dir_all(&model).unwrap();
                write_demo_model(&model, DemoConfig::default()).unwrap();
            }
            Some(dir) => {
                std::fs::create_dir_all(&model).unwrap();
                for d in ["tests/compat/llama-tiny/model", dir] {
                    for f in std::fs::read_dir(common::root().join(d)).unwrap() {
                        let f = f.unwrap().path();
                        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
                    }
                }
            }
        }
        let out = tmp.path().join(format!("{case}-out"));
        export(&model, &out, "f32");
        let g = GgufFile::open(&out.join("model.gguf")).unwrap();
        let ours: std::collections::BTreeMap<&str, serde_json::Value> = g
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.as_str(), as_json(v)))
            .collect();
        let theirs = want["cases"][case].as_array().unwrap();
        let mut expected_keys: Vec<&str> =
            theirs.iter().map(|kv| kv[0].as_str().unwrap()).collect();
        for kv in theirs {
            let key = kv[0].as_str().unwrap();
            let got = ours
                .get(key)
                .unwrap_or_else(|| panic!("{case}: kiln wrote no `{key}`"));
            match (got, &kv[1]) {
                (serde_json::Value::Array(a), serde_json::Value::Array(b)) if a.len() > b.len() => {
                    assert_eq!(&a[..b.len()], &b[..], "{case}: `{key}`");
                    // The padding: unused `[PADi]` tokens, scores -1000, type UNUSED (5).
                    for (i, v) in a.iter().enumerate().skip(b.len()) {
                        let pad = match key {
                            "tokenizer.ggml.tokens" => serde_json::json!(format!("[PAD{i}]")),
                            "tokenizer.ggml.scores" => serde_json::json!(-1000.0),
                            _ => serde_json::json!(5),
                        };
                        assert_eq!(v, &pad, "{case}: `{key}`[{i}]");
                    }
                }
                (got, want) => assert_eq!(got, want, "{case}: `{key}`"),
            }
        }
        if case == "bpe" {
            assert_eq!(ours["tokenizer.ggml.merges"], serde_json::json!([]));
            expected_keys.push("tokenizer.ggml.merges");
        }
        let mut ours_keys: Vec<&str> = ours.keys().copied().collect();
        ours_keys.sort();
        expected_keys.sort();
        assert_eq!(ours_keys, expected_keys, "{case}: the tokenizer keys");
    }
}
