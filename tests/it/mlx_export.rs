//! `--output-format mlx`: kiln's output against `mlx_lm.convert -q` on the same model, tensor
//! by tensor and bit for bit, then loaded and run by mlx-lm (`tests/mlx/check_export.py`), for
//! every MLX mode on the demo model and two on each family (Llama, tied Llama, Mistral, Qwen2,
//! Qwen3, Qwen3-MoE per-expert and fused, Mixtral). mlx-lm 0.32.2 runs on MLX's CPU device
//! (`pip install mlx[cpu]==0.32.2 mlx-lm==0.32.2`); `KILN_MLX_PYTHON` names the Python that has
//! it (default `python3`); CI sets `KILN_REQUIRE_MLX_LM=1` so the check cannot skip.

use crate::common;

use common::family;
use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::export::recipe::{Format, Recipe};
use kiln_runtime::export::run::{ExportOptions, OutputFormat, run};
use std::path::Path;

fn python() -> String {
    std::env::var("KILN_MLX_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn export(model: &Path, out: &Path, format: &str) -> kiln_runtime::export::run::ExportSummary {
    common::export("mlx", model, out, format)
}

fn check(model: &Path, out: &Path, format: &str, work: &Path) {
    let install = "pip install mlx[cpu]==0.32.4 mlx-lm==0.32.2";
    if common::python_has(&python(), "mlx_lm", "KILN_REQUIRE_MLX_LM", install) {
        common::run_check(
            &python(),
            "tests/mlx/check_export.py",
            &[
                model.as_os_str(),
                out.as_os_str(),
                format.as_ref(),
                work.as_os_str(),
            ],
            &format!("{} {format}", model.display()),
        );
    }
}

#[test]
fn every_mode_on_the_demo_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("kiln-demo");
    std::fs::create_dir_all(&model).unwrap();
    write_demo_model(&model, DemoConfig::default()).unwrap();
    for format in ["q4", "q8", "q4-g32", "q2-g128", "mxfp4", "mxfp8", "nvfp4"] {
        let out = tmp.path().join(format);
        let s = export(&model, &out, format);
        // Every Linear and the embeddings: mlx-lm quantizes lm_head and embed_tokens too.
        assert_eq!(s.quantized.len(), 30, "{format}");
        check(&model, &out, format, tmp.path());
    }
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
    ] {
        let model = family(name, tmp.path());
        for format in ["q4", "mxfp4"] {
            let out = tmp.path().join(format!("{name}-{format}"));
            let s = export(&model, &out, format);
            check(&model, &out, format, tmp.path());
            verified(&model, &out, &s);
        }
    }
}

/// `kiln verify` reads the MLX export back: every tensor decodes (experts unstacked) to the
/// reference's shape, one weight error per module the writer quantized, each small.
fn verified(model: &Path, out: &Path, s: &kiln_runtime::export::run::ExportSummary) {
    let report = kiln_runtime::formats::verify(model, out).unwrap();
    assert!(
        report.problems.is_empty(),
        "{}: {:?}",
        out.display(),
        report.problems
    );
    assert_eq!(
        report.weight_errors.len(),
        s.quantized.len(),
        "{}",
        out.display()
    );
    // 2-bit weights sit near 0.4 (relative), the others under 0.15.
    let bound = if out.to_string_lossy().contains("q2") {
        0.6
    } else {
        0.2
    };
    for (m, e) in &report.weight_errors {
        assert!(*e < bound, "{}: `{m}` decodes {e:.3} away", out.display());
    }
}

#[test]
fn kiln_verify_reads_every_mode_back() {
    let tmp = tempfile::tempdir().unwrap();
    let model = family("llama-tiny", tmp.path());
    for format in ["q4", "q8-g32", "q2-g128", "mxfp4", "mxfp8", "nvfp4"] {
        let out = tmp.path().join(format);
        let s = export(&model, &out, format);
        verified(&model, &out, &s);
    }
    // Scales 1000× off decode to a weight far from the reference's: verify measures it.
    let (src, bad) = (tmp.path().join("q4"), tmp.path().join("q4-bad-scales"));
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(src.join("config.json"), bad.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let edited: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let mut data = v.data().to_vec();
            if n == "model.layers.0.mlp.down_proj.scales" {
                for c in data.chunks_exact_mut(2) {
                    let x = half::bf16::from_le_bytes([c[0], c[1]]).to_f32() * 1000.0;
                    c.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
                }
            }
            (n, v.dtype(), v.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = edited
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &bad.join("model.safetensors")).unwrap();
    let report = kiln_runtime::formats::verify(&model, &bad).unwrap();
    let worst = report
        .weight_errors
        .iter()
        .find(|(m, _)| m == "model.layers.0.mlp.down_proj")
        .unwrap();
    assert!(worst.1 > 10.0, "{worst:?}");
}

#[test]
fn qwen3_moe_routers_are_8_bit_as_mlx_lm_quantizes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let model = family("qwen3-moe-tiny", tmp.path());
    let s = export(&model, &tmp.path().join("out"), "q4");
    assert_eq!(s.quantized["model.layers.0.mlp.gate"], "affine8g64");
    assert_eq!(
        s.quantized["model.layers.0.mlp.experts.0.up_proj"],
        "affine4g64"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["quantization"]["model.layers.1.mlp.gate"],
        serde_json::json!({"group_size": 64, "bits": 8})
    );
    assert_eq!(config["quantization"]["mode"], "affine");
}

#[test]
fn what_mlx_cannot_express_is_a_named_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = family("llama-tiny", tmp.path());
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: "mlx".into(),
            format: "q3".into(),
        }),
        ..ExportOptions::new(&model, tmp.path().join("out"), Recipe::new(Format::Nvfp4))
    };
    let e = run(&options).unwrap_err().to_string();
    assert!(
        e.starts_with("the mlx writer has no format `q3` (it writes: q4, q4-g32, q4-g128, q8,"),
        "{e}"
    );
    assert!(!tmp.path().join("out").exists());
}

#[test]
fn group_size_flag_is_the_named_group_format() {
    // `--format q4 --group-size 32` writes what `--format q4-g32` writes (mlx-lm's
    // `--q-group-size 32`); a size MLX lacks is refused, naming the sizes it has.
    let tmp = tempfile::tempdir().unwrap();
    let model = common::family("llama-tiny", tmp.path());
    let export = |format: &str, group: Option<usize>, out: &str| {
        let options = ExportOptions {
            output: Some(OutputFormat {
                writer: "mlx".into(),
                format: format.into(),
            }),
            force: true,
            ..ExportOptions::new(
                &model,
                tmp.path().join(out),
                Recipe {
                    group_size: group,
                    ..Recipe::new(Format::Nvfp4)
                },
            )
        };
        run(&options).map(|_| tmp.path().join(out))
    };
    let a = export("q4", Some(32), "flag").unwrap();
    let b = export("q4-g32", None, "named").unwrap();
    for f in ["model.safetensors", "config.json"] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
    let e = export("q4", Some(16), "bad").unwrap_err().to_string();
    assert!(
        e.contains("--group-size 16: q4 takes groups of 32, 64, 128"),
        "{e}"
    );
    let e = export("mxfp4", Some(64), "bad").unwrap_err().to_string();
    assert!(e.contains("mxfp4's groups are fixed"), "{e}");
}
