//! Memory stays flat as the model grows: the peak resident memory of `kiln export` (weight-only,
//! and calibrated) on a model of 16 layers is within a fraction of the 14 extra layers' size of
//! its peak on the same model with 2 (the export streams tensor by tensor and calibration runs
//! layer by layer; holding the model would add all of it).
//!
//! Its own test binary: the peak is read from `/proc/<pid>/status` (VmHWM) while the child runs,
//! and nothing else in this process starts children.

#![cfg(target_os = "linux")]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// A Llama of `layers` layers (hidden 256, intermediate 1024, vocab 1024, bf16 values from a
/// fixed sequence): config.json and model.safetensors. Returns the weights' bytes.
fn llama(dir: &Path, layers: usize) -> usize {
    let (h, i, v) = (256usize, 1024usize, 1024usize);
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": i, "vocab_size": v,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![v, h]),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (n, s) in [
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
            ("self_attn.q_proj", vec![h, h]),
            ("self_attn.k_proj", vec![h, h]),
            ("self_attn.v_proj", vec![h, h]),
            ("self_attn.o_proj", vec![h, h]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            shapes.push((format!("{p}.{n}.weight"), s));
        }
    }
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in &shapes {
        let bytes = shape.iter().product::<usize>() * 2;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend(text);
    // bf16 values in ±0.06 from a fixed LCG.
    let mut x = 12345u32;
    file.extend((0..offset / 2).flat_map(|_| {
        x = x.wrapping_mul(1664525).wrapping_add(1013904223);
        let f = ((x >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 0.125;
        half::bf16::from_f32(f).to_le_bytes()
    }));
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
    offset
}

/// The peak resident memory (VmHWM, KiB) of `kiln export --format FORMAT ARGS` on `model`.
fn peak_kib(model: &Path, out: &Path, format: &str, args: &[&Path]) -> u64 {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["export", "--force", "--format", format, "--model"])
        .arg(model)
        .args(args)
        .arg("--out")
        .arg(out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    while child.try_wait().unwrap().is_none() {
        // The high-water mark only grows: the last reading before the exit is the peak, but for
        // the process's last few milliseconds. Readings before the exec (the child still sharing
        // or copying this test's memory) are skipped by the process name.
        if let Ok(text) = std::fs::read_to_string(&status)
            && text.lines().any(|l| l == "Name:\tkiln")
            && let Some(kib) = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            peak = peak.max(kib);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(peak > 0, "no reading of the child's memory");
    peak
}

#[test]
fn export_memory_does_not_grow_with_the_number_of_layers() {
    // A weight-only export, and an FP8 export calibrated on 4 samples (the forward pass runs
    // layer by layer: one layer's weights and the samples' hidden states are held).
    let dir = tempfile::tempdir().unwrap();
    let small = llama(&dir.path().join("small"), 2);
    let large = llama(&dir.path().join("large"), 16);
    let calib = dir.path().join("calib.jsonl");
    let sample = |k: u32| {
        let ids: Vec<u32> = (0..64).map(|i| (i * 7 + k * 13) % 1024).collect();
        format!("{{\"input_ids\": {ids:?}}}\n")
    };
    std::fs::write(&calib, (0..4).map(sample).collect::<String>()).unwrap();
    let grown = (large - small) as u64 / 1024;
    for (format, args) in [
        ("int8-wo", vec![]),
        ("fp8", vec![Path::new("--calib"), calib.as_path()]),
    ] {
        let a = peak_kib(
            &dir.path().join("small"),
            &dir.path().join("a"),
            format,
            &args,
        );
        let b = peak_kib(
            &dir.path().join("large"),
            &dir.path().join("b"),
            format,
            &args,
        );
        eprintln!(
            "{format}: peak RSS {a} KiB with 2 layers ({} KiB of weights), {b} KiB with 16 ({} KiB)",
            small / 1024,
            large / 1024
        );
        assert!(
            b < a + grown / 4,
            "{format}: the peak grew by {} KiB for {grown} KiB more weights",
            b.saturating_sub(a)
        );
    }
}
