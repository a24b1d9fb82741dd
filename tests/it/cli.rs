//! The `kiln` binary itself: `kiln registry` output and exit codes.

use std::process::Command;

use crate::common;

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
    for kind in ["exporters", "trainers", "architectures", "rewards"] {
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
    assert!(
        text.contains("backend candle: bco, distill, dpo, grpo, kto, online_dpo, orpo, ppo, pretrain, reward, rloo, sft, simpo"),
        "{text}"
    );
}

#[test]
fn registry_rewards_lists_the_built_in_reward_functions() {
    let out = kiln(&["registry", "rewards"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("rewards ("), "{text}");
    for name in ["exact_match", "length", "regex"] {
        assert!(text.contains(name), "{text}");
    }
}

#[test]
fn bad_usage_exits_2_with_a_message() {
    let out = kiln(&["registry", "modules"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("invalid value 'modules'"), "{err}");
    assert!(err.contains("exporters, trainers, architectures"), "{err}");
}

#[test]
fn export_without_a_model_exports_the_demo_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let out = kiln(&[
        "export",
        "--format",
        "fp8",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("using kiln's built-in demo model"),
        "{stderr}"
    );
    assert!(
        stdout.contains("exported LlamaForCausalLM (known family) as fp8"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "quantized modules: 28 (fp8: 28); left unquantized: lm_head, model.embed_tokens"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("(copied unchanged)"), "{stdout}");
    assert!(
        stdout.contains("fp8 error vs the original weights: max |Δ| "),
        "{stdout}"
    );
    for f in [
        "model.safetensors",
        "config.json",
        "hf_quant_config.json",
        "generation_config.json",
    ] {
        assert!(out_dir.join(f).exists(), "{f}");
    }
    // A second run into the same folder is refused without --force, and leaves it intact.
    let again = kiln(&[
        "export",
        "--format",
        "fp8",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        String::from_utf8(again.stderr)
            .unwrap()
            .contains("already exists (pass --force to replace it)")
    );
    assert!(out_dir.join("model.safetensors").exists());
}

#[test]
fn export_errors_are_clear_and_nonzero() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let cases: [(Vec<&str>, &str); 3] = [
        (
            vec!["export", "--model", missing.to_str().unwrap(), "--out", "x"],
            "missing/config.json: No such file or directory (os error 2)\n",
        ),
        (
            vec!["export", "--model", missing.to_str().unwrap()],
            "--out is required with --model",
        ),
        (
            vec!["export", "--calib", "missing.jsonl"],
            "--calib: missing.jsonl: No such file or directory",
        ),
    ];
    for (args, want) in cases {
        let out = kiln(&args);
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    let bad = kiln(&["export", "--max-shard-size", "5XB"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8(bad.stderr)
            .unwrap()
            .contains("unknown unit `XB`")
    );
}

#[test]
fn explain_lists_each_module_with_its_exporter_and_why() {
    let out = kiln(&["explain", "--format", "nvfp4"]);
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("LlamaForCausalLM: "), "{stdout}");
    assert!(stdout.contains("model.layers.0.self_attn.q_proj [Linear]: kiln_runtime::export::linear::QuantLinear (key Linear) → nvfp4"), "{stdout}");
    assert!(stdout.contains("lm_head [Linear]: kiln_runtime::export::linear::QuantLinear (key Linear) → excluded, copied unchanged"), "{stdout}");
    assert!(
        stdout.contains("model.norm [LlamaRMSNorm]: unchanged (no exporter matches)"),
        "{stdout}"
    );
}

/// Every implemented format exports the demo from the command line, and names itself as
/// ModelOpt 0.47 does (the `quant_algo` of the committed ModelOpt export of the same format).
#[test]
fn every_format_exports_the_demo_with_modelopts_quant_algo() {
    let dir = tempfile::tempdir().unwrap();
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny");
    let algo = |path: &std::path::Path| -> serde_json::Value {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["quantization"]["quant_algo"].clone()
    };
    for format in [
        "fp8",
        "fp8-per-channel",
        "fp8-block",
        "int8-wo",
        "int8-sq",
        "int4-awq",
        "w4a8-awq",
        "nvfp4",
        "nvfp4-awq",
        "w4a16-nvfp4",
        "mxfp4",
        "mxfp8",
    ] {
        let out_dir = dir.path().join(format);
        let out = kiln(&[
            "export",
            "--format",
            format,
            "--out",
            out_dir.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{format}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            algo(&out_dir.join("hf_quant_config.json")),
            algo(&compat.join(format).join("modelopt/hf_quant_config.json")),
            "{format}"
        );
    }
}

/// `--calib`: kiln runs the model on the token ids and uses the activation amax it sees; the
/// input scales land within 1 % of ModelOpt's from the same ids (ModelOpt computes in bf16).
#[test]
fn export_with_calibration_gives_modelopts_input_scales() {
    let dir = tempfile::tempdir().unwrap();
    // Dense, MoE (experts calibrated on their routed tokens) and GPT-OSS (attention sinks, YaRN,
    // BMM experts with their own input quantizer names); FP8 and NVFP4 input scales, FP8
    // KV-cache scales.
    for (model, export, tokens, dtype) in [
        ("llama-tiny", "fp8", "4 samples (128 tokens)", "f32"),
        ("llama-tiny", "nvfp4", "4 samples (128 tokens)", "f32"),
        ("llama-tiny", "fp8+kv-fp8", "4 samples (128 tokens)", "bf16"),
        ("mixtral-tiny", "nvfp4", "2 samples (32 tokens)", "f32"),
        ("qwen3-moe-tiny", "fp8", "1 samples (6 tokens)", "bf16"),
        ("gpt-oss-tiny", "fp8", "2 samples (32 tokens)", "f32"),
    ] {
        let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/compat")
            .join(model);
        let out_dir = dir.path().join(format!("{model}-{export}-{dtype}"));
        let (format, kv) = export.split_once("+kv-").unwrap_or((export, ""));
        let mut args = vec![
            "export",
            "--model",
            compat.join("model").to_str().unwrap(),
            "--format",
            format,
            "--calib",
            compat.join("calib.jsonl").to_str().unwrap(),
            "--calib-dtype",
            dtype,
            "--out",
            out_dir.to_str().unwrap(),
        ]
        .into_iter()
        .map(str::to_string)
        .collect::<Vec<_>>();
        if !kv.is_empty() {
            args.extend(["--kv-cache".to_string(), kv.to_string()]);
        }
        let out = kiln(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{model} {export}: {stderr}");
        assert!(
            stderr.contains(&format!("calibrating on {tokens}")),
            "{stderr}"
        );
        // Every activation scale: `input_scale` (NVFP4: amax / 2688), `k_scale`, `v_scale`.
        let read = |p: &std::path::Path| {
            let bytes = std::fs::read(p.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            st.names()
                .into_iter()
                .filter(|n| {
                    n.ends_with("input_scale") || n.ends_with("k_scale") || n.ends_with("v_scale")
                })
                .map(|n| {
                    let v = st.tensor(n).unwrap();
                    (
                        n.to_string(),
                        f32::from_le_bytes(v.data()[..4].try_into().unwrap()),
                    )
                })
                .collect::<std::collections::BTreeMap<String, f32>>()
        };
        let (ours, theirs) = (read(&out_dir), read(&compat.join(export).join("modelopt")));
        assert!(!theirs.is_empty(), "{model} {export}");
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{model} {export}"
        );
        for (name, t) in &theirs {
            let o = ours[name];
            assert!(
                (o - t).abs() <= 0.01 * t,
                "{model} {export} {name}: kiln {o}, ModelOpt {t}"
            );
        }
    }
    // Text is tokenized with the model's tokenizer.json: the demo model ships its byte-level
    // tokenizer (a folder without one is a named error: runtime/src/model/calib.rs).
    let text = dir.path().join("text.jsonl");
    std::fs::write(&text, "{\"text\": \"hello, calibration\"}\n").unwrap();
    let out = kiln(&[
        "export",
        "--format",
        "fp8",
        "--calib",
        text.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The tensors of a single-file export: name → (dtype, shape).
fn layout(dir: &std::path::Path) -> std::collections::BTreeMap<String, (String, Vec<usize>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (format!("{:?}", v.dtype()), v.shape().to_vec())))
        .collect()
}

/// `--calib` with the AWQ formats: kiln searches the scales itself (awq_lite) and writes the
/// checkpoint ModelOpt writes — the same tensors, dtypes and shapes, the norms folded — and
/// reports the α it chose.
#[test]
fn export_with_calibration_searches_awq_scales() {
    let dir = tempfile::tempdir().unwrap();
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny");
    for format in ["int4-awq", "w4a8-awq", "nvfp4-awq"] {
        let out_dir = dir.path().join(format);
        let out = kiln(&[
            "export",
            "--model",
            compat.join("model").to_str().unwrap(),
            "--format",
            format,
            "--calib",
            compat.join("calib.jsonl").to_str().unwrap(),
            "--out",
            out_dir.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{format}: {stderr}");
        assert!(
            stderr.contains("AWQ (awq_lite, alpha step 0.1): searched 14 Linears on 128 tokens"),
            "{stderr}"
        );
        assert_eq!(
            layout(&out_dir),
            layout(&compat.join(format).join("modelopt")),
            "{format}"
        );
    }
}

/// A copy of ModelOpt's tiny-Llama FP8 export with `edit` applied to its tensors.
fn corrupted_export(
    dir: &std::path::Path,
    edit: impl Fn(&str, &mut Vec<u8>) -> bool,
) -> std::path::PathBuf {
    corrupted_copy("llama-tiny/fp8", dir, edit)
}

/// [`corrupted_export`] of ModelOpt's export `tests/compat/<export>/modelopt`: tensors for
/// which `edit` returns false are dropped.
fn corrupted_copy(
    export: &str,
    dir: &std::path::Path,
    edit: impl Fn(&str, &mut Vec<u8>) -> bool,
) -> std::path::PathBuf {
    edited_export(
        dir,
        export,
        "corrupted",
        |t| t.retain_mut(|(name, _, _, data)| edit(name, data)),
        |_, _| {},
    )
}

/// `kiln verify --reference R --quantized Q EXTRA…`: (exit code, stdout).
fn run_verify(
    reference: &std::path::Path,
    quantized: &std::path::Path,
    extra: &[&str],
) -> (Option<i32>, String) {
    let mut args = vec![
        "verify",
        "--reference",
        reference.to_str().unwrap(),
        "--quantized",
        quantized.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = kiln(&args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).to_string(),
    )
}

#[test]
fn verify_passes_a_good_export_and_fails_corrupted_ones() {
    let dir = tempfile::tempdir().unwrap();
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny");
    let reference = compat.join("model");
    let data = compat.join("calib.jsonl");
    let verify = |quantized: &std::path::Path| {
        run_verify(
            &reference,
            quantized,
            &["--data", data.to_str().unwrap(), "--max-ppl-increase", "1"],
        )
    };
    let (code, text) = verify(&compat.join("fp8/modelopt"));
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.starts_with("ok: FP8 — 14 quantized Linears decode"),
        "{text}"
    );
    assert!(text.contains("perplexity: reference 254.15"), "{text}");

    // A scale missing: the engine would refuse it.
    let missing = corrupted_export(dir.path(), |name, _| {
        name != "model.layers.0.mlp.down_proj.weight_scale"
    });
    let (code, text) = verify(&missing);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("FAIL `model.layers.0.mlp.down_proj.weight` is quantized (F8_E4M3) but `model.layers.0.mlp.down_proj.weight_scale` is missing"),
        "{text}"
    );
    std::fs::remove_dir_all(&missing).unwrap();

    // A scale off by 1000×: every tensor is there, but the model silently lost accuracy.
    let scaled = corrupted_export(dir.path(), |name, data| {
        if name == "model.layers.0.mlp.down_proj.weight_scale" {
            let v = f32::from_le_bytes(data[..4].try_into().unwrap()) * 1000.0;
            data.copy_from_slice(&v.to_le_bytes());
        }
        true
    });
    let (code, text) = verify(&scaled);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("FAIL `model.layers.0.mlp.down_proj` decodes to a weight 9.979e2 away from the reference's"),
        "{text}"
    );

    // A perplexity threshold the export does not meet.
    let out = kiln(&[
        "verify",
        "--reference",
        reference.to_str().unwrap(),
        "--quantized",
        compat.join("int4-awq/modelopt").to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--max-ppl-increase",
        "0.01",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL perplexity rose 0.15 %, more than --max-ppl-increase 0.01 %"),
        "{text}"
    );
}

/// GPT-OSS: BMM experts stay 3-D in the export; verify decodes and compares them, and names a
/// missing expert scale.
#[test]
fn verify_checks_bmm_experts() {
    let dir = tempfile::tempdir().unwrap();
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/gpt-oss-tiny");
    let verify = |quantized: &std::path::Path| run_verify(&compat.join("model"), quantized, &[]);
    let (code, text) = verify(&compat.join("nvfp4/modelopt"));
    assert_eq!(code, Some(0), "{text}");
    // 8 attention Linears and the 4 expert tensors.
    assert!(
        text.starts_with("ok: NVFP4 — 12 quantized Linears decode"),
        "{text}"
    );
    let broken = corrupted_copy("gpt-oss-tiny/nvfp4", dir.path(), |name, _| {
        name != "model.layers.1.mlp.experts.down_proj_weight_scale"
    });
    let (code, text) = verify(&broken);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("`model.layers.1.mlp.experts.down_proj` is quantized (U8) but `model.layers.1.mlp.experts.down_proj_weight_scale` is missing"),
        "{text}"
    );
}

/// `--device`: a GPU this build has no backend for is a named error, exit 1.
#[test]
fn a_device_without_its_feature_is_a_named_error() {
    if cfg!(feature = "candle-cuda") {
        println!("skipped: built with candle-cuda, so `--device cuda` may work here");
        return;
    }
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny");
    let out = kiln(&[
        "eval",
        "--model",
        compat.join("model").to_str().unwrap(),
        "--data",
        compat.join("calib.jsonl").to_str().unwrap(),
        "--device",
        "cuda:0",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("device `cuda:0`: kiln was built without feature `candle-cuda`"),
        "{stderr}"
    );
    let out = kiln(&[
        "eval",
        "--model",
        compat.join("model").to_str().unwrap(),
        "--data",
        compat.join("calib.jsonl").to_str().unwrap(),
        "--device",
        "tpu",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown kind `tpu`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--awq-clip` (ModelOpt's `awq_full`): the clipping search after the scale search writes
/// ModelOpt's layout; formats other than int4-awq are refused by name.
#[test]
fn awq_clip_search_exports_and_names_what_it_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny");
    let run = |format: &str, out: &std::path::Path| {
        kiln(&[
            "export",
            "--model",
            compat.join("model").to_str().unwrap(),
            "--format",
            format,
            "--calib",
            compat.join("calib.jsonl").to_str().unwrap(),
            "--awq-clip",
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let out_dir = dir.path().join("int4-awq");
    let out = run("int4-awq", &out_dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("AWQ clipping search: "), "{stderr}");
    assert_eq!(
        layout(&out_dir),
        layout(&compat.join("int4-awq-full/modelopt"))
    );
    let out = run("w4a8-awq", &dir.path().join("w4a8"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--awq-clip: the clipping search runs for int4-awq only, not w4a8-awq"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

type Tensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// A copy of ModelOpt's export `tests/compat/<export>/modelopt` in `dir/name`, its tensors
/// and its two JSON files (`hf_quant_config.json`, `config.json`) edited.
fn edited_export(
    dir: &std::path::Path,
    export: &str,
    name: &str,
    tensors: impl Fn(&mut Tensors),
    json: impl Fn(&mut serde_json::Value, &mut serde_json::Value),
) -> std::path::PathBuf {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/compat")
        .join(export)
        .join("modelopt");
    let dst = dir.join(name);
    std::fs::create_dir_all(&dst).unwrap();
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(src.join(f)).unwrap()).unwrap()
    };
    let (mut hf, mut config) = (read("hf_quant_config.json"), read("config.json"));
    json(&mut hf, &mut config);
    std::fs::write(dst.join("hf_quant_config.json"), hf.to_string()).unwrap();
    std::fs::write(dst.join("config.json"), config.to_string()).unwrap();
    edit_tensors(&src, &dst, tensors);
    dst
}

/// `dst/model.safetensors`: `src/model.safetensors` with its tensors edited by `tensors`.
fn edit_tensors(src: &std::path::Path, dst: &std::path::Path, tensors: impl Fn(&mut Tensors)) {
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut all: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    tensors(&mut all);
    let views: Vec<(String, safetensors::tensor::TensorView)> = all
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}

#[test]
fn verify_checks_what_an_engine_checks() {
    let dir = tempfile::tempdir().unwrap();
    let reference =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny/model");
    let verify = |q: &std::path::Path| run_verify(&reference, q, &[]);
    let fail = |q: &std::path::Path, want: &str| {
        let (code, text) = verify(q);
        assert_eq!(code, Some(1), "{text}");
        assert!(text.contains(want), "expected `{want}` in:\n{text}");
    };
    let no_json_edit = |_: &mut serde_json::Value, _: &mut serde_json::Value| {};

    // An FP8 lm_head (weight + scales) while both configs still exclude it: vLLM would load
    // the F8_E4M3 bytes as a bf16 weight.
    let fp8_head = edited_export(
        dir.path(),
        "llama-tiny/fp8",
        "fp8-head",
        |t| {
            let head = t.iter_mut().find(|x| x.0 == "lm_head.weight").unwrap();
            head.1 = safetensors::Dtype::F8_E4M3;
            head.3 = head.3.chunks(2).map(|b| b[1]).collect();
            for s in ["lm_head.weight_scale", "lm_head.input_scale"] {
                t.push((
                    s.into(),
                    safetensors::Dtype::F32,
                    vec![],
                    0.01f32.to_le_bytes().to_vec(),
                ));
            }
        },
        no_json_edit,
    );
    fail(
        &fp8_head,
        "FAIL `lm_head` is listed as excluded (`lm_head`), but `lm_head.weight` is F8_E4M3",
    );

    // Tensors that do not have the declared format's layout.
    let mislabelled = edited_export(
        dir.path(),
        "llama-tiny/fp8",
        "nvfp4-label",
        |_| {},
        |hf, config| {
            hf["quantization"]["quant_algo"] = "NVFP4".into();
            config["quantization_config"]["quant_algo"] = "NVFP4".into();
        },
    );
    fail(
        &mislabelled,
        "FAIL `model.layers.0.self_attn.q_proj` is declared NVFP4, but `weight` is F8_E4M3 [128, 128], the format has U8 [128, 64]",
    );

    // The architecture fields an engine sizes its buffers by.
    let no_heads = edited_export(
        dir.path(),
        "llama-tiny/fp8",
        "no-heads",
        |_| {},
        |_, config| {
            config
                .as_object_mut()
                .unwrap()
                .remove("num_attention_heads");
            config["num_hidden_layers"] = 3.into();
        },
    );
    fail(&no_heads, "FAIL config.json has no `num_attention_heads`");
    fail(
        &no_heads,
        "FAIL config.json says num_hidden_layers 3, the checkpoint has 2 layers",
    );

    // A NaN the reference does not have (E4M3's NaN is 0x7F).
    let nan = edited_export(
        dir.path(),
        "llama-tiny/fp8",
        "nan",
        |t| {
            let w = t
                .iter_mut()
                .find(|x| x.0 == "model.layers.1.mlp.up_proj.weight")
                .unwrap();
            w.3[17] = 0x7F;
            // And an Inf in a copied norm (bf16 0x7F80).
            let norm = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
            norm.3[2..4].copy_from_slice(&[0x80, 0x7F]);
        },
        no_json_edit,
    );
    fail(
        &nan,
        "FAIL `model.norm.weight` holds 1 NaN/Inf value(s); the reference has 0",
    );
    // Once the structure is sound, the decoded weights are checked too.
    let nan_weight = edited_export(
        dir.path(),
        "llama-tiny/fp8",
        "nan-weight",
        |t| {
            let w = t
                .iter_mut()
                .find(|x| x.0 == "model.layers.1.mlp.up_proj.weight")
                .unwrap();
            w.3[17] = 0x7F;
        },
        no_json_edit,
    );
    fail(
        &nan_weight,
        "FAIL `model.layers.1.mlp.up_proj.weight` decodes to 1 NaN/Inf value(s); the reference has 0",
    );
}

/// BMM experts' scales must have the declared format's 3-D layout (docs/FORMATS.md §4.3c):
/// the same bytes under another shape are refused before anything is decoded.
#[test]
fn verify_checks_the_layout_of_bmm_experts() {
    let dir = tempfile::tempdir().unwrap();
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/gpt-oss-tiny");
    let reshaped = edited_export(
        dir.path(),
        "gpt-oss-tiny/nvfp4",
        "reshaped",
        |t| {
            let s = t
                .iter_mut()
                .find(|x| x.0 == "model.layers.1.mlp.experts.gate_up_proj_weight_scale")
                .unwrap();
            assert_eq!(s.2, [4, 4, 64]);
            s.2 = vec![4, 64, 4];
        },
        |_, _| {},
    );
    let (code, text) = run_verify(&compat.join("model"), &reshaped, &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("FAIL `model.layers.1.mlp.experts.gate_up_proj` is declared NVFP4, but `weight_scale` is F8_E4M3 [4, 64, 4], the format has F8_E4M3 [4, 4, 64]"),
        "{text}"
    );
}

/// Fused 3-D experts (transformers 5's layout) are written as per-expert Linears; verify
/// compares each with its slice of the reference's fused tensor.
#[test]
fn verify_compares_fused_experts_slice_by_slice() {
    let dir = tempfile::tempdir().unwrap();
    let compat =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/qwen3-moe-fused-tiny");
    let verify = |q: &std::path::Path| run_verify(&compat.join("model"), q, &[]);
    let (code, text) = verify(&compat.join("fp8/modelopt"));
    assert_eq!(code, Some(0), "{text}");
    // 4 attention Linears and 4 experts × 3 per layer.
    assert!(
        text.starts_with("ok: FP8 — 32 quantized Linears decode"),
        "{text}"
    );
    // Expert 1's gate and up swapped: every tensor is there, the slices are wrong.
    let swapped = edited_export(
        dir.path(),
        "qwen3-moe-fused-tiny/fp8",
        "swapped",
        |t| {
            let find = |t: &Tensors, n: &str| t.iter().position(|x| x.0 == n).unwrap();
            let e = "model.layers.0.mlp.experts.1";
            let (g, u) = (
                find(t, &format!("{e}.gate_proj.weight")),
                find(t, &format!("{e}.up_proj.weight")),
            );
            let gate = t[g].3.clone();
            t[g].3 = t[u].3.clone();
            t[u].3 = gate;
        },
        |_, _| {},
    );
    let (code, text) = verify(&swapped);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("FAIL `model.layers.0.mlp.experts.1.gate_proj` decodes to a weight"),
        "{text}"
    );
}

/// A copy of the export at `src` with its tensors edited (`edit` returns false to drop one).
fn edited_copy(
    src: &std::path::Path,
    dst: &std::path::Path,
    edit: impl Fn(&str, &mut Vec<u8>) -> bool,
) -> std::path::PathBuf {
    std::fs::create_dir_all(dst).unwrap();
    std::fs::copy(src.join("config.json"), dst.join("config.json")).unwrap();
    edit_tensors(src, dst, |t| {
        t.retain_mut(|(name, _, _, data)| edit(name, data))
    });
    dst.to_path_buf()
}

#[test]
fn compressed_tensors_exports_verify_and_eval_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let compat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny");
    let (reference, data) = (compat.join("model"), compat.join("calib.jsonl"));
    // The README's command: the demo model, FP8 with its static input scales from the demo's
    // statistics.
    let out = kiln(&[
        "export",
        "--output-format",
        "compressed-tensors",
        "--format",
        "fp8",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("as compressed-tensors fp8"), "{text}");
    // A real model, INT4 with zero points; verify and eval read it back.
    let ct = dir.path().join("w4a16-asym");
    let out = kiln(&[
        "export",
        "--model",
        reference.to_str().unwrap(),
        "--out",
        ct.to_str().unwrap(),
        "--output-format",
        "compressed-tensors",
        "--format",
        "w4a16-asym",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verify = |q: &std::path::Path| {
        run_verify(
            &reference,
            q,
            &["--data", data.to_str().unwrap(), "--max-ppl-increase", "2"],
        )
    };
    let (code, text) = verify(&ct);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.starts_with("ok: compressed-tensors pack-quantized — 14 quantized Linears decode"),
        "{text}"
    );
    assert!(text.contains("perplexity: reference 254.15"), "{text}");
    let out = kiln(&[
        "eval",
        "--model",
        ct.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("perplexity"), "{text}");
    // A scale 1000× off, and a missing zero point: verify names each.
    let scaled = edited_copy(&ct, &dir.path().join("scaled"), |name, data| {
        if name == "model.layers.0.mlp.down_proj.weight_scale" {
            for c in data.chunks_exact_mut(2) {
                let v = half::bf16::from_le_bytes([c[0], c[1]]).to_f32() * 1000.0;
                c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
        }
        true
    });
    let (code, text) = verify(&scaled);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("FAIL `model.layers.0.mlp.down_proj` decodes to a weight"),
        "{text}"
    );
    let no_zp = edited_copy(&ct, &dir.path().join("no-zp"), |name, _| {
        name != "model.layers.1.self_attn.q_proj.weight_zero_point"
    });
    let (code, text) = verify(&no_zp);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("does not decode")
            && text.contains("model.layers.1.self_attn.q_proj")
            && text.contains("no weight_zero_point"),
        "{text}"
    );
}

#[test]
fn a_tensor_shape_config_json_contradicts_is_refused() {
    // The tiny Llama with one `gate_proj.weight` whose header lists its dimensions swapped:
    // the same bytes, so only config.json can tell. The export names the tensor, the shape
    // config.json implies and the one found, exits 1, and writes nothing.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    let src =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny/model");
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
    }
    let file = model.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let name = "model.layers.1.mlp.gate_proj.weight";
    let shape = header[name]["shape"].as_array_mut().unwrap();
    shape.reverse();
    let found = format!("[{}, {}]", shape[0], shape[1]);
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(n.max(text.len()).next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(&text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(&file, out).unwrap();
    let target = dir.path().join("out");
    let run = kiln(&[
        "export",
        "--model",
        model.to_str().unwrap(),
        "--format",
        "int8-wo",
        "--out",
        target.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8(run.stderr).unwrap();
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "tensor `{name}`: shape {found}, but config.json implies [256, 128]"
        )),
        "{stderr}"
    );
    assert!(!target.exists(), "nothing is written");
}

#[test]
fn every_writer_writes_the_same_bytes_whatever_the_thread_count() {
    // The tiny Llama through each writer, on one thread, on three, and again on the default
    // pool: every file of the three outputs byte for byte the same (the GGUF writer's MoE
    // layouts: tests/it/gguf_export.rs).
    let dir = tempfile::tempdir().unwrap();
    let model = common::family("llama-tiny", dir.path());
    let files = |out: &std::path::Path| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(out)
            .unwrap()
            .map(|f| {
                let f = f.unwrap().path();
                let name = f.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&f).unwrap())
            })
            .collect();
        v.sort();
        v
    };
    for (writer, format) in [
        ("modelopt", "w4a16-nvfp4"),
        ("modelopt", "int8-wo"),
        ("compressed-tensors", "w4a16-asym"),
        ("compressed-tensors", "nvfp4a16"),
        ("gguf", "q4-k-m"),
        ("mlx", "q4"),
        ("mlx", "mxfp4"),
    ] {
        let mut runs = Vec::new();
        for threads in ["1", "3", ""] {
            let out = dir.path().join(format!("{writer}-{format}-{}", runs.len()));
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
            cmd.args(["export", "--model"])
                .arg(&model)
                .args(["--output-format", writer, "--format", format, "--out"])
                .arg(&out);
            if threads.is_empty() {
                cmd.env_remove("RAYON_NUM_THREADS");
            } else {
                cmd.env("RAYON_NUM_THREADS", threads);
            }
            let run = cmd.output().unwrap();
            assert!(
                run.status.success(),
                "{writer} {format}: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            runs.push(files(&out));
        }
        assert!(!runs[0].is_empty());
        for (i, r) in runs.iter().enumerate().skip(1) {
            assert_eq!(
                r.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                runs[0].iter().map(|(n, _)| n).collect::<Vec<_>>(),
                "{writer} {format}: run {i}'s files"
            );
            for ((name, a), (_, b)) in r.iter().zip(&runs[0]) {
                assert!(a == b, "{writer} {format}: `{name}` differs in run {i}");
            }
        }
    }
}

/// The README's first command does what its comment says: `kiln export` with no arguments
/// quantizes the demo model to the format the README names, in the layout it names.
#[test]
fn the_readmes_first_command_reports_the_format_the_readme_names() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.starts_with("cargo run") && l.contains("-- export"))
        .expect("the README's export command");
    let comment = line.split('#').nth(1).expect("its comment").to_lowercase();
    let o = kiln(&[
        "export",
        "--out",
        &tempfile::tempdir()
            .unwrap()
            .path()
            .join("o")
            .display()
            .to_string(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let reported = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("exported ")
                .and_then(|r| r.split(" as ").nth(1))
        })
        .and_then(|r| r.split(" to ").next())
        .expect("the format reported")
        .to_string();
    // The ModelOpt writer reports its format alone; other writers as `writer format`.
    assert!(
        comment.contains(&format!("to {reported},")) && comment.contains("modelopt"),
        "the README says `{comment}`, kiln exported `{reported}`"
    );
    assert!(text.contains("engines: loads in vLLM"), "{text}");
}

/// `kiln export --help` names every registered writer and each one's default format.
#[test]
fn export_help_lists_the_registrys_writers_and_defaults() {
    let o = kiln(&["export", "--help"]);
    let text = String::from_utf8_lossy(&o.stdout);
    for w in ["modelopt", "compressed-tensors", "gguf", "mlx"] {
        assert!(text.contains(w), "{w}: {text}");
    }
    for d in [
        "modelopt fp8",
        "compressed-tensors fp8-dynamic",
        "gguf q4-k-m",
        "mlx q4",
    ] {
        assert!(text.contains(d), "{d}: {text}");
    }
    assert!(!text.contains("ModelOpt-format checkpoint"), "{text}");
}

/// scripts/mlx/setup.sh looks for the libclang bindgen loads, not any `libclang*` file: on the
/// machine image's layout (libclang-cpp14 and LLVM's libraries only) it installs libclang-dev,
/// and with a `libclang-N.so.M` present it does not.
#[test]
fn mlx_setup_installs_libclang_when_only_libclang_cpp_is_there() {
    let root = tempfile::tempdir().unwrap();
    let lib = root.path().join("usr/lib/llvm-14/lib");
    std::fs::create_dir_all(&lib).unwrap();
    for f in ["libclang-cpp.so.14", "libLLVM-14.so", "libLLVM.so"] {
        std::fs::write(lib.join(f), b"").unwrap();
    }
    let needs = || {
        let o = Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/mlx/setup.sh"))
            .arg("--needs")
            .env("MLX_SETUP_ROOT_FS", root.path())
            .env_remove("LIBCLANG_PATH")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert!(needs().lines().any(|l| l == "libclang-dev"), "{}", needs());
    std::fs::write(lib.join("libclang-14.so.1"), b"").unwrap();
    assert!(!needs().lines().any(|l| l == "libclang-dev"), "{}", needs());
}

/// A model whose widths (192, 320) are not whole blocks of 128: int4-awq with --calib is
/// refused before calibration starts, in one error naming every module, the --exclude that
/// leaves them out and the formats that take them; the fix it names then works.
#[test]
fn an_export_the_format_cannot_take_is_refused_before_calibration() {
    use kiln_runtime::demo::{DemoConfig, write_demo_model};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    write_demo_model(
        &model,
        DemoConfig {
            hidden: 192,
            intermediate: 320,
            layers: 2,
            heads: 3,
            kv_heads: 1,
            vocab: 256,
        },
    )
    .unwrap();
    let calib = dir.path().join("calib.jsonl");
    std::fs::write(&calib, "{\"input_ids\": [1, 2, 3, 4, 5, 6]}\n").unwrap();
    let out = dir.path().join("out");
    let (m, c, o) = (
        model.display().to_string(),
        calib.display().to_string(),
        out.display().to_string(),
    );
    let r = kiln(&[
        "export", "--model", &m, "--format", "int4-awq", "--calib", &c, "--out", &o,
    ]);
    assert_eq!(r.status.code(), Some(1));
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(!e.contains("calibrating"), "calibrated first: {e}");
    assert!(
        e.contains("modelopt int4-awq cannot quantize 14 module(s)"),
        "{e}"
    );
    assert!(
        e.contains(
            "320 input features are not whole blocks of 128; --group-size 32 or --group-size \
             64 would fit"
        ),
        "{e}"
    );
    assert!(
        e.contains("--exclude 'model.layers.*.mlp.down_proj'"),
        "{e}"
    );
    assert!(e.contains("choose a format that takes them: fp8,"), "{e}");
    assert!(!out.exists());
    // The fix it names: ModelOpt's INT4 blocks of 64.
    let r = kiln(&[
        "export",
        "--model",
        &m,
        "--format",
        "int4-awq",
        "--group-size",
        "64",
        "--calib",
        &c,
        "--out",
        &o,
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("hf_quant_config.json")).unwrap())
            .unwrap();
    assert_eq!(hf["quantization"]["group_size"], 64);
    std::fs::remove_dir_all(&out).unwrap();
    // compressed-tensors w4a16 names every module too, not the first.
    let r = kiln(&[
        "export",
        "--model",
        &m,
        "--output-format",
        "compressed-tensors",
        "--format",
        "w4a16",
        "--exclude",
        "model.layers.*.self_attn.*",
        "--out",
        &o,
    ]);
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(e.contains("cannot quantize 6 module(s)"), "{e}");
    assert!(e.contains("`model.layers.1.mlp.down_proj`"), "{e}");
    // The fix it names: leave the projections unquantized.
    let mut args = vec![
        "export",
        "--model",
        &m,
        "--output-format",
        "compressed-tensors",
    ];
    args.extend(["--format", "w4a16", "--out", &o]);
    for g in ["model.layers.*.self_attn.*", "model.layers.*.mlp.*"] {
        args.extend(["--exclude", g]);
    }
    let r = kiln(&args);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}
