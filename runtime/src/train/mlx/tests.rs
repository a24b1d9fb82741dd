//! The losses, written once over `TensorOps`, give the same values and the same gradients on
//! MLX as on candle: every loss variant on the same inputs, ties included (GRPO's first pass,
//! where the clipped and unclipped terms are equal).

use super::MlxOps;
use crate::train::candle::ops::CandleOps;
use crate::train::losses::{self, *};
use crate::train::ops::TensorOps;
use candle_core::{Device, Tensor, Var};
use mlx_rs::Array;

/// The inputs every loss below is built from: (values, shape).
fn inputs() -> Vec<(Vec<f32>, Vec<usize>)> {
    let mut g = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = move || {
        g ^= g << 13;
        g ^= g >> 7;
        g ^= g << 17;
        (g >> 11) as f32 / (1u64 << 53) as f32
    };
    let logps: Vec<f32> = (0..24).map(|_| -0.05 - 3.0 * uniform()).collect();
    let old: Vec<f32> = logps.iter().map(|v| v + 0.4 * (uniform() - 0.5)).collect();
    let reference: Vec<f32> = logps.iter().map(|v| v + 0.2 * (uniform() - 0.5)).collect();
    let seq = |n: usize, lo: f32, hi: f32, u: &mut dyn FnMut() -> f32| -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * u()).collect()
    };
    vec![
        (logps, vec![4, 6]),                          // 0 per-token log-probs
        (old, vec![4, 6]),                            // 1 sampling log-probs
        (reference, vec![4, 6]),                      // 2 reference log-probs
        (seq(3, -9.0, -1.0, &mut uniform), vec![3]),  // 3 chosen sums
        (seq(3, -9.0, -1.0, &mut uniform), vec![3]),  // 4 rejected sums
        (seq(3, -9.0, -1.0, &mut uniform), vec![3]),  // 5 reference chosen
        (seq(3, -9.0, -1.0, &mut uniform), vec![3]),  // 6 reference rejected
        (seq(3, -2.0, -0.01, &mut uniform), vec![3]), // 7 chosen averages
        (seq(3, -2.0, -0.01, &mut uniform), vec![3]), // 8 rejected averages
        (vec![1.7], vec![]),                          // 9 nll
        (seq(4, -1.5, 1.5, &mut uniform), vec![4]),   // 10 KTO log-ratios
        (seq(4, -9.0, -1.0, &mut uniform), vec![4]),  // 11 KTO log-probs
    ]
}

const MASK: [[f32; 6]; 4] = [
    [1.0, 1.0, 1.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    [0.0, 1.0, 1.0, 1.0, 0.0, 0.0],
    [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
];

/// Every loss of `losses.rs`, each variant, on `x` (the tensors of [`inputs`]).
fn all_losses<O: TensorOps>(ops: &O, x: &[O::T]) -> Result<Vec<(String, O::T)>, O::Error> {
    let mask_host: Vec<Vec<f32>> = MASK.iter().map(|r| r.to_vec()).collect();
    let mask = ops.tensor(
        &MASK
            .iter()
            .flatten()
            .map(|&v| f64::from(v))
            .collect::<Vec<_>>(),
        &[4, 6],
    )?;
    let mut out = Vec::new();
    let tokens = TokenInputs {
        logps: x[0].clone(),
        mask: mask.clone(),
        mask_host: mask_host.clone(),
    };
    out.push(("sft".into(), losses::sft(ops, &tokens, 9.0)?));
    let pref = PreferenceLogps {
        chosen: x[3].clone(),
        rejected: x[4].clone(),
        ref_chosen: x[5].clone(),
        ref_rejected: x[6].clone(),
        chosen_len: vec![3.0, 5.0, 2.0],
        rejected_len: vec![4.0, 1.0, 6.0],
    };
    for kind in [DpoLoss::Sigmoid, DpoLoss::Hinge, DpoLoss::Ipo] {
        out.push((
            format!("dpo {kind:?}"),
            losses::dpo(ops, kind, 0.3, &pref)?.loss,
        ));
    }
    out.push((
        "orpo".into(),
        losses::orpo(ops, 0.1, &x[7], &x[8], &x[9])?.loss,
    ));
    for kind in [
        CpoLoss::Sigmoid,
        CpoLoss::Hinge,
        CpoLoss::Ipo,
        CpoLoss::Simpo,
    ] {
        let s = CpoSettings {
            kind,
            beta: 2.0,
            simpo_gamma: 0.5,
            cpo_alpha: 0.7,
            label_smoothing: 0.1,
        };
        let (c, r) = if kind.averages() {
            (&x[7], &x[8])
        } else {
            (&x[3], &x[4])
        };
        out.push((
            format!("cpo {kind:?}"),
            losses::cpo(ops, s, c, r, &x[9])?.loss,
        ));
    }
    let labels = [true, false, true, false];
    for (kind, kl) in [(KtoLoss::Kto, 0.3), (KtoLoss::ApoZeroUnpaired, 0.0)] {
        let l = losses::kto(ops, kind, 0.1, &x[10], &x[11], &labels, kl, (1.5, 0.7))?;
        out.push((format!("kto {kind:?}"), l.loss));
    }
    for kind in [
        GrpoLoss::Dapo,
        GrpoLoss::Grpo,
        GrpoLoss::Bnpo,
        GrpoLoss::DrGrpo,
    ] {
        for (old, beta, delta) in [(false, 0.0, None), (true, 0.04, Some(1.1))] {
            let s = GrpoSettings {
                kind,
                epsilon: 0.1,
                epsilon_high: 0.15,
                delta,
                beta,
                max_completion_length: 6,
                num_items: 13.0,
            };
            let inputs = GrpoInputs {
                logps: &x[0],
                old_logps: old.then_some(&x[1]),
                ref_logps: (beta > 0.0).then_some(&x[2]),
                mask: &mask,
                mask_host: &mask_host,
                advantages: &[1.2, -0.7, 0.0, -0.5],
            };
            let l = losses::grpo(ops, s, &inputs)?;
            out.push((format!("grpo {kind:?} old={old}"), l.loss));
        }
    }
    Ok(out)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 2e-5 * b.abs().max(1.0)
}

#[test]
fn every_loss_and_its_gradients_agree_between_candle_and_mlx() {
    let data = inputs();
    // candle: values and gradients with respect to every input.
    let candle = CandleOps {
        device: Device::Cpu,
    };
    let vars: Vec<Var> = data
        .iter()
        .map(|(v, s)| {
            Var::from_tensor(&Tensor::from_vec(v.clone(), s.as_slice(), &Device::Cpu).unwrap())
                .unwrap()
        })
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let want = all_losses(&candle, &tensors).unwrap();
    let mlx = MlxOps;
    let arrays: Vec<Array> = data
        .iter()
        .map(|(v, s)| {
            let s: Vec<i32> = s.iter().map(|&d| d as i32).collect();
            Array::from_slice(v, &s)
        })
        .collect();
    let argnums: Vec<i32> = (0..arrays.len() as i32).collect();
    for (k, (name, loss)) in want.iter().enumerate() {
        let value = candle.to_f64(loss).unwrap()[0];
        let grads = loss.backward().unwrap();
        let f = move |x: &[Array]| -> Result<Vec<Array>, mlx_rs::error::Exception> {
            let all = all_losses(&MlxOps, x)?;
            Ok(vec![all[k].1.clone()])
        };
        let (v, g) =
            mlx_rs::transforms::value_and_grad_with_argnums(f, &argnums[..])(&arrays).unwrap();
        let got = mlx.to_f64(&v[0]).unwrap()[0];
        assert!(close(got, value), "{name}: MLX {got} vs candle {value}");
        for (i, var) in vars.iter().enumerate() {
            let want: Vec<f64> = match grads.get(var.as_tensor()) {
                Some(t) => candle.to_f64(t).unwrap(),
                None => vec![0.0; data[i].0.len()],
            };
            let got = mlx.to_f64(&g[i]).unwrap();
            assert_eq!(got.len(), want.len(), "{name}: input {i}");
            for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    close(*a, *b),
                    "{name}: ∂/∂input {i}[{j}]: MLX {a} vs candle {b}"
                );
            }
        }
    }
}

/// The scalar references of candle's own ops test, on MLX.
#[test]
fn token_logps_match_a_scalar_reference() {
    let rows = [[1.0f32, 2.0, 3.0], [-5.0, 0.5, 100.0]];
    let logits = Array::from_slice(&rows.concat(), &[1, 2, 3]);
    let labels = Array::from_slice(&[2u32, 0], &[1, 2]);
    let got = MlxOps
        .to_f64(&MlxOps.token_logps(&logits, &labels).unwrap())
        .unwrap();
    for (i, (row, l)) in rows.iter().zip([2usize, 0]).enumerate() {
        let m = row.iter().fold(f64::MIN, |a, &b| a.max(b as f64));
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        let want = row[l] as f64 - lse;
        assert!((got[i] - want).abs() < 1e-5 * want.abs().max(1.0), "{i}");
    }
}

fn compat(model: &str) -> crate::checkpoint::Checkpoint {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/compat")
        .join(model)
        .join("model");
    crate::checkpoint::Checkpoint::open(&dir).unwrap()
}

/// The MLX decoder's logits equal the candle decoder's (which match transformers, tests/it/forward.rs)
/// for every dense family: RoPE scalings, sliding windows, q/k/v biases, q/k norms, tied
/// embeddings; with a padded batch too.
#[test]
fn mlx_logits_equal_candles_for_every_dense_family() {
    use super::model::MlxDecoder;
    let ids = vec![
        vec![3u32, 17, 42, 99, 5, 200, 7, 1],
        vec![9u32, 8, 7, 6, 5, 4, 3, 2],
    ];
    let attention = vec![vec![true; 8], [vec![true; 5], vec![false; 3]].concat()];
    for name in [
        "llama-tiny",
        "llama-tied-tiny",
        "llama3-rope-tiny",
        "mistral-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
    ] {
        let ck = compat(name);
        let candle =
            crate::model::DecoderModel::load(&ck, candle_core::DType::F32, &Device::Cpu).unwrap();
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let t = Tensor::from_vec(flat, (2, 8), &Device::Cpu).unwrap();
        let want: Vec<f32> = candle
            .forward_masked(&t, &attention)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (mlx, weights) = MlxDecoder::load(&ck).unwrap();
        let got = mlx
            .forward(&weights, &Default::default(), &ids, Some(&attention))
            .unwrap();
        let got = MlxOps.to_f64(&got).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - f64::from(*b)).abs())
            .fold(0f64, f64::max);
        assert!(
            worst <= 1e-5 * scale.max(1.0),
            "{name}: {worst} (logits up to {scale})"
        );
    }
}

/// Gradients through the MLX decoder equal candle's: d(Σ logits²)/d(weight) for weights of
/// every kind (embeddings, norms, projections, biases).
#[test]
fn mlx_decoder_gradients_equal_candles() {
    use super::model::MlxDecoder;
    let ck = compat("qwen2-tiny");
    let ids = vec![vec![3u32, 17, 42, 99, 5, 200]];
    let candle =
        crate::model::DecoderModel::load(&ck, candle_core::DType::F32, &Device::Cpu).unwrap();
    let t = Tensor::from_vec(ids[0].clone(), (1, 6), &Device::Cpu).unwrap();
    let loss = candle
        .forward(&t)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let (mlx, weights) = MlxDecoder::load(&ck).unwrap();
    let names: Vec<String> = [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let params: Vec<Array> = names.iter().map(|n| weights[n].clone()).collect();
    let argnums: Vec<i32> = (0..names.len() as i32).collect();
    let f = {
        let names = names.clone();
        let ids = ids.clone();
        move |p: &[Array]| -> Result<Vec<Array>, mlx_rs::error::Exception> {
            let mut w = weights.clone();
            for (n, a) in names.iter().zip(p) {
                w.insert(n.clone(), a.clone());
            }
            let logits = mlx
                .forward(&w, &Default::default(), &ids, None)
                .map_err(|e| mlx_rs::error::Exception::custom(e.to_string()))?;
            Ok(vec![mlx_rs::ops::square(&logits)?.sum(None)?])
        }
    };
    let (_, g) = mlx_rs::transforms::value_and_grad_with_argnums(f, &argnums[..])(&params).unwrap();
    for (i, n) in names.iter().enumerate() {
        let var = &candle.weights().vars()[n];
        let want = CandleOps {
            device: Device::Cpu,
        }
        .to_f64(grads.get(var.as_tensor()).unwrap())
        .unwrap();
        let got = MlxOps.to_f64(&g[i]).unwrap();
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f64, f64::max);
        assert!(
            worst <= 1e-4 * scale.max(1e-6),
            "{n}: {worst} (gradients up to {scale})"
        );
    }
}

/// Token by token through MLX's KV cache gives the logits of a full pass (GQA with a sliding
/// window, and q/k norms), also for rows repeated from one prompt; and MLX's sampler draws the
/// candle sampler's tokens from the same seed.
#[test]
fn mlx_cached_steps_equal_the_full_forward_and_sample_as_candle() {
    use super::model::{MlxDecoder, sample};
    use crate::model::generate::{self, Rng, SamplingConfig};
    let ids: Vec<u32> = vec![3, 17, 42, 99, 5, 200, 7, 1, 9, 8];
    for name in ["mistral-tiny", "qwen3-tiny", "llama-tied-tiny"] {
        let ck = compat(name);
        let (mlx, w) = MlxDecoder::load(&ck).unwrap();
        let none = Default::default();
        let mut cache = mlx.new_cache();
        mlx.forward_cached(&w, &none, &[ids[..3].to_vec()], &mut cache)
            .unwrap();
        cache.repeat_rows(2).unwrap();
        for end in 4..=ids.len() {
            let step = vec![vec![ids[end - 1]]; 2];
            let got = mlx.forward_cached(&w, &none, &step, &mut cache).unwrap();
            assert_eq!(got.shape(), &[2, 1, got.shape()[2]]);
            let got = MlxOps.to_f64(&got).unwrap();
            let full = mlx
                .forward(&w, &none, &[ids[..end].to_vec()], None)
                .unwrap();
            let full = MlxOps.to_f64(&full).unwrap();
            let v = got.len() / 2;
            let want = &full[full.len() - v..];
            for row in got.chunks(v) {
                for (g, f) in row.iter().zip(want) {
                    assert!(
                        (g - f).abs() <= 1e-5 * f.abs().max(1.0),
                        "{name} {end}: {g} vs {f}"
                    );
                }
            }
        }
        assert_eq!(cache.len(), ids.len());
        let cfg = SamplingConfig {
            max_new_tokens: 8,
            eos: vec![2],
            ..Default::default()
        };
        let candle =
            crate::model::DecoderModel::load(&ck, candle_core::DType::F32, &Device::Cpu).unwrap();
        let want = generate::sample(&candle, &ids[..4], 3, &cfg, &mut Rng(11)).unwrap();
        let got = sample(&mlx, &w, &none, &ids[..4], 3, &cfg, &mut Rng(11)).unwrap();
        assert_eq!(got, want, "{name}");
    }
}

/// QLoRA on MLX: mlx-lm's own 4-bit model (tests/train/qtiny/mlx-q4) keeps every quantized
/// module packed (`uint32` words run by `quantized_matmul`, embedding rows by `dequantize`),
/// and its logits equal the candle decoder's over kiln's exact decode of the same words.
#[test]
fn an_mlx_lm_quantized_model_stays_packed_and_gives_the_decoded_logits() {
    use super::model::MlxDecoder;
    use crate::checkpoint::Checkpoint;
    use std::collections::BTreeMap;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/train/qtiny/mlx-q4");
    let (decoder, weights) = MlxDecoder::load(&Checkpoint::open(&dir).unwrap()).unwrap();
    let mut modules = vec!["model.embed_tokens".to_string(), "lm_head".to_string()];
    for i in 0..2 {
        for m in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
        ]
        .into_iter()
        .chain(["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
        {
            modules.push(format!("model.layers.{i}.{m}"));
        }
    }
    for m in &modules {
        assert!(decoder.is_packed(m), "{m}");
        let w = &weights[&format!("{m}.weight")];
        assert_eq!(w.dtype(), mlx_rs::Dtype::Uint32, "{m}");
    }
    // The Linears LoRA sees have their logical shapes.
    let linears = decoder.linear_modules(&weights);
    assert_eq!(linears.len(), 14);
    assert!(
        linears.iter().all(|(_, i, _)| *i == 64 || *i == 128),
        "{linears:?}"
    );
    let ids = vec![
        vec![1u32, 53, 47, 54, 61, 55, 2, 3],
        vec![1, 72, 73, 74, 75, 76, 77, 78],
    ];
    let got = decoder
        .forward(&weights, &BTreeMap::new(), &ids, None)
        .unwrap();
    let got = got.as_type::<f32>().unwrap();
    got.eval().unwrap();
    let got = got.as_slice::<f32>().to_vec();
    let model =
        crate::formats::load_model(&dir, candle_core::DType::F32, &Device::Cpu, false).unwrap();
    let flat: Vec<u32> = ids.iter().flatten().copied().collect();
    let t = Tensor::from_vec(flat, (2, 8), &Device::Cpu).unwrap();
    let want: Vec<f32> = model
        .forward(&t)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(got.len(), want.len());
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst < 1e-4,
        "MLX's quantized_matmul vs kiln's decode: {worst}"
    );
}
