//! Exports of the demo model, end to end, checked against docs/FORMATS.md's table and against
//! values recomputed here from the input bytes.

use super::act_amax::ActAmax;
use super::recipe::{Format, Recipe};
use super::run::{ExportOptions, run};
use crate::checkpoint::{Checkpoint, Dtype};
use crate::demo::{DemoConfig, write_demo_model};
use half::bf16;
use std::path::Path;

const SMALL: DemoConfig = DemoConfig {
    hidden: 64,
    intermediate: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    vocab: 96,
};

fn demo(dir: &Path) -> ActAmax {
    write_demo_model(dir, SMALL).unwrap()
}

fn options(model: &Path, out: &Path, format: Format, act: Option<ActAmax>) -> ExportOptions {
    ExportOptions {
        act_amax: act,
        max_shard_bytes: 1 << 30,
        ..ExportOptions::new(model, out, Recipe::new(format))
    }
}

fn meta(c: &Checkpoint, name: &str) -> (Dtype, Vec<usize>) {
    let t = c
        .tensor(name)
        .unwrap_or_else(|| panic!("output lacks `{name}`"));
    (t.dtype, t.shape.clone())
}

fn f32_scalar(c: &Checkpoint, name: &str) -> f32 {
    let v = c.read_as::<f32>(name).unwrap();
    assert_eq!(v.len(), 1, "{name} is a scalar");
    v[0]
}

fn input_amax(model: &Checkpoint, name: &str) -> f32 {
    model
        .read_as::<bf16>(name)
        .unwrap()
        .iter()
        .fold(0f32, |a, x| a.max(x.to_f32().abs()))
}

#[test]
fn nvfp4_writes_modelopt_tensors_with_shared_group_scales() {
    let root = tempfile::tempdir().unwrap();
    let (model, out) = (root.path().join("model"), root.path().join("out"));
    std::fs::create_dir(&model).unwrap();
    let act = demo(&model);
    let summary = run(&options(&model, &out, Format::Nvfp4, Some(act.clone()))).unwrap();
    assert_eq!(summary.architecture, "LlamaForCausalLM");
    assert!(!summary.generic_fallback);
    assert_eq!(
        summary.quantized_modules, 14,
        "7 Linears per layer; lm_head excluded"
    );
    assert_eq!(summary.excluded, ["lm_head", "model.embed_tokens"]);
    let e = summary.errors["nvfp4"];
    assert_eq!(
        (e.modules, e.count),
        (14, 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128))
    );
    // Weights ~ N(0, 0.02²): NVFP4 keeps ~1 bit per element, so errors are a sizeable fraction
    // of 0.02 but bounded by half a block step of the largest block (~0.1 · 0.5).
    assert!(
        e.mean_abs() > 1e-4 && e.mean_abs() < 5e-3 && e.max_abs < 0.05,
        "{e:?}"
    );

    let (input, output) = (
        Checkpoint::open(&model).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    let q = "model.layers.1.self_attn.q_proj";
    assert_eq!(
        meta(&output, &format!("{q}.weight")),
        (Dtype::U8, vec![64, 32])
    );
    assert_eq!(
        meta(&output, &format!("{q}.weight_scale")),
        (Dtype::F8_E4M3, vec![64, 4])
    );
    assert_eq!(
        meta(&output, &format!("{q}.weight_scale_2")),
        (Dtype::F32, vec![])
    );
    assert_eq!(
        meta(&output, &format!("{q}.input_scale")),
        (Dtype::F32, vec![])
    );
    // q/k/v share weight_scale_2 (max of their amax / 2688) and input_scale (max / 2688).
    let p = "model.layers.1.self_attn";
    let group_amax = ["q_proj", "k_proj", "v_proj"]
        .map(|n| input_amax(&input, &format!("{p}.{n}.weight")))
        .into_iter()
        .fold(0f32, f32::max);
    let act_max = ["q_proj", "k_proj", "v_proj"]
        .map(|n| act.input(&format!("{p}.{n}")).unwrap())
        .into_iter()
        .fold(0f32, f32::max);
    for n in ["q_proj", "k_proj", "v_proj"] {
        assert_eq!(
            f32_scalar(&output, &format!("{p}.{n}.weight_scale_2")),
            group_amax / 2688.0,
            "{n}"
        );
        assert_eq!(
            f32_scalar(&output, &format!("{p}.{n}.input_scale")),
            act_max / 2688.0,
            "{n}"
        );
    }
    // o_proj is alone: its own amax.
    let o = format!("{p}.o_proj");
    assert_eq!(
        f32_scalar(&output, &format!("{o}.weight_scale_2")),
        input_amax(&input, &format!("{o}.weight")) / 2688.0
    );
    // gate/up share; down does not.
    let m = "model.layers.0.mlp";
    assert_eq!(
        f32_scalar(&output, &format!("{m}.gate_proj.weight_scale_2")),
        f32_scalar(&output, &format!("{m}.up_proj.weight_scale_2"))
    );
    // The packed weight decodes close to the input (NVFP4 keeps ~1 significant bit per element
    // relative to its block scale: check a loose relative RMS bound).
    let packed = output.read_as::<u8>(&format!("{q}.weight")).unwrap();
    let scales = output.read_as::<u8>(&format!("{q}.weight_scale")).unwrap();
    let ws2 = f32_scalar(&output, &format!("{q}.weight_scale_2"));
    let mut deq = vec![0f32; 64 * 64];
    kiln_kernels::ops::nvfp4::dequantize_nvfp4(&packed, &scales, ws2, &mut deq).unwrap();
    let orig: Vec<f32> = input
        .read_as::<bf16>(&format!("{q}.weight"))
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect();
    let err = orig
        .iter()
        .zip(&deq)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f32>()
        .sqrt();
    let norm = orig.iter().map(|a| a * a).sum::<f32>().sqrt();
    assert!(err / norm < 0.2, "relative error {}", err / norm);
    // Unquantized tensors are copied byte for byte, in their dtype.
    for name in [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        input.read(name, &mut a).unwrap();
        output.read(name, &mut b).unwrap();
        assert_eq!(a, b, "{name}");
        assert_eq!(meta(&output, name).0, Dtype::BF16);
    }
    // Every input tensor is accounted for, and nothing else appears.
    let per_linear = ["weight", "weight_scale", "weight_scale_2", "input_scale"].len();
    assert_eq!(output.len(), input.len() - 14 + 14 * per_linear);

    // config.json: the input plus exactly one key.
    let in_cfg = input.config().raw();
    let out_cfg = output.config().raw();
    assert_eq!(out_cfg.len(), in_cfg.len() + 1);
    assert!(in_cfg.iter().all(|(k, v)| out_cfg.get(k) == Some(v)));
    let qc = &out_cfg["quantization_config"];
    assert_eq!(qc["quant_algo"], "NVFP4");
    assert_eq!(
        qc["ignore"],
        serde_json::json!(["lm_head", "model.embed_tokens"])
    );
    assert_eq!(
        qc["config_groups"]["group_0"]["targets"],
        serde_json::json!(["Linear"])
    );
    assert_eq!(qc["quant_method"], "modelopt");
    let hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("hf_quant_config.json")).unwrap())
            .unwrap();
    assert_eq!(hf["producer"]["name"], "kiln");
    assert_eq!(hf["quantization"]["group_size"], 16);
    assert!(out.join("generation_config.json").exists());
}

#[test]
fn fp8_scales_are_the_raw_amax_and_the_weight_matches_the_kernel() {
    let root = tempfile::tempdir().unwrap();
    let (model, out) = (root.path().join("model"), root.path().join("out"));
    std::fs::create_dir(&model).unwrap();
    let act = demo(&model);
    run(&options(&model, &out, Format::Fp8, Some(act.clone()))).unwrap();
    let (input, output) = (
        Checkpoint::open(&model).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    let d = "model.layers.0.mlp.down_proj";
    let s = f32_scalar(&output, &format!("{d}.weight_scale"));
    assert_eq!(s, input_amax(&input, &format!("{d}.weight")) / 448.0);
    assert_eq!(
        f32_scalar(&output, &format!("{d}.input_scale")),
        act.input(d).unwrap() / 448.0
    );
    let w = input.read_as::<bf16>(&format!("{d}.weight")).unwrap();
    let mut want = vec![0u8; w.len()];
    kiln_kernels::ops::fp8::quantize_fp8_per_tensor(&w, s, &mut want).unwrap();
    assert_eq!(
        output.read_as::<u8>(&format!("{d}.weight")).unwrap(),
        want,
        "the reference kernel's bytes"
    );
    assert_eq!(
        meta(&output, &format!("{d}.weight")),
        (Dtype::F8_E4M3, vec![64, 128])
    );
    let hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("hf_quant_config.json")).unwrap())
            .unwrap();
    assert!(hf["quantization"].get("group_size").is_none());
}

/// A tensor a format must write: local name, dtype, shape.
type ExpectedTensor = (&'static str, Dtype, &'static [usize]);

#[test]
fn weight_only_formats_have_their_tensor_layouts() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("model");
    std::fs::create_dir(&model).unwrap();
    demo(&model);
    let d = "model.layers.0.mlp.down_proj"; // [64, 128]
    let cases: [(Format, &[ExpectedTensor]); 5] = [
        (
            Format::Fp8PerChannel,
            &[
                ("weight", Dtype::F8_E4M3, &[64, 128]),
                ("weight_scale", Dtype::F32, &[64]),
            ],
        ),
        (
            Format::Int8Wo,
            &[
                ("weight", Dtype::I8, &[64, 128]),
                ("weight_scale", Dtype::F32, &[64]),
            ],
        ),
        (
            Format::W4a16Nvfp4,
            &[
                ("weight", Dtype::U8, &[64, 64]),
                ("weight_scale", Dtype::F8_E4M3, &[64, 8]),
                ("weight_scale_2", Dtype::F32, &[]),
            ],
        ),
        (
            Format::Mxfp4,
            &[
                ("weight", Dtype::U8, &[64, 64]),
                ("weight_scale", Dtype::U8, &[64, 4]),
            ],
        ),
        (
            Format::Mxfp8,
            &[
                ("weight", Dtype::F8_E4M3, &[64, 128]),
                ("weight_scale", Dtype::U8, &[64, 4]),
            ],
        ),
    ];
    for (format, tensors) in cases {
        let out = root.path().join(format.cli_name());
        run(&options(&model, &out, format, None)).unwrap();
        let output = Checkpoint::open(&out).unwrap();
        for (t, dtype, shape) in tensors {
            assert_eq!(
                meta(&output, &format!("{d}.{t}")),
                (*dtype, shape.to_vec()),
                "{format} {t}"
            );
        }
        assert!(
            output.tensor(&format!("{d}.input_scale")).is_none(),
            "{format}: weight-only"
        );
        assert_eq!(
            output.config().raw()["quantization_config"]["quant_algo"],
            format.quant_algo()
        );
    }
}

#[test]
fn failures_leave_no_output() {
    let root = tempfile::tempdir().unwrap();
    let (model, out) = (root.path().join("model"), root.path().join("out"));
    std::fs::create_dir(&model).unwrap();
    demo(&model);
    let err = run(&options(&model, &out, Format::Nvfp4, None))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("nvfp4 needs activation scales, and none are given for `model.layers.0.self_attn.q_proj.input_quantizer`, ")
            && err.ends_with("(pass --act-amax FILE or --calib FILE)"),
        "{err}"
    );
    assert!(!out.exists());
    // 64 input features are not whole int4-awq blocks: refused by the plan, before the
    // statistics are asked for.
    let err = run(&options(&model, &out, Format::Int4Awq, None))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "modelopt int4-awq cannot quantize 12 module(s): `model.layers.0.self_attn.q_proj`"
        ),
        "{err}"
    );
    assert!(!out.exists());

    std::fs::create_dir(&out).unwrap();
    let err = run(&options(&model, &out, Format::Mxfp8, None))
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with("already exists (pass --force to replace it)"),
        "{err}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        2,
        "model and the pre-existing out only: {leftovers:?}"
    );
}

#[test]
fn the_output_is_the_same_bytes_every_time() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let act = demo(&model);
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    run(&options(&model, &a, Format::Nvfp4, Some(act.clone()))).unwrap();
    run(&options(&model, &b, Format::Nvfp4, Some(act))).unwrap();
    for f in ["model.safetensors", "config.json", "hf_quant_config.json"] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn a_cancelled_export_leaves_nothing_behind() {
    let root = tempfile::tempdir().unwrap();
    let (model, out) = (root.path().join("model"), root.path().join("out"));
    std::fs::create_dir(&model).unwrap();
    demo(&model);
    let mut o = options(&model, &out, Format::Mxfp8, None);
    o.cancel = Some(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
        true,
    )));
    assert!(matches!(run(&o), Err(super::ExportError::Cancelled)));
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(root.path()).unwrap().count(),
        1,
        "only the model folder"
    );
}

/// FP8 128×128 tiles, recomputed here from the input with plain loops.
#[test]
fn fp8_block_scales_cover_partial_tiles_and_single_tile_groups_share_one() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("model");
    std::fs::create_dir(&model).unwrap();
    // hidden 192, intermediate 320: down_proj [192, 320] has 2 × 3 tiles, the last ones partial.
    let cfg = DemoConfig {
        hidden: 192,
        intermediate: 320,
        heads: 3,
        kv_heads: 1,
        ..SMALL
    };
    write_demo_model(&model, cfg).unwrap();
    let out = root.path().join("out");
    run(&options(&model, &out, Format::Fp8Block, None)).unwrap();
    let (input, output) = (
        Checkpoint::open(&model).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    let d = "model.layers.1.mlp.down_proj";
    assert_eq!(
        meta(&output, &format!("{d}.weight_scale")),
        (Dtype::F32, vec![2, 1, 3, 1])
    );
    let w: Vec<f32> = input
        .read_as::<bf16>(&format!("{d}.weight"))
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect();
    let (rows, cols) = (192, 320);
    let mut want_s = [0f32; 6];
    for r in 0..rows {
        for c in 0..cols {
            let t = (r / 128) * 3 + c / 128;
            want_s[t] = want_s[t].max(w[r * cols + c].abs());
        }
    }
    for s in &mut want_s {
        *s /= 448.0;
    }
    let got_s = output.read_as::<f32>(&format!("{d}.weight_scale")).unwrap();
    assert_eq!(got_s, want_s);
    let q = output.read_as::<u8>(&format!("{d}.weight")).unwrap();
    for (i, &b) in q.iter().enumerate() {
        let s = want_s[(i / cols / 128) * 3 + (i % cols) / 128];
        assert_eq!(
            b,
            kiln_kernels::ops::fp8::fp8_f32_one(w[i], s),
            "element {i}"
        );
    }
    assert!(output.tensor(&format!("{d}.input_scale")).is_none());

    // The small demo's q/k/v and gate/up are one tile each: each group shares its max amax.
    let small = root.path().join("small");
    std::fs::create_dir(&small).unwrap();
    demo(&small);
    let out = root.path().join("small-out");
    run(&options(&small, &out, Format::Fp8Block, None)).unwrap();
    let (input, output) = (
        Checkpoint::open(&small).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    let a = "model.layers.0.self_attn";
    let amax = ["q_proj", "k_proj", "v_proj"]
        .iter()
        .map(|p| input_amax(&input, &format!("{a}.{p}.weight")))
        .fold(0f32, f32::max);
    for p in ["q_proj", "k_proj", "v_proj"] {
        let name = format!("{a}.{p}.weight_scale");
        assert_eq!(meta(&output, &name), (Dtype::F32, vec![]), "{name}");
        assert_eq!(f32_scalar(&output, &name), amax / 448.0, "{name}");
    }
    // o_proj is alone in its group: its own amax.
    let o = format!("{a}.o_proj");
    assert_eq!(
        f32_scalar(&output, &format!("{o}.weight_scale")),
        input_amax(&input, &format!("{o}.weight")) / 448.0
    );
}

// ---- what exporters declare is what the configs say ----

use super::{ExportContext, ExportError, ModuleExporter, quantize_linear};
use crate::export::registry::{ExporterEntry, ExporterRegistry, Predicate};
use crate::module_tree::ModuleRef;
use crate::registry::RegistryBuilder;
use std::sync::Arc;

fn is_lm_head(m: &ModuleRef<'_>) -> bool {
    m.path() == "lm_head"
}

/// The built-in exporters with `T` ahead of them, taking `lm_head`.
fn with_head_exporter<T: ModuleExporter + Default + 'static>() -> Arc<ExporterRegistry> {
    let mut b = RegistryBuilder::<ExporterEntry>::from_static().unwrap();
    b.prepend(ExporterEntry::of::<T>(
        vec![],
        Some(Predicate {
            func: is_lm_head,
            name: "is_lm_head".into(),
        }),
    ));
    Arc::new(b.build().unwrap())
}

/// Quantizes `lm_head` to FP8 through the public API.
#[derive(Default)]
struct Fp8Head;

impl ModuleExporter for Fp8Head {
    fn export(&self, _: &str, m: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
        quantize_linear(ctx, m, Format::Fp8)
    }
}

/// Writes an FP8 `lm_head` with `ctx.emit` and declares nothing.
#[derive(Default)]
struct UndeclaredFp8Head;

impl ModuleExporter for UndeclaredFp8Head {
    fn export(&self, _: &str, _: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
        let w = ctx.checkpoint()?.read_as::<bf16>("lm_head.weight")?;
        let s = kiln_kernels::ops::fp8::fp8_scale(kiln_kernels::cpu::amax(&w));
        let mut q = vec![0u8; w.len()];
        kiln_kernels::cpu::quantize_fp8_per_tensor(&w, s, &mut q).unwrap();
        ctx.emit("lm_head.weight", Dtype::F8_E4M3, &[96, 64], &q)?;
        ctx.emit("lm_head.weight_scale", Dtype::F32, &[], &s.to_le_bytes())
    }
}

/// Declares NVFP4 but writes FP8 tensors.
#[derive(Default)]
struct MislabelledHead;

impl ModuleExporter for MislabelledHead {
    fn export(&self, n: &str, m: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
        UndeclaredFp8Head.export(n, m, ctx)?;
        ctx.record_quantized("lm_head", Format::Nvfp4)
    }
}

fn export_with(
    registry: Arc<ExporterRegistry>,
    format: Format,
) -> (
    tempfile::TempDir,
    Result<super::run::ExportSummary, ExportError>,
) {
    let root = tempfile::tempdir().unwrap();
    let (model, out) = (root.path().join("model"), root.path().join("out"));
    std::fs::create_dir(&model).unwrap();
    let act = demo(&model);
    let options = ExportOptions {
        exporters: Some(registry),
        ..options(&model, &out, format, Some(act))
    };
    let result = run(&options);
    (root, result)
}

fn json_file(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_plugin_quantized_lm_head_is_not_listed_as_excluded() {
    let (root, summary) = export_with(with_head_exporter::<Fp8Head>(), Format::Fp8);
    let summary = summary.unwrap();
    let out = root.path().join("out");
    assert_eq!(summary.excluded, ["model.embed_tokens"]);
    assert_eq!(summary.quantized["lm_head"], "fp8");
    let hf = json_file(&out.join("hf_quant_config.json"));
    assert_eq!(hf["quantization"]["quant_algo"], "FP8");
    assert_eq!(
        hf["quantization"]["exclude_modules"],
        serde_json::json!(["model.embed_tokens"])
    );
    let config = json_file(&out.join("config.json"));
    assert_eq!(
        config["quantization_config"]["ignore"],
        serde_json::json!(["model.embed_tokens"])
    );
    let c = Checkpoint::open(&out).unwrap();
    assert_eq!(meta(&c, "lm_head.weight"), (Dtype::F8_E4M3, vec![96, 64]));
    assert_eq!(
        f32_scalar(&c, "lm_head.input_scale"),
        8.0 / 448.0,
        "the demo's lm_head input amax"
    );
}

#[test]
fn a_module_in_another_format_makes_the_checkpoint_mixed_precision() {
    // ModelOpt's answer to a per-module format: MIXED_PRECISION with `quantized_layers`.
    let (root, summary) = export_with(with_head_exporter::<Fp8Head>(), Format::Nvfp4);
    summary.unwrap();
    let out = root.path().join("out");
    let hf = json_file(&out.join("hf_quant_config.json"));
    let q = &hf["quantization"];
    assert_eq!(q["quant_algo"], "MIXED_PRECISION");
    assert!(q.get("exclude_modules").is_none());
    assert_eq!(q["quantized_layers"]["lm_head"]["quant_algo"], "FP8");
    assert_eq!(
        q["quantized_layers"]["model.layers.0.self_attn.q_proj"],
        serde_json::json!({"quant_algo": "NVFP4", "group_size": 16})
    );
    let qc = &json_file(&out.join("config.json"))["quantization_config"];
    assert_eq!(qc["quant_algo"], "MIXED_PRECISION");
    assert_eq!(qc["config_groups"].as_object().unwrap().len(), 2);
    assert_eq!(qc["quantized_layers"], q["quantized_layers"]);
}

#[test]
fn quantized_tensors_without_a_declaration_are_refused() {
    let (root, result) = export_with(with_head_exporter::<UndeclaredFp8Head>(), Format::Fp8);
    let e = result.unwrap_err();
    assert!(
        matches!(&e, ExportError::UndeclaredQuantization { module, tensors, .. }
            if module == "lm_head" && tensors == &["lm_head.weight F8_E4M3", "lm_head.weight_scale F32"]),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("UndeclaredFp8Head wrote quantized tensors"),
        "{e}"
    );
    assert!(!root.path().join("out").exists());
}

#[test]
fn a_declared_format_must_match_the_tensors_written() {
    let (_root, result) = export_with(with_head_exporter::<MislabelledHead>(), Format::Fp8);
    let e = result.unwrap_err().to_string();
    assert_eq!(
        e,
        "module `lm_head` declared nvfp4, but `weight` is F8_E4M3 [96, 64], the format has U8 [96, 32]"
    );
}

#[test]
fn nan_and_inf_weights_are_counted_and_refused_when_strict() {
    let root = tempfile::tempdir().unwrap();
    let (model, out) = (root.path().join("model"), root.path().join("out"));
    std::fs::create_dir(&model).unwrap();
    let act = demo(&model);
    // Poison two values of a q_proj (quantized) and one of a norm (copied).
    let path = model.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    for (name, _, _, data) in &mut tensors {
        let poison: &[(usize, f32)] = match name.as_str() {
            "model.layers.1.self_attn.q_proj.weight" => &[(5, f32::NAN), (70, f32::INFINITY)],
            "model.norm.weight" => &[(3, f32::NAN)],
            _ => &[],
        };
        for &(i, v) in poison {
            data[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes());
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    drop(st);
    safetensors::serialize_to_file(views, None, &path).unwrap();

    let summary = run(&options(&model, &out, Format::Fp8, Some(act.clone()))).unwrap();
    assert_eq!(
        summary.nonfinite.into_iter().collect::<Vec<_>>(),
        [
            ("model.layers.1.self_attn.q_proj.weight".to_string(), 2),
            ("model.norm.weight".to_string(), 1)
        ]
    );
    assert!(
        summary.warnings[0]
            .starts_with("`model.layers.1.self_attn.q_proj.weight` holds 2 NaN/Inf value(s)"),
        "{:?}",
        summary.warnings
    );
    let strict = ExportOptions {
        strict: true,
        ..options(&model, &root.path().join("strict"), Format::Fp8, Some(act))
    };
    let e = run(&strict).unwrap_err().to_string();
    assert_eq!(
        e,
        "non-finite values (NaN/Inf) in `model.layers.1.self_attn.q_proj.weight` (2), `model.norm.weight` (1) (--strict)"
    );
    assert!(!root.path().join("strict").exists());
}
