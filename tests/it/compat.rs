//! Compatibility with ModelOpt 0.47: kiln exports the same tiny models (Llama, Mistral,
//! Qwen2, Qwen3, Qwen3-MoE and Mixtral with per-expert Linears, GPT-OSS with 3-D BMM experts,
//! and Qwen3-MoE with transformers 5's fused 3-D experts) that `tests/compat/modelopt_ref.py`
//! exported with ModelOpt (feeding ModelOpt's calibrated amax through `--act-amax`), and every
//! tensor — name, dtype, shape, bytes — and both JSON files must match. The only allowed
//! difference is the producer (`kiln`).

use kiln::export::{ExportContext, ExportError, ModuleExporter, quantize_linear};
use kiln::{ExporterEntry, ExporterRegistry, ModuleRef, Predicate, RegistryBuilder};
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::export::act_amax::ActAmax;
use kiln_runtime::export::recipe::{Format, KvCache, Recipe};
use kiln_runtime::export::run::{ExportOptions, run};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn compat_dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/compat")
        .join(model)
}

fn without_producer(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.remove("producer");
        for child in o.values_mut() {
            if let Some(c) = child.as_object_mut() {
                c.remove("producer");
            }
        }
    }
    v
}

fn json(path: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

fn check_format(format: Format) {
    check("llama-tiny", format);
}

fn check(model: &str, format: Format) {
    check_recipe(model, format.cli_name(), Recipe::new(format));
}

/// Export options for the compat model at `root` into `out`.
fn options(root: &Path, out: &Path, recipe: Recipe, act: ActAmax) -> ExportOptions {
    ExportOptions {
        act_amax: Some(act),
        ..ExportOptions::new(root.join("model"), out, recipe)
    }
}

/// `model`'s export `dir` (its `amax.json` and `modelopt/`) against kiln with `recipe`.
fn check_recipe(model: &str, dir: &str, recipe: Recipe) {
    check_with(model, dir, recipe, true)
}

/// [`check_recipe`]; `whole_config`: compare all of config.json, not only its
/// `quantization_config` (a reference written by another transformers rewrites the rest).
fn check_with(model: &str, dir: &str, recipe: Recipe, whole_config: bool) {
    check_exported_by(model, dir, recipe, whole_config, None)
}

/// [`check_with`], exporting with `exporters` instead of the built-in registry.
fn check_exported_by(
    model: &str,
    dir: &str,
    recipe: Recipe,
    whole_config: bool,
    exporters: Option<Arc<ExporterRegistry>>,
) {
    let root = compat_dir(model);
    check_at(&root, &root.join(dir), recipe, whole_config, exporters)
}

/// The model at `root/model` exported with `dir/amax.json` against ModelOpt's `dir/modelopt`.
fn check_at(
    root: &Path,
    dir: &Path,
    recipe: Recipe,
    whole_config: bool,
    exporters: Option<Arc<ExporterRegistry>>,
) {
    let format = recipe.format;
    let reference = dir.join("modelopt");
    let out_root = tempfile::tempdir().unwrap();
    let out = out_root.path().join("kiln");
    let act = ActAmax::read(&dir.join("amax.json")).unwrap();
    let options = ExportOptions {
        exporters,
        ..options(root, &out, recipe, act)
    };
    run(&options).unwrap_or_else(|e| panic!("{format}: {e}"));

    let (ours, theirs) = (
        Checkpoint::open(&out).unwrap(),
        Checkpoint::open(&reference).unwrap(),
    );
    let names = |c: &Checkpoint| c.tensors().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&ours), names(&theirs), "{format}: tensor names");
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for t in theirs.tensors() {
        let o = ours.tensor(&t.name).unwrap();
        assert_eq!(
            (o.dtype, &o.shape),
            (t.dtype, &t.shape),
            "{format}: `{}` dtype and shape",
            t.name
        );
        ours.read(&t.name, &mut a).unwrap();
        theirs.read(&t.name, &mut b).unwrap();
        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        assert_eq!(
            differ,
            0,
            "{format}: `{}`: {differ} of {} bytes differ from ModelOpt",
            t.name,
            b.len()
        );
    }
    assert_eq!(
        without_producer(json(&out.join("hf_quant_config.json"))),
        without_producer(json(&reference.join("hf_quant_config.json"))),
        "{format}: hf_quant_config.json"
    );
    let mut ours_cfg = json(&out.join("config.json"));
    let mut theirs_cfg = json(&reference.join("config.json"));
    for cfg in [&mut ours_cfg, &mut theirs_cfg] {
        let qc = cfg["quantization_config"].take();
        cfg["quantization_config"] = without_producer(qc);
    }
    if !whole_config {
        assert_eq!(
            ours_cfg["quantization_config"], theirs_cfg["quantization_config"],
            "{format}: config.json quantization_config"
        );
        return;
    }
    // ModelOpt re-saves config.json through transformers, which adds its own bookkeeping keys
    // (`transformers_version`, `dtype`); everything else must agree.
    let (o, t) = (
        ours_cfg.as_object().unwrap(),
        theirs_cfg.as_object().unwrap(),
    );
    for (k, v) in o {
        assert_eq!(Some(v), t.get(k), "{format}: config.json `{k}`");
    }
    let missing: Vec<&String> = t
        .keys()
        .filter(|k| {
            !o.contains_key(*k)
                && !matches!(k.as_str(), "transformers_version" | "dtype" | "torch_dtype")
        })
        .collect();
    assert!(
        missing.is_empty(),
        "{format}: config.json keys only ModelOpt writes: {missing:?}"
    );
}

#[test]
fn fp8_matches_modelopt_bit_for_bit() {
    check_format(Format::Fp8);
}

#[test]
fn nvfp4_matches_modelopt_bit_for_bit() {
    check_format(Format::Nvfp4);
}

#[test]
fn w4a16_nvfp4_matches_modelopt_bit_for_bit() {
    check_format(Format::W4a16Nvfp4);
}

#[test]
fn fp8_per_channel_matches_modelopt_bit_for_bit() {
    check_format(Format::Fp8PerChannel);
}

#[test]
fn int8_wo_matches_modelopt_bit_for_bit() {
    check_format(Format::Int8Wo);
}

#[test]
fn mxfp8_matches_modelopt_bit_for_bit() {
    check_format(Format::Mxfp8);
}

#[test]
fn mxfp4_matches_modelopt_bit_for_bit() {
    check_format(Format::Mxfp4);
}

#[test]
fn fp8_block_matches_modelopt_bit_for_bit() {
    check_format(Format::Fp8Block);
}

#[test]
fn kv_cache_scales_match_modelopt_bit_for_bit() {
    for (dir, format) in [("fp8+kv-fp8", Format::Fp8), ("nvfp4+kv-fp8", Format::Nvfp4)] {
        check_recipe(
            "llama-tiny",
            dir,
            Recipe {
                kv_cache: Some(KvCache::Fp8),
                ..Recipe::new(format)
            },
        );
    }
}

#[test]
fn qwen3_moe_matches_modelopt_bit_for_bit_in_every_format() {
    for format in [
        Format::Fp8,
        Format::Nvfp4,
        Format::W4a16Nvfp4,
        Format::Fp8PerChannel,
        Format::Int8Wo,
        Format::Mxfp8,
        Format::Fp8Block,
        Format::Int8Sq,
    ] {
        check("qwen3-moe-tiny", format);
    }
}

#[test]
fn mixtral_matches_modelopt_bit_for_bit() {
    for format in [
        Format::Fp8,
        Format::Nvfp4,
        Format::Fp8PerChannel,
        Format::Int8Wo,
        Format::Mxfp8,
        Format::Fp8Block,
        Format::Int8Sq,
    ] {
        check("mixtral-tiny", format);
    }
}

#[test]
fn qwen2_with_attention_biases_matches_modelopt_bit_for_bit() {
    for format in [
        Format::Fp8,
        Format::Nvfp4,
        Format::Int8Wo,
        Format::Fp8Block,
        Format::Int8Sq,
    ] {
        check("qwen2-tiny", format);
    }
}

#[test]
fn qwen3_dense_with_qk_norms_matches_modelopt_bit_for_bit() {
    for format in [
        Format::Fp8,
        Format::Nvfp4,
        Format::W4a16Nvfp4,
        Format::Mxfp4,
        Format::Int8Sq,
    ] {
        check("qwen3-tiny", format);
    }
}

#[test]
fn mistral_matches_modelopt_bit_for_bit() {
    for format in [
        Format::Fp8,
        Format::Nvfp4,
        Format::Fp8PerChannel,
        Format::Mxfp8,
        Format::Int8Sq,
    ] {
        check("mistral-tiny", format);
    }
}

#[test]
fn experts_without_calibration_get_the_max_over_their_siblings() {
    // An expert no calibration token reached has no amax in the dump: it takes the max over
    // its siblings (ModelOpt's fill), with a warning naming it. Expert 3's gate_proj loses its
    // amax here.
    let root = compat_dir("qwen3-moe-tiny");
    let full: serde_json::Map<String, Value> =
        serde_json::from_value(json(&root.join("fp8/amax.json"))).unwrap();
    let experts = "model.layers.0.mlp.experts";
    let without = |drop: &dyn Fn(&str) -> bool| -> Vec<(String, f32)> {
        full.iter()
            .filter(|(k, _)| !drop(k))
            .map(|(k, v)| (k.clone(), v.as_f64().unwrap() as f32))
            .collect()
    };
    let gate3 = format!("{experts}.3.gate_proj.input_quantizer");
    let out_root = tempfile::tempdir().unwrap();
    let out = out_root.path().join("kiln");
    let summary = run(&options(
        &root,
        &out,
        Recipe::new(Format::Fp8),
        ActAmax::from_values(without(&|k| k == gate3)),
    ))
    .unwrap();
    let c = Checkpoint::open(&out).unwrap();
    let scale = |m: &str| c.read_as::<f32>(&format!("{m}.input_scale")).unwrap()[0];
    let max_gate = (0..8)
        .filter(|&e| e != 3)
        .map(|e| {
            full[&format!("{experts}.{e}.gate_proj.input_quantizer")]
                .as_f64()
                .unwrap() as f32
        })
        .fold(0f32, f32::max);
    assert_eq!(scale(&format!("{experts}.3.gate_proj")), max_gate / 448.0);
    assert!(
        summary
            .warnings
            .iter()
            .any(|w| w.starts_with(&format!("`{experts}.3.gate_proj`: no input amax"))),
        "{:?}",
        summary.warnings
    );
    // Calibrated experts keep their own.
    let own = full[&format!("{experts}.2.gate_proj.input_quantizer")]
        .as_f64()
        .unwrap() as f32;
    assert_eq!(scale(&format!("{experts}.2.gate_proj")), own / 448.0);

    // No expert of a projection has statistics: not ModelOpt's silent 0.5 for the whole
    // group, but an error naming them.
    let e = export_error(
        "qwen3-moe-tiny",
        Recipe::new(Format::Fp8),
        ActAmax::from_values(without(&|k| k.contains(".down_proj."))),
    );
    assert!(
        e.starts_with("fp8 needs activation scales, and none are given for `model.layers.0.mlp.experts.0.down_proj.input_quantizer`"),
        "{e}"
    );
}

#[test]
fn tied_embeddings_list_lm_head_as_modelopt_does() {
    // No `lm_head.weight` on disk (`tie_word_embeddings: true`): ModelOpt still lists
    // `lm_head` in exclude_modules and in quantization_config.ignore.
    for format in [Format::Fp8, Format::Nvfp4] {
        check("llama-tied-tiny", format);
    }
}

#[test]
fn transformers_5_dumps_apply_to_per_expert_checkpoints_bit_for_bit() {
    // ModelOpt under transformers 5 calibrates MoE experts fused in memory, so its dump names
    // `<block>.mlp.experts.gate_up_proj_input_quantizer` / `down_proj_input_quantizer` — also
    // for Mixtral, whose checkpoint keeps `block_sparse_moe.experts.E.w1/w2/w3`. Applied to the
    // per-expert checkpoints on disk, kiln's export equals ModelOpt's (which writes hub names).
    for model in ["mixtral-tiny", "qwen3-moe-tiny"] {
        for format in [Format::Fp8, Format::Nvfp4] {
            // transformers 5 rewrote the rest of config.json (`rope_parameters`): compare its
            // quantization_config only.
            let dir = format!("{}-tf5", format.cli_name());
            check_with(model, &dir, Recipe::new(format), false);
        }
    }
}

#[test]
fn transformers_4_dumps_apply_to_fused_checkpoints_bit_for_bit() {
    // The other direction: per-expert keys (`<experts>.<e>.gate_proj.input_quantizer`, as a
    // transformers 4 calibration names them) on a checkpoint holding the experts fused. The
    // fused projection's one quantizer sees every expert's tokens: the max over the experts.
    // Spread ModelOpt's fused amax over the experts so that their max is exactly it.
    let root = compat_dir("qwen3-moe-fused-tiny");
    let fused: serde_json::Map<String, Value> =
        serde_json::from_value(json(&root.join("fp8/amax.json"))).unwrap();
    let mut per_expert: Vec<(String, f32)> = Vec::new();
    for (k, v) in &fused {
        let v = v.as_f64().unwrap() as f32;
        let Some((experts, projection)) = k
            .strip_suffix("_input_quantizer")
            .and_then(|s| s.rsplit_once('.'))
            .filter(|(e, _)| e.ends_with(".experts"))
        else {
            per_expert.push((k.clone(), v));
            continue;
        };
        let locals: &[&str] = match projection {
            "gate_up_proj" => &["gate_proj", "up_proj"],
            _ => &["down_proj"],
        };
        for (e, share) in [0.5f32, 1.0, 0.25, 0.75].into_iter().enumerate() {
            for l in locals {
                per_expert.push((format!("{experts}.{e}.{l}.input_quantizer"), v * share));
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("fp8-tf4");
    std::fs::create_dir_all(dump.join("modelopt")).unwrap();
    ActAmax::from_values(per_expert)
        .write(&dump.join("amax.json"))
        .unwrap();
    // The reference is ModelOpt's fused export; only the statistics are renamed.
    for f in std::fs::read_dir(root.join("fp8/modelopt")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dump.join("modelopt").join(f.file_name().unwrap())).unwrap();
    }
    check_at(&root, &dump, Recipe::new(Format::Fp8), true, None);
}

#[test]
fn statistics_keys_that_name_no_quantizer_are_reported() {
    let root = compat_dir("llama-tiny");
    let mut act: serde_json::Map<String, Value> =
        serde_json::from_value(json(&root.join("fp8/amax.json"))).unwrap();
    act.insert(
        "model.layers.0.self_attn.qproj.input_quantizer".into(),
        Value::from(1.0),
    );
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("amax.json");
    std::fs::write(&file, Value::Object(act).to_string()).unwrap();
    let read = || ActAmax::read(&file).unwrap();
    let out = tmp.path().join("out");
    let summary = run(&options(&root, &out, Recipe::new(Format::Fp8), read())).unwrap();
    assert_eq!(
        summary.warnings,
        [format!(
            "{}: 1 key(s) name no quantizer of this model and were ignored: model.layers.0.self_attn.qproj.input_quantizer",
            file.display()
        )]
    );
    let strict = ExportOptions {
        strict: true,
        ..options(
            &root,
            &tmp.path().join("strict"),
            Recipe::new(Format::Fp8),
            read(),
        )
    };
    let e = run(&strict).unwrap_err().to_string();
    assert!(
        e.ends_with("1 key(s) name no quantizer of this model: `model.layers.0.self_attn.qproj.input_quantizer` (--strict)"),
        "{e}"
    );
    assert!(!tmp.path().join("strict").exists());
}

#[test]
fn gpt_oss_bmm_experts_match_modelopt_bit_for_bit() {
    // 3-D experts that stay 3-D: per-tensor scales across experts, NVFP4 transposed, MX along
    // the output dimension, FP8 per-channel per expert; attention sinks and router biases
    // copied. ModelOpt 0.47 cannot export int8-wo here.
    for format in [
        Format::Fp8,
        Format::Nvfp4,
        Format::W4a16Nvfp4,
        Format::Fp8PerChannel,
        Format::Mxfp8,
        Format::Mxfp4,
        Format::Fp8Block,
    ] {
        check("gpt-oss-tiny", format);
    }
}

#[test]
fn fused_experts_of_transformers_5_match_modelopt_bit_for_bit() {
    // A checkpoint in transformers 5's in-memory layout (`gate_up_proj [E, 2I, H]`,
    // `down_proj [E, H, I]`) against ModelOpt 0.47 under transformers 5.24: per-expert 2-D
    // Linears, one input scale per projection for every expert.
    for format in [
        Format::Fp8,
        Format::Nvfp4,
        Format::W4a16Nvfp4,
        Format::Fp8PerChannel,
        Format::Int8Wo,
        Format::Mxfp8,
        Format::Mxfp4,
        Format::Fp8Block,
    ] {
        check("qwen3-moe-fused-tiny", format);
    }
}

/// kiln's export of `model` with `recipe` and input amax `act`, expected to fail: its message.
fn export_error(model: &str, recipe: Recipe, act: ActAmax) -> String {
    let root = compat_dir(model);
    let out_root = tempfile::tempdir().unwrap();
    let out = out_root.path().join("kiln");
    let e = run(&options(&root, &out, recipe, act))
        .expect_err("the export must fail")
        .to_string();
    assert!(!out.exists(), "a failed export left {}", out.display());
    e
}

#[test]
fn three_d_experts_name_what_they_cannot_do() {
    // FP8 needs the experts' per-projection input quantizers; without them the export stops
    // before writing anything and names them.
    let root = compat_dir("qwen3-moe-fused-tiny");
    let all = json(&root.join("fp8/amax.json"));
    let without_experts = all
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| !k.contains(".experts."))
        .map(|(k, v)| (k.clone(), v.as_f64().unwrap() as f32));
    let e = export_error(
        "qwen3-moe-fused-tiny",
        Recipe::new(Format::Fp8),
        ActAmax::from_values(without_experts),
    );
    assert!(
        e.contains("`model.layers.0.mlp.experts.gate_up_proj_input_quantizer`")
            && e.contains("`model.layers.0.mlp.experts.down_proj_input_quantizer`"),
        "{e}"
    );
    // INT8 per channel cannot take BMM experts (nor can ModelOpt 0.47).
    let e = export_error(
        "gpt-oss-tiny",
        Recipe::new(Format::Int8Wo),
        ActAmax::from_values([]),
    );
    assert!(
        e.contains("`model.layers.0.mlp.experts.gate_up_proj`")
            && e.contains("int8-wo cannot quantize BMM experts"),
        "{e}"
    );
}

#[test]
fn awq_and_smoothquant_with_given_scales_match_modelopt_bit_for_bit() {
    // ModelOpt's calibrated pre-quant scales (`_pre_quant_scale` in amax.json) as given
    // scales: kiln smooths, resmooths q/k/v and gate/up to their mean, folds it into the norms
    // (AWQ) or keeps it on every Linear (SmoothQuant), and packs — every byte as ModelOpt.
    check("llama-tiny", Format::Int4Awq);
    check("llama-tiny", Format::W4a8Awq);
    check("llama-tiny", Format::Int8Sq);
    // awq_full: the clipping search's block amax (`<linear>.weight_quantizer`) as given
    // amax — kept on o_proj and down_proj, lost where the resmooth rescales the weight.
    check_recipe("llama-tiny", "int4-awq-full", Recipe::new(Format::Int4Awq));
}

#[test]
fn awq_int4_block_sizes_match_modelopt_bit_for_bit() {
    // `--group-size 64` / `32`: ModelOpt's INT4_AWQ_CFG with `block_sizes {-1: N}` — the
    // packed weights, `weight_scale [out, in / N]` and `group_size` in both configs.
    for (dir, format, group) in [
        ("int4-awq-g64", Format::Int4Awq, 64),
        ("int4-awq-g32", Format::Int4Awq, 32),
        ("w4a8-awq-g64", Format::W4a8Awq, 64),
    ] {
        let recipe = Recipe {
            group_size: Some(group),
            ..Recipe::new(format)
        };
        check_recipe("llama-tiny", dir, recipe);
    }
}

#[test]
fn nvfp4_awq_with_given_scales_matches_modelopt_bit_for_bit() {
    // ModelOpt's NVFP4 AWQ search needs a GPU: this reference was made on an H200 (ModelOpt
    // 0.47, transformers 5.17; `modelopt_ref.py llama-tiny nvfp4-awq --reuse-input`). Besides
    // AWQ's smoothing, NVFP4 AWQ folds down_proj's scale into up_proj's rows (o_proj's into
    // v_proj's is skipped: this Llama's GQA v_proj is narrower). transformers 5 rewrites the
    // rest of config.json (`rope_parameters`), so only its quantization_config is compared.
    check_with(
        "llama-tiny",
        "nvfp4-awq",
        Recipe::new(Format::Nvfp4Awq),
        false,
    );
}

#[test]
fn awq_without_pre_quant_scales_names_them() {
    let root = compat_dir("llama-tiny");
    let fp8_only = ActAmax::read(&root.join("fp8/amax.json")).unwrap();
    let e = export_error("llama-tiny", Recipe::new(Format::Int4Awq), fp8_only);
    assert!(
        e.starts_with("int4-awq needs activation scales")
            && e.contains("`model.layers.0.self_attn.q_proj.input_quantizer._pre_quant_scale`"),
        "{e}"
    );
}

#[test]
fn awq_on_moe_experts_matches_modelopt_bit_for_bit() {
    // Per-expert Linears: each Linear name's scales are averaged over the experts, then an
    // expert's gate/up (w1/w3) over the pair — no norm absorbs them (the experts' input is a
    // routed subset, not the norm's output), so every expert writes `pre_quant_scale`.
    check("qwen3-moe-awq-tiny", Format::Int4Awq);
    check("mixtral-awq-tiny", Format::Int4Awq);
}

/// Quantizes `lm_head` to FP8, whatever the export's format.
#[derive(Default)]
struct Fp8LmHead;

impl ModuleExporter for Fp8LmHead {
    fn export(&self, _: &str, m: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
        quantize_linear(ctx, m, Format::Fp8)
    }
}

fn is_lm_head(m: &ModuleRef<'_>) -> bool {
    m.path() == "lm_head"
}

#[test]
fn a_second_format_is_modelopts_mixed_precision_bit_for_bit() {
    // ModelOpt with NVFP4 everywhere and an FP8 `lm_head` writes MIXED_PRECISION:
    // `quantized_layers` in module order, and config_groups of compressed-tensors entries.
    // kiln gets there with a plugin exporter for `lm_head`.
    let mut b = RegistryBuilder::<ExporterEntry>::from_static().unwrap();
    b.prepend(ExporterEntry::of::<Fp8LmHead>(
        vec![],
        Some(Predicate {
            func: is_lm_head,
            name: "is_lm_head".into(),
        }),
    ));
    check_exported_by(
        "llama-tiny",
        "nvfp4+fp8-lm-head",
        Recipe::new(Format::Nvfp4),
        true,
        Some(Arc::new(b.build().unwrap())),
    );
}
