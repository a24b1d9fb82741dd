//! The candle forward pass against transformers: logits of the tiny reference models (written
//! by `tests/compat/logits_ref.py`, transformers 4.57 in float32, eager attention) must agree
//! within 1e-4 at every position; and every weight gets a gradient through it.

use kiln::checkpoint::Checkpoint;
use kiln::model::DecoderModel;
use kiln::model::candle::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

fn compat_dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/compat")
        .join(model)
}

/// The reference ids `[1, T]` and logits `[1, T, V]`.
fn reference(model: &str) -> (Vec<u32>, Vec<f32>, Vec<usize>) {
    let bytes = std::fs::read(compat_dir(model).join("logits.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    let ids: Vec<u32> = ids
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let logits = st.tensor("logits").unwrap();
    let shape = logits.shape().to_vec();
    let logits: Vec<f32> = logits
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (ids, logits, shape)
}

fn max_abs_diff(model: &str) -> f32 {
    let c = Checkpoint::open(compat_dir(model).join("model")).unwrap();
    let m = DecoderModel::load(&c, DType::F32, &Device::Cpu).unwrap();
    let (ids, want, shape) = reference(model);
    let ids = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
    let got = m.forward(&ids).unwrap();
    assert_eq!(got.dims(), shape.as_slice(), "{model}: logits shape");
    let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
    got.iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

#[test]
fn logits_match_transformers_for_every_family() {
    for model in [
        "llama-tiny",
        "llama3-rope-tiny",
        "mistral-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
        "qwen3-moe-tiny",
        "mixtral-tiny",
    ] {
        let d = max_abs_diff(model);
        println!("{model}: max |Δlogit| = {d:.3e}");
        assert!(
            d <= 1e-4,
            "{model}: logits differ from transformers by {d:e}"
        );
    }
}

#[test]
fn every_weight_gets_a_gradient() {
    // Through MoE routing and attention alike: the forward is built from differentiable ops.
    for model in ["qwen3-tiny", "mixtral-tiny"] {
        let c = Checkpoint::open(compat_dir(model).join("model")).unwrap();
        let m = DecoderModel::load(&c, DType::F32, &Device::Cpu).unwrap();
        let ids = Tensor::new(&[[3u32, 17, 42, 99, 5, 200, 7, 1]], &Device::Cpu).unwrap();
        let loss = m.forward(&ids).unwrap().sqr().unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let missing: Vec<&String> = m
            .weights()
            .vars()
            .iter()
            .filter(|(_, v)| {
                grads.get(v.as_tensor()).is_none_or(|g| {
                    g.abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                        == 0.0
                })
            })
            .map(|(n, _)| n)
            .collect();
        // Experts the 8 tokens never reach get no gradient: that is routing, not a cut graph.
        let missing: Vec<&&String> = missing
            .iter()
            .filter(|n| !n.contains(".experts."))
            .collect();
        assert!(missing.is_empty(), "{model}: no gradient for {missing:?}");
    }
}
