//! `--output-format compressed-tensors` against llm-compressor 0.14.0.1 / compressed-tensors
//! 0.19.0 (round to nearest, on the CPU): kiln's export of each committed tiny model, in each
//! scheme llm-compressor exported it (`tests/compat/<model>/ct-<scheme>/`, made by
//! `tests/compat/llmcompressor_ref.py`), is the same checkpoint — every tensor's name, dtype,
//! shape and bytes, and `config.json` — given the activation statistics llm-compressor's
//! observers saw. Then `kiln verify` accepts each, transformers + compressed-tensors (their
//! consumer on the CPU, `tests/compressed_tensors/check_export.py`) loads them with logits
//! equal to kiln's decoded model's, and what the format cannot express is a named error.
//!
//! The transformers half needs `torch`, `transformers` and `compressed-tensors==0.19.0` in the
//! Python `KILN_CT_PYTHON` names (default `python3`); CI sets `KILN_REQUIRE_CT=1` so it cannot
//! skip.

use crate::common;

use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::export::act_amax::ActAmax;
use kiln_runtime::export::recipe::{Format, KvCache, Recipe};
use kiln_runtime::export::run::{ExportOptions, ExportSummary, OutputFormat, run};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One committed llm-compressor export: the model, kiln's `--format`, `--kv-cache fp8`,
/// `--group-size` (a `-g<N>` suffix: `ct-w4a16-g64`).
struct Case {
    model: String,
    dir: PathBuf,
    format: String,
    kv: bool,
    group: Option<usize>,
}

fn cases() -> Vec<Case> {
    let compat = common::root().join("tests/compat");
    let mut out = Vec::new();
    for model in std::fs::read_dir(&compat).unwrap() {
        let model = model.unwrap().path();
        let Ok(entries) = std::fs::read_dir(&model) else {
            continue;
        };
        for e in entries {
            let dir = e.unwrap().path();
            let name = dir.file_name().unwrap().to_string_lossy().to_string();
            // ct-calib-*: the self-calibration references (`self_calibrated_*` below).
            let Some(scheme) = name
                .strip_prefix("ct-")
                .filter(|s| !s.starts_with("calib-"))
            else {
                continue;
            };
            let (format, kv) = match scheme.strip_suffix("+kv-fp8") {
                Some(f) => (f.to_string(), true),
                None => (scheme.to_string(), false),
            };
            let (format, group) = match format.rsplit_once("-g") {
                Some((f, g)) if g.parse::<usize>().is_ok() => (f.to_string(), g.parse().ok()),
                _ => (format, None),
            };
            out.push(Case {
                model: model.file_name().unwrap().to_string_lossy().to_string(),
                dir,
                format,
                kv,
                group,
            });
        }
    }
    out.sort_by(|a, b| (&a.model, &a.dir).cmp(&(&b.model, &b.dir)));
    out
}

fn options(model: &Path, out: &Path, format: &str) -> ExportOptions {
    ExportOptions {
        output: Some(OutputFormat {
            writer: "compressed-tensors".into(),
            format: format.into(),
        }),
        force: true,
        ..ExportOptions::new(model, out, Recipe::new(Format::Fp8))
    }
}

fn export_case(case: &Case, out: &Path) -> ExportSummary {
    let model = common::root()
        .join("tests/compat")
        .join(&case.model)
        .join("model");
    let mut o = options(&model, out, &case.format);
    let amax = case.dir.join("amax.json");
    if amax.is_file() {
        o.act_amax = Some(ActAmax::read(&amax).unwrap());
    }
    if case.kv {
        o.recipe.kv_cache = Some(KvCache::Fp8);
    }
    o.recipe.group_size = case.group;
    run(&o).unwrap_or_else(|e| panic!("{}: {}: {e}", case.model, case.format))
}

/// Every difference between two checkpoints, tensor by tensor.
fn differences(ours: &Path, theirs: &Path) -> Vec<String> {
    let (a, b) = (
        Checkpoint::open(ours).unwrap(),
        Checkpoint::open(theirs).unwrap(),
    );
    let mut out = Vec::new();
    for t in b.tensors() {
        match a.tensor(&t.name) {
            None => out.push(format!("`{}` missing", t.name)),
            Some(m) if (m.dtype, &m.shape) != (t.dtype, &t.shape) => out.push(format!(
                "`{}`: {:?} {:?}, llm-compressor {:?} {:?}",
                t.name, m.dtype, m.shape, t.dtype, t.shape
            )),
            Some(_) => {
                let (mut x, mut y) = (Vec::new(), Vec::new());
                a.read(&t.name, &mut x).unwrap();
                b.read(&t.name, &mut y).unwrap();
                let n = x.iter().zip(&y).filter(|(p, q)| p != q).count();
                if n > 0 {
                    out.push(format!("`{}`: {n} of {} bytes differ", t.name, y.len()));
                }
            }
        }
    }
    for t in a.tensors() {
        if b.tensor(&t.name).is_none() {
            out.push(format!("`{}` is extra", t.name));
        }
    }
    let config = |d: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
    };
    let (x, y) = (config(ours), config(theirs));
    if x != y {
        out.push(format!(
            "config.json differs:\n  kiln {}\n  llm-compressor {}",
            x["quantization_config"], y["quantization_config"]
        ));
    }
    out
}

#[test]
fn every_scheme_matches_llm_compressor_bit_for_bit() {
    let cases = cases();
    // 14 on llama-tiny (8 schemes, FP8 with an FP8 KV cache, W8A16 and four group sizes), 5 on
    // qwen3-moe-tiny.
    assert!(cases.len() >= 19, "{} committed references", cases.len());
    let tmp = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    for case in &cases {
        let out = tmp.path().join(format!(
            "{}-{}",
            case.model,
            case.dir.file_name().unwrap().to_string_lossy()
        ));
        let s = export_case(case, &out);
        assert!(s.quantized_modules > 0);
        for d in differences(&out, &case.dir.join("llmcompressor")) {
            failed.push(format!("{} {}: {d}", case.model, case.dir.display()));
        }
        let model = common::root()
            .join("tests/compat")
            .join(&case.model)
            .join("model");
        let report = kiln_runtime::formats::verify(&model, &out).unwrap();
        for p in report.problems {
            failed.push(format!("{} {}: kiln verify: {p}", case.model, case.format));
        }
        assert_eq!(report.weight_errors.len(), s.quantized_modules);
        for (m, e) in report.weight_errors {
            assert!(
                e < 0.2,
                "{} {}: `{m}` decodes {e:.3} away",
                case.model,
                case.format
            );
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn llm_compressors_own_exports_verify() {
    // kiln reads what llm-compressor wrote, not just what kiln writes.
    for case in cases() {
        let model = common::root()
            .join("tests/compat")
            .join(&case.model)
            .join("model");
        let report =
            kiln_runtime::formats::verify(&model, &case.dir.join("llmcompressor")).unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        assert!(!report.weight_errors.is_empty());
    }
}

fn python() -> String {
    std::env::var("KILN_CT_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn transformers_loads_kiln_exports_with_kiln_logits() {
    use kiln_runtime::model::candle::{DType, Device, Tensor};
    let install = "pip install torch transformers compressed-tensors==0.19.0";
    if !common::python_has(&python(), "compressed_tensors", "KILN_REQUIRE_CT", install) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 256).collect();
    let mut json = Vec::new();
    // Dense models: transformers 5.17 mis-loads MoE experts stored per expert in NVFP4 and
    // INT8 (llm-compressor's own exports included), so the MoE cases are checked against
    // llm-compressor's bytes above, not here.
    for case in cases().into_iter().filter(|c| c.model == "llama-tiny") {
        let out = tmp.path().join(format!(
            "{}-{}",
            case.model,
            case.dir.file_name().unwrap().to_string_lossy()
        ));
        export_case(&case, &out);
        let c = Checkpoint::open(&out).unwrap();
        let x = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = |act: bool| -> Vec<Vec<f32>> {
            let m =
                kiln_runtime::formats::load_model(c.dir(), DType::F32, &Device::Cpu, act).unwrap();
            m.forward(&x)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec2()
                .unwrap()
        };
        json.push(serde_json::json!({
            "out": out, "ids": ids, "weights": logits(false), "run": logits(true)
        }));
    }
    let cases = tmp.path().join("cases.json");
    std::fs::write(&cases, serde_json::to_string(&json).unwrap()).unwrap();
    common::run_check(
        &python(),
        "tests/compressed_tensors/check_export.py",
        &[cases.as_os_str()],
        "transformers + compressed-tensors",
    );
}

fn refused(o: &ExportOptions) -> String {
    match run(o) {
        Ok(_) => panic!("{o:?} was written"),
        Err(e) => {
            assert!(!o.out.exists(), "a refused export left {}", o.out.display());
            e.to_string()
        }
    }
}

#[test]
fn what_the_format_cannot_express_is_a_named_error() {
    let tmp = tempfile::tempdir().unwrap();
    let compat = common::root().join("tests/compat");
    let moe = compat.join("qwen3-moe-tiny/model");
    let llama = compat.join("llama-tiny/model");
    let out = tmp.path().join("out");
    // Groups of 128 on 64 input features.
    let e = refused(&options(&moe, &out, "w4a16"));
    assert!(
        e.contains("input features are not whole groups of 128") && e.contains("--exclude"),
        "{e}"
    );
    // A static input scale without statistics names the missing quantizer.
    let e = refused(&options(&llama, &out, "fp8"));
    assert!(
        e.contains("model.layers.0.") && e.contains(".input_quantizer"),
        "{e}"
    );
    // Statistics a scheme does not store are refused, not ignored.
    let mut o = options(&llama, &out, "fp8-dynamic");
    o.act_amax = Some(ActAmax::read(&compat.join("llama-tiny/ct-fp8/amax.json")).unwrap());
    let e = refused(&o);
    assert!(
        e.contains("activation statistics") && e.contains("fp8-dynamic"),
        "{e}"
    );
    // An NVFP4 KV cache.
    let mut o = options(&llama, &out, "fp8");
    o.act_amax = Some(ActAmax::read(&compat.join("llama-tiny/ct-fp8+kv-fp8/amax.json")).unwrap());
    o.recipe.kv_cache = Some(KvCache::Nvfp4);
    let e = refused(&o);
    assert!(
        e.contains("--kv-cache nvfp4") && e.contains("--kv-cache fp8"),
        "{e}"
    );
    // An FP8 KV cache without k/v statistics.
    let mut o = options(&llama, &out, "fp8");
    o.act_amax = Some(ActAmax::read(&compat.join("llama-tiny/ct-fp8/amax.json")).unwrap());
    o.recipe.kv_cache = Some(KvCache::Fp8);
    let e = refused(&o);
    assert!(
        e.contains("model.layers.0.self_attn.k_bmm_quantizer"),
        "{e}"
    );
    // An unknown scheme lists the known ones.
    let e = refused(&options(&llama, &out, "int3"));
    assert!(e.contains("int3"), "{e}");
    // Groups of 16 fit the MoE model.
    run(&options(&moe, &out, "nvfp4a16")).unwrap();
}

#[test]
fn fused_experts_are_written_per_expert() {
    // transformers 5's fused experts (gate_up_proj [E, 2I, H]): per-expert Linears, as vLLM and
    // llm-compressor name them.
    let tmp = tempfile::tempdir().unwrap();
    let model = common::root().join("tests/compat/qwen3-moe-fused-tiny/model");
    let out = tmp.path().join("fp8");
    let s = run(&options(&model, &out, "fp8-dynamic")).unwrap();
    let c = Checkpoint::open(&out).unwrap();
    assert!(
        c.tensor("model.layers.0.mlp.experts.3.gate_proj.weight")
            .is_some()
    );
    assert!(
        c.tensor("model.layers.0.mlp.experts.3.up_proj.weight_scale")
            .is_some()
    );
    assert!(
        c.tensor("model.layers.0.mlp.experts.gate_up_proj")
            .is_none()
    );
    let report = kiln_runtime::formats::verify(&model, &out).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.weight_errors.len(), s.quantized_modules);
    // NVFP4: gate and up of each expert share one global scale, from the larger amax of the
    // two halves of the fused tensor: bf16(bf16(1 / amax) · 2688), as PyTorch evaluates
    // llm-compressor's `448 * 6 / amax`.
    let out = tmp.path().join("nvfp4");
    run(&options(&model, &out, "nvfp4a16")).unwrap();
    let (input, c) = (
        Checkpoint::open(&model).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    let bf = |x: f32| half::bf16::from_f32(x).to_f32();
    let fused = "model.layers.0.mlp.experts.gate_up_proj";
    let w: Vec<half::bf16> = input.read_as(fused).unwrap();
    let shape = input.tensor(fused).unwrap().shape.clone();
    let (rows, cols) = (shape[1], shape[2]);
    for e in 0..shape[0] {
        let block = &w[e * rows * cols..(e + 1) * rows * cols];
        let amax = block.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        let want = bf(bf(1.0 / amax) * 2688.0);
        for p in ["gate_proj", "up_proj"] {
            let g: Vec<f32> = c
                .read_as(&format!(
                    "model.layers.0.mlp.experts.{e}.{p}.weight_global_scale"
                ))
                .unwrap();
            assert_eq!(g, [want], "expert {e} {p}");
        }
    }
}

/// kiln's own `--calib` for compressed-tensors against llm-compressor 0.14 calibrating on the
/// same 8 × 32 token ids, each row its own batch of one (`tests/compat/<model>/ct-calib-*`,
/// made by `llmcompressor_ref.py --self-calibrated`): every activation observer's amax within
/// 1 % — dense Llama, tied Llama, and Qwen3-MoE, whose experts llm-compressor runs on every
/// token, each with its own statistics (ModelOpt's rule, the experts sharing the maximum of
/// their routed tokens, stays with the ModelOpt writer) — and the export itself: the same
/// `config.json`, the same weights byte for byte, each stored input / KV scale within 2 of
/// bfloat16's steps (the two runs' activations differ in the last bits: llm-compressor's
/// forward runs in bf16).
#[test]
fn self_calibrated_scales_match_llm_compressor() {
    use kiln_runtime::calibrate::{Calibration, CalibrationOptions};
    use kiln_runtime::export::writer::StatisticsRules;
    let compat = common::root().join("tests/compat");
    let mut checked = 0;
    let mut past_one_percent = 0;
    let mut failed = Vec::new();
    let tmp = tempfile::tempdir().unwrap();
    for model in ["llama-tiny", "llama-tied-tiny", "qwen3-moe-tiny"] {
        let dir = compat.join(model);
        let mut refs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("ct-calib-")
            })
            .collect();
        refs.sort();
        assert!(!refs.is_empty(), "{model}: no ct-calib-* references");
        for r in refs {
            let name = r.file_name().unwrap().to_string_lossy().to_string();
            let scheme = name.strip_prefix("ct-calib-").unwrap();
            let (format, kv) = match scheme.strip_suffix("+kv-fp8") {
                Some(f) => (f, true),
                None => (scheme, false),
            };
            let mut recipe = Recipe::new(Format::Fp8);
            if kv {
                recipe.kv_cache = Some(KvCache::Fp8);
            }
            let calib = CalibrationOptions {
                rules: StatisticsRules::LLM_COMPRESSOR,
                ..CalibrationOptions::new(dir.join("calib-8x32.jsonl"))
            };
            let calibration = Calibration::prepare(&dir.join("model"), &recipe, calib).unwrap();
            assert_eq!(calibration.samples().len(), 8);
            let (act, _) = calibration.run(|_, _| {}).unwrap();
            let want: serde_json::Map<String, Value> =
                serde_json::from_str(&std::fs::read_to_string(r.join("amax.json")).unwrap())
                    .unwrap();
            for (q, v) in &want {
                let v = v.as_f64().unwrap();
                // llm-compressor's observers hold bf16 values of a bf16 forward: 1 %, or two
                // bf16 steps of the value where those are wider (a step is 2⁻⁷ of the power of
                // two below it, 0.4–0.8 %).
                let step = 2f64.powi(v.abs().log2().floor() as i32 - 7);
                match act.quantizer(q) {
                    None => failed.push(format!("{model} {scheme}: kiln has no `{q}`")),
                    Some(g) if (f64::from(g) - v).abs() > (0.01 * v.abs()).max(2.0 * step) => {
                        failed.push(format!(
                            "{model} {scheme}: `{q}` kiln {g} vs llm-compressor {v} ({:+.2} %)",
                            100.0 * (f64::from(g) - v) / v
                        ))
                    }
                    Some(g) => {
                        checked += 1;
                        if (f64::from(g) - v).abs() > 0.01 * v.abs() {
                            past_one_percent += 1;
                        }
                    }
                }
            }
            // The export from kiln's own statistics.
            let out = tmp.path().join(format!("{model}-{scheme}"));
            let mut o = options(&dir.join("model"), &out, format);
            o.act_amax = Some(act);
            o.recipe.kv_cache = recipe.kv_cache;
            run(&o).unwrap_or_else(|e| panic!("{model} {scheme}: {e}"));
            for d in differences(&out, &r.join("llmcompressor")) {
                // Input and KV scales are compared within bf16 steps below.
                let scale = ["input_scale", "input_global_scale", "k_scale", "v_scale"]
                    .iter()
                    .any(|s| d.contains(&format!("{s}`")));
                if !scale {
                    failed.push(format!("{model} {scheme}: {d}"));
                }
            }
            let (a, b) = (
                Checkpoint::open(&out).unwrap(),
                Checkpoint::open(r.join("llmcompressor")).unwrap(),
            );
            for t in b.tensors() {
                let n = &t.name;
                if !["input_scale", "input_global_scale", "k_scale", "v_scale"]
                    .iter()
                    .any(|s| n.ends_with(s))
                {
                    continue;
                }
                let values = |c: &Checkpoint| -> Vec<f32> {
                    let mut bytes = Vec::new();
                    c.read(n, &mut bytes).unwrap();
                    match t.dtype {
                        kiln_runtime::checkpoint::Dtype::BF16 => bytes
                            .chunks(2)
                            .map(|h| half::bf16::from_le_bytes([h[0], h[1]]).to_f32())
                            .collect(),
                        kiln_runtime::checkpoint::Dtype::F32 => bytes
                            .chunks(4)
                            .map(|h| f32::from_le_bytes([h[0], h[1], h[2], h[3]]))
                            .collect(),
                        other => panic!("{n}: {other:?}"),
                    }
                };
                for (g, w) in values(&a).into_iter().zip(values(&b)) {
                    // Two steps of bf16's 8-bit significand.
                    if (g - w).abs() > 2.0 * w.abs() / 128.0 {
                        failed.push(format!("{model} {scheme}: `{n}` kiln {g} vs {w}"));
                    }
                }
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    println!("{checked} statistics within tolerance, {past_one_percent} of them past 1 %");
    assert!(checked > 100, "{checked} statistics compared");
    assert!(
        past_one_percent <= 2,
        "{past_one_percent} statistics past 1 %"
    );
}
