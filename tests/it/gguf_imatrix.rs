//! The importance matrix and GGUF's low-bit types against llama.cpp itself
//! (`tests/gguf/imatrix/`, made by `scripts/gguf/imatrix_ref.py` with llama.cpp's
//! `llama-imatrix` and `llama-quantize` built from llama-cpp-python 0.3.36's sources):
//!
//! - every file type kiln writes, on the demo model (every width whole 256-blocks), without
//!   and with `--imatrix` (GGUF and legacy `.dat`): each tensor's type and bytes equal to
//!   `llama-quantize`'s output (SHA-256), and then the whole file;
//! - `kiln imatrix` on the same text equals `llama-imatrix`'s sums to float rounding.

use crate::common;
use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::export::recipe::{Format, Recipe};
use kiln_runtime::export::run::{ExportOptions, OutputFormat, run};
use kiln_runtime::export::writer::Importance;
use kiln_runtime::formats::gguf::container::GgufFile;
use kiln_runtime::formats::gguf::imatrix::{Collector, Imatrix};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn refs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf/imatrix")
}

/// The importance matrix at `path`, named by its file name alone, as the references gave it to
/// llama-quantize (which records the name in `quantize.imatrix.file`).
fn importance(path: &Path) -> Arc<Importance> {
    let m = Imatrix::read(path).unwrap_or_else(|e| panic!("{e}"));
    Arc::new(Importance {
        source: PathBuf::from(path.file_name().unwrap()),
        weights: m
            .entries
            .keys()
            .map(|n| (n.clone(), m.weights(n).unwrap()))
            .collect(),
        datasets: m.datasets.clone(),
        chunks: m.chunk_count,
    })
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `{tensor: [ggml type, sha256]}` of a GGUF file.
fn tensors(file: &Path) -> BTreeMap<String, (String, String)> {
    let g = GgufFile::open(file).unwrap_or_else(|e| panic!("{e}"));
    g.tensors
        .iter()
        .map(|t| {
            let bytes = g.read(t).unwrap();
            let name = kiln_runtime::formats::gguf::type_name(t.ggml_type).to_string();
            (t.name.clone(), (name, sha256(&bytes)))
        })
        .collect()
}

/// Exports `model` to `dir/KEY` as the references name it: `FORMAT` or `FORMAT+LAYOUT` (with
/// llama-imatrix's `.gguf` or `.dat` file); the output folder.
fn export(model: &Path, dir: &Path, key: &str) -> PathBuf {
    let (format, layout) = match key.split_once('+') {
        Some((f, l)) => (f, Some(l)),
        None => (key, None),
    };
    let out = dir.join(key);
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: "gguf".into(),
            format: format.into(),
        }),
        force: true,
        importance: layout.map(|l| importance(&refs_dir().join(format!("llama-imatrix.{l}")))),
        ..ExportOptions::new(model, &out, Recipe::new(Format::Nvfp4))
    };
    run(&options).unwrap_or_else(|e| panic!("{key}: {e}"));
    out
}

fn demo(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    write_demo_model(&model, DemoConfig::default()).unwrap();
    model
}

#[test]
fn every_file_type_with_and_without_an_imatrix_equals_llama_quantize() {
    let refs: Value = serde_json::from_str(
        &std::fs::read_to_string(refs_dir().join("llama-quantize.json")).unwrap(),
    )
    .unwrap();
    let files = refs["files"].as_object().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let model = demo(tmp.path());
    let mut hashes: BTreeMap<String, BTreeMap<String, (String, String)>> = BTreeMap::new();
    for (key, want) in files {
        let layout = key.split_once('+').map(|(_, l)| l);
        let out = export(&model, tmp.path(), key);
        let got = tensors(&out.join("model.gguf"));
        let want = want.as_object().unwrap();
        let whole = sha256(&std::fs::read(out.join("model.gguf")).unwrap());
        assert_eq!(got.len(), want.len(), "{key}: tensor count");
        for (name, w) in want {
            let (ty, hash) = &got[name];
            assert_eq!(ty, w[0].as_str().unwrap(), "{key}: {name}'s type");
            assert_eq!(
                hash,
                w[1].as_str().unwrap(),
                "{key}: {name} ({ty}) differs from llama-quantize's bytes"
            );
        }
        // Then the whole file: the same keys in the same order, the tensors in llama's order.
        assert_eq!(
            Some(whole.as_str()),
            refs["file_sha256"][key].as_str(),
            "{key}: every tensor equals llama-quantize's, but the file differs (keys or order)"
        );
        if let Some(layout) = layout {
            // What llama-quantize records of the importance matrix.
            let g = GgufFile::open(&out.join("model.gguf")).unwrap();
            let md = |k: &str| g.metadata.get(k).cloned();
            let m = Imatrix::read(&refs_dir().join(format!("llama-imatrix.{layout}"))).unwrap();
            assert_eq!(
                md("quantize.imatrix.entries_count").and_then(|v| v.as_u64()),
                Some(m.entries.len() as u64),
                "{key}"
            );
            assert_eq!(
                md("quantize.imatrix.dataset").and_then(|v| v.as_str().map(String::from)),
                m.datasets.first().cloned(),
                "{key}"
            );
            assert!(md("quantize.imatrix.file").is_some(), "{key}");
        }
        hashes.insert(key.clone(), got);
    }
    // The importance matrix changes what it should: every type whose quantizer reads weights
    // writes other bytes for the layers' matrices (Q8_0 ignores them).
    for (key, with) in hashes.iter().filter(|(k, _)| k.ends_with("+gguf")) {
        let Some(plain) = hashes.get(key.trim_end_matches("+gguf")) else {
            continue; // made only with an importance matrix
        };
        let changed = with
            .iter()
            .filter(|(n, (_, h))| n.starts_with("blk.") && plain[*n].1 != *h)
            .count();
        if key.starts_with("q8-0") {
            assert_eq!(changed, 0, "{key}");
        } else {
            assert!(changed > 0, "{key}: the importance matrix changed nothing");
        }
    }
}

/// Runs `kiln imatrix` on the references' text (`ctx`, the first `chunks`, then `extra`
/// arguments) into `out`, and reads the file.
fn kiln_imatrix(model: &Path, out: &Path, ctx: usize, chunks: usize, extra: &[&str]) -> Imatrix {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("imatrix")
        .args(extra)
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(refs_dir().join("text.txt"))
        .arg("--out")
        .arg(out)
        .args(["--ctx", &ctx.to_string(), "--chunks", &chunks.to_string()])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}: {}",
        model.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    Imatrix::read(out).unwrap()
}

/// The library path: the whole model (f32, loaded at once) run over the first `n` chunks of
/// `ctx` tokens of the references' text, chunk by chunk, into a [`Collector`]; and its config.
fn whole_model_imatrix(
    model: &Path,
    ctx: usize,
    n: usize,
    process_output: bool,
) -> (Imatrix, kiln_runtime::model::DecoderConfig) {
    let text = std::fs::read_to_string(refs_dir().join("text.txt")).unwrap();
    let (ids, bos) =
        kiln_runtime::model::eval::tokenize_text(&model.join("tokenizer.json"), &text).unwrap();
    let device = kiln_runtime::model::candle::Device::Cpu;
    let m = kiln_runtime::model::DecoderModel::load(
        &kiln_runtime::checkpoint::Checkpoint::open(model).unwrap(),
        kiln_runtime::model::candle::DType::F32,
        &device,
    )
    .unwrap();
    let config = m.config().clone();
    let experts = config.moe.as_ref().map_or(0, |r| r.experts);
    let mut c = Collector::new(experts, process_output, config.tie_word_embeddings);
    for chunk in kiln_runtime::model::eval::chunks(&ids, ctx, bos)
        .into_iter()
        .take(n)
    {
        let ids = kiln_runtime::model::candle::Tensor::from_vec(chunk, (1, ctx), &device).unwrap();
        m.forward_observed(&ids, &mut c).unwrap();
    }
    (
        c.finish(vec!["text.txt".into()], n as u32, ctx as u32),
        config,
    )
}

#[test]
fn kiln_imatrix_equals_llama_imatrix_to_float_rounding() {
    let tmp = tempfile::tempdir().unwrap();
    let model = demo(tmp.path());
    let refs: Value = serde_json::from_str(
        &std::fs::read_to_string(refs_dir().join("llama-quantize.json")).unwrap(),
    )
    .unwrap();
    let (ctx, n) = (
        refs["ctx"].as_u64().unwrap() as usize,
        refs["chunks"].as_u64().unwrap() as usize,
    );
    // The library path: the observer over the chunks llama-imatrix processes.
    let ours = whole_model_imatrix(&model, ctx, n, false).0;
    let theirs = Imatrix::read(&refs_dir().join("llama-imatrix.gguf")).unwrap();
    assert_eq!(
        ours.entries.keys().collect::<Vec<_>>(),
        theirs.entries.keys().collect::<Vec<_>>()
    );
    assert_eq!(
        (ours.chunk_count, ours.chunk_size),
        (theirs.chunk_count, theirs.chunk_size)
    );
    let mut worst = 0f64;
    for (name, t) in &theirs.entries {
        let o = &ours.entries[name];
        assert_eq!(o.counts, t.counts, "{name}: tokens seen");
        for (a, b) in o.sums.iter().zip(&t.sums) {
            worst = worst.max(f64::from((a - b).abs() / b.abs().max(1e-30)));
        }
    }
    // Measured 6e-6: the same activations up to f32 summation order.
    assert!(worst < 1e-4, "largest relative difference {worst}");

    // The command writes the same sums, bit for bit, though it runs one decoder layer at a
    // time over every chunk (a checkpoint folder; the library path above ran the whole model
    // chunk by chunk); `--output-format dat` writes the legacy file.
    let out = tmp.path().join("kiln.gguf");
    let dat = tmp.path().join("kiln.dat");
    let cli = kiln_imatrix(&model, &out, ctx, n, &["--output-format", "gguf"]);
    let legacy = kiln_imatrix(&model, &dat, ctx, n, &["--output-format", "dat"]);
    assert_eq!(cli.entries, ours.entries);
    // The file's layout is llama-imatrix's: the same tensors, names, dimensions (a dense
    // matrix's sums 1-D, as ggml trims them) and the same metadata keys.
    let (a, b) = (
        GgufFile::open(&out).unwrap(),
        GgufFile::open(&refs_dir().join("llama-imatrix.gguf")).unwrap(),
    );
    let layout = |g: &GgufFile| {
        g.tensors
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
            .collect::<Vec<_>>()
    };
    assert_eq!(layout(&a), layout(&b));
    assert_eq!(
        a.metadata.keys().collect::<Vec<_>>(),
        b.metadata.keys().collect::<Vec<_>>()
    );
    // --process-output adds the output's entry (the demo's output is not tied), over every
    // token of the chunks.
    let with_output = tmp.path().join("out.gguf");
    let w = kiln_imatrix(&model, &with_output, ctx, 2, &["--process-output"]);
    assert_eq!(w.entries.len(), ours.entries.len() + 1);
    assert_eq!(w.entries["output.weight"].counts, vec![2 * ctx as i64]);
    assert!(legacy.legacy);
    for name in ours.entries.keys() {
        let (a, b) = (ours.weights(name).unwrap(), legacy.weights(name).unwrap());
        assert!(
            a.iter()
                .zip(&b)
                .all(|(x, y)| (x - y).abs() <= 1e-6 * x.abs())
        );
    }
}

/// `kiln imatrix` runs a checkpoint one decoder layer at a time; on MoE models (each expert's
/// inputs summed apart) and one with biases, its sums equal the whole model's run chunk by chunk
/// bit for bit, and every routed token is counted by the experts it went to.
#[test]
fn layer_by_layer_imatrix_equals_the_whole_models_with_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let (ctx, n) = (32usize, 3usize);
    for name in ["qwen3-moe-tiny", "mixtral-tiny", "qwen2-tiny"] {
        let model = common::family(name, tmp.path());
        let out = tmp.path().join(format!("{name}.gguf"));
        let cli = kiln_imatrix(&model, &out, ctx, n, &["--process-output"]);

        let (ours, config) = whole_model_imatrix(&model, ctx, n, true);
        let moe = config.moe.clone();
        assert_eq!(cli.entries, ours.entries, "{name}");
        // Every layer's matrices (and an MoE block's router, `ffn_gate_inp`) and the output.
        let layers = config.layers;
        let per_layer = if moe.is_some() { 8 } else { 7 };
        assert_eq!(cli.entries.len(), per_layer * layers + 1, "{name}");
        assert_eq!(
            cli.entries.contains_key("blk.0.ffn_gate_inp.weight"),
            moe.is_some(),
            "{name}"
        );
        assert_eq!(cli.entries["output.weight"].counts, vec![(n * ctx) as i64]);
        if let Some(m) = moe {
            let e = &cli.entries["blk.0.ffn_down_exps.weight"];
            assert_eq!(e.counts.len(), m.experts, "{name}: one count per expert");
            assert_eq!(
                e.counts.iter().sum::<i64>(),
                (n * ctx * m.top_k) as i64,
                "{name}: every token counted by each of its top-{} experts",
                m.top_k
            );
        } else {
            assert_eq!(
                cli.entries["blk.0.attn_q.weight"].counts,
                vec![(n * ctx) as i64]
            );
        }
    }
}

#[test]
fn imatrix_errors_name_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let model = demo(tmp.path());
    let kiln = |args: &[&std::ffi::OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .output()
            .unwrap()
    };
    // An imatrix for another model: sizes disagree, named by tensor.
    let mut other = Imatrix::read(&refs_dir().join("llama-imatrix.gguf")).unwrap();
    let e = other.entries.get_mut("blk.0.attn_q.weight").unwrap();
    e.sums.truncate(256);
    let bad = tmp.path().join("other.gguf");
    other.write_gguf(&bad).unwrap();
    let out = tmp.path().join("out");
    let o = kiln(&[
        "export".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--output-format".as_ref(),
        "gguf".as_ref(),
        "--format".as_ref(),
        "q4-k-m".as_ref(),
        "--imatrix".as_ref(),
        bad.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("blk.0.attn_q.weight") && err.contains("256 values"),
        "{err}"
    );
    assert!(!out.exists(), "no half-written output");
    // Another writer refuses the importance matrix by name.
    let o = kiln(&[
        "export".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--format".as_ref(),
        "fp8".as_ref(),
        "--imatrix".as_ref(),
        refs_dir().join("llama-imatrix.gguf").as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("--imatrix") && err.contains("gguf"), "{err}");
    // The i-quants that need an importance matrix are refused without one, before any work.
    let o = kiln(&[
        "export".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--output-format".as_ref(),
        "gguf".as_ref(),
        "--format".as_ref(),
        "iq2-xxs".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("IQ2_XXS") && err.contains("--imatrix"),
        "{err}"
    );
    assert!(!out.exists());
    // Text shorter than two chunks.
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "a few words").unwrap();
    let o = kiln(&[
        "imatrix".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--data".as_ref(),
        short.as_os_str(),
        "--out".as_ref(),
        tmp.path().join("x.gguf").as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("short.txt") && err.contains("two chunks"),
        "{err}"
    );
}

/// `kiln eval --ctx --kl-divergence` on GGUF files beside `llama-perplexity` on the same files
/// (`tests/gguf/imatrix/llama-perplexity.json`; kiln's files are llama-quantize's bytes, the
/// test above). On the F32 file the perplexity agrees to float rounding; on quantized files
/// llama.cpp rounds the activations to 8 bits inside its quantized dot products (Q8_K / Q8_0)
/// where kiln decodes the weights and multiplies in f32, which moves the figures a little:
/// measured 0.01–0.11 % in perplexity, 0.2–1 % in KL divergence, one token of 504 in the top-1
/// agreement.
#[test]
fn kiln_eval_matches_llama_perplexity_on_gguf_files() {
    let refs: Value = serde_json::from_str(
        &std::fs::read_to_string(refs_dir().join("llama-perplexity.json")).unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let model = demo(tmp.path());
    let export = |key: &str| export(&model, tmp.path(), key);
    let base = export("f32");
    let eval = |m: &Path, kl: bool| -> Value {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
        cmd.args(["eval", "--model"])
            .arg(m)
            .arg("--data")
            .arg(refs_dir().join("text.txt"))
            .args(["--ctx", &refs["ctx"].to_string()])
            .args(["--chunks", &refs["chunks"].to_string()])
            .arg("--tokenizer")
            .arg(model.join("tokenizer.json"))
            .arg("--json");
        if kl {
            cmd.arg("--kl-divergence").arg(&base);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    let f32_ppl = eval(&base, false)["perplexity"].as_f64().unwrap();
    let want = refs["f32"]["ppl"].as_f64().unwrap();
    assert!(
        rel(f32_ppl, want) < 1e-6,
        "F32 file: kiln {f32_ppl}, llama-perplexity {want}"
    );
    for key in ["q4-k-m+gguf", "iq3-s", "q2-k+gguf"] {
        let r = &refs[key];
        let got = eval(&export(key), true);
        let kl = &got["kl_divergence"];
        let ppl = got["perplexity"].as_f64().unwrap();
        assert!(
            rel(ppl, r["ppl"].as_f64().unwrap()) < 3e-3,
            "{key}: ppl {ppl} vs {r}"
        );
        for (ours, theirs) in [
            ("mean", "kl_mean"),
            ("median", "kl_median"),
            ("p99", "kl_p99"),
            ("max", "kl_max"),
        ] {
            let (a, b) = (kl[ours].as_f64().unwrap(), r[theirs].as_f64().unwrap());
            assert!(
                rel(a, b) < 0.03,
                "{key}: KL {ours} {a} vs llama-perplexity's {b}"
            );
        }
        let top = kl["same_top1"].as_f64().unwrap() * 100.0;
        let want = r["same_top"].as_f64().unwrap();
        assert!(
            (top - want).abs() <= 1.0,
            "{key}: same top token {top} % vs {want} %"
        );
    }
}
