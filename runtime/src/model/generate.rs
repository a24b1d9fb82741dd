//! Sampling from a model with its KV cache, as transformers' `generate(do_sample=True)` does
//! it: the last position's logits, a repetition penalty, temperature, top-k, top-p and min-p,
//! then a draw from what is left; generation stops at an end-of-sequence token or after
//! `max_new_tokens`. The draws come from a seeded SplitMix64 stream, so a CPU run repeats.

use super::{DecoderModel, ModelError};
use candle_core::{DType, Tensor};

/// How tokens are chosen (transformers' `GenerationConfig` names).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// Divides the logits; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Keep the smallest set of tokens whose probability reaches this (1: all).
    pub top_p: f64,
    /// Keep this many most likely tokens (0: all).
    pub top_k: usize,
    /// Drop tokens less likely than this times the most likely one.
    pub min_p: Option<f64>,
    /// Divides (multiplies, when negative) the logits of tokens already present (1: none).
    pub repetition_penalty: f64,
    /// The most tokens generated.
    pub max_new_tokens: usize,
    /// Tokens that end a sequence (kept in the output).
    pub eos: Vec<u32>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
            max_new_tokens: 256,
            eos: Vec::new(),
        }
    }
}

/// The sampler's seeded stream of uniform draws.
pub use crate::rng::SplitMix64 as Rng;

/// The token chosen from `logits` (one position) after `seen` tokens.
pub fn choose(logits: &[f32], seen: &[u32], cfg: &SamplingConfig, rng: &mut Rng) -> u32 {
    let mut x: Vec<f64> = logits.iter().map(|&v| f64::from(v)).collect();
    if cfg.repetition_penalty != 1.0 {
        for &t in seen {
            if let Some(v) = x.get_mut(t as usize) {
                *v = if *v < 0.0 {
                    *v * cfg.repetition_penalty
                } else {
                    *v / cfg.repetition_penalty
                };
            }
        }
    }
    if cfg.temperature == 0.0 {
        return x
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
            .map(|(i, _)| i as u32)
            .unwrap_or(0);
    }
    for v in &mut x {
        *v /= cfg.temperature;
    }
    let mut keep = vec![true; x.len()];
    if cfg.top_k > 0 && cfg.top_k < x.len() {
        let mut sorted: Vec<f64> = x.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[cfg.top_k - 1];
        for (k, v) in keep.iter_mut().zip(&x) {
            *k &= *v >= kth;
        }
    }
    let probs = |keep: &[bool]| -> Vec<f64> {
        let m = x
            .iter()
            .zip(keep)
            .filter(|(_, k)| **k)
            .map(|(v, _)| *v)
            .fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x
            .iter()
            .zip(keep)
            .map(|(v, k)| if *k { (v - m).exp() } else { 0.0 })
            .collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|v| v / z).collect()
    };
    if cfg.top_p < 1.0 {
        // transformers: ascending order, drop while the cumulative mass is ≤ 1 − top_p,
        // keeping at least the most likely token.
        let p = probs(&keep);
        let mut order: Vec<usize> = (0..x.len()).filter(|&i| keep[i]).collect();
        order.sort_by(|&a, &b| p[a].total_cmp(&p[b]));
        let mut cum = 0.0;
        for (n, &i) in order.iter().enumerate() {
            cum += p[i];
            if cum <= 1.0 - cfg.top_p && n + 1 < order.len() {
                keep[i] = false;
            }
        }
    }
    if let Some(min_p) = cfg.min_p {
        let p = probs(&keep);
        let top = p.iter().copied().fold(0.0, f64::max);
        for (k, v) in keep.iter_mut().zip(&p) {
            *k &= *v >= min_p * top;
        }
    }
    let p = probs(&keep);
    let u = rng.uniform();
    let mut cum = 0.0;
    let mut last = 0;
    for (i, v) in p.iter().enumerate() {
        if *v > 0.0 {
            cum += v;
            last = i;
            if u < cum {
                return i as u32;
            }
        }
    }
    last as u32
}

/// `n` completions of `prompt`: the prompt runs once, its cache is shared by the `n` rows,
/// then one token per row per step until every row has ended (an EOS, kept) or
/// `max_new_tokens` tokens.
pub fn sample(
    model: &DecoderModel,
    prompt: &[u32],
    n: usize,
    cfg: &SamplingConfig,
    rng: &mut Rng,
) -> Result<Vec<Vec<u32>>, ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::Config(
            "cannot sample after an empty prompt".into(),
        ));
    }
    let device = model.device().clone();
    let mut cache = model.new_cache();
    let ids = Tensor::from_vec(prompt.to_vec(), (1, prompt.len()), &device)?;
    let logits = model.forward_cached(&ids, &mut cache)?;
    let first: Vec<f32> = logits
        .narrow(1, prompt.len() - 1, 1)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    cache.repeat_rows(n)?;
    sample_with(prompt, n, cfg, rng, first, |next, _| {
        let ids = Tensor::from_vec(next.to_vec(), (n, 1), &device)?;
        let logits = model.forward_cached(&ids, &mut cache)?;
        Ok(logits.squeeze(1)?.to_dtype(DType::F32)?.to_vec2()?)
    })
}

/// The sampling loop over any forward pass: `first` is the prompt's last logits; `step`
/// takes every row's newest token (a finished row repeats its last one) and the completions
/// so far, and gives each row's next logits. Every backend draws the same tokens from the
/// same logits.
pub fn sample_with<E>(
    prompt: &[u32],
    n: usize,
    cfg: &SamplingConfig,
    rng: &mut Rng,
    first: Vec<f32>,
    mut step: impl FnMut(&[u32], &[Vec<u32>]) -> Result<Vec<Vec<f32>>, E>,
) -> Result<Vec<Vec<u32>>, E> {
    let mut last = vec![first; n];
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut done = vec![false; n];
    for _ in 0..cfg.max_new_tokens {
        let mut next = Vec::with_capacity(n);
        for r in 0..n {
            let t = if done[r] {
                *out[r].last().unwrap_or(&0)
            } else {
                let seen: Vec<u32> = prompt.iter().chain(&out[r]).copied().collect();
                let t = choose(&last[r], &seen, cfg, rng);
                out[r].push(t);
                if cfg.eos.contains(&t) {
                    done[r] = true;
                }
                t
            };
            next.push(t);
        }
        if done.iter().all(|&d| d) || out.iter().all(|o| o.len() >= cfg.max_new_tokens) {
            break;
        }
        last = step(&next, &out)?;
    }
    Ok(out)
}

/// The logits of the last position of `ids` `[1, t]` without a cache (tests compare).
pub fn last_logits(model: &DecoderModel, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
    let t = Tensor::from_vec(ids.to_vec(), (1, ids.len()), model.device())?;
    let l = model.forward(&t)?;
    Ok(l.narrow(1, ids.len() - 1, 1)?
        .squeeze(1)?
        .squeeze(0)?
        .to_dtype(DType::F32)?
        .to_vec1()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token by token through the cache gives the logits a full pass gives (the tiny Llama of
    /// the training tests), and sampling stops at the EOS.
    #[test]
    fn cached_steps_equal_the_full_forward() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/train/tiny/model");
        let ck = crate::checkpoint::Checkpoint::open(&dir).unwrap();
        let model = DecoderModel::load(&ck, DType::F32, &candle_core::Device::Cpu).unwrap();
        let ids: Vec<u32> = vec![1, 40, 41, 42, 43, 44, 45, 46];
        let mut cache = model.new_cache();
        let head = Tensor::from_vec(ids[..3].to_vec(), (1, 3), model.device()).unwrap();
        model.forward_cached(&head, &mut cache).unwrap();
        for end in 4..=ids.len() {
            let step = Tensor::from_vec(vec![ids[end - 1]], (1, 1), model.device()).unwrap();
            let got: Vec<f32> = model
                .forward_cached(&step, &mut cache)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let want = last_logits(&model, &ids[..end]).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "{end}: {g} vs {w}"
                );
            }
        }
        assert_eq!(cache.len(), ids.len());
        let cfg = SamplingConfig {
            max_new_tokens: 6,
            eos: vec![2],
            ..Default::default()
        };
        let out = sample(&model, &ids[..3], 4, &cfg, &mut Rng(3)).unwrap();
        assert_eq!(out.len(), 4);
        for o in &out {
            assert!(!o.is_empty() && o.len() <= 6);
            assert!(o[..o.len() - 1].iter().all(|&t| t != 2), "{o:?}");
        }
        // The same seed draws the same completions.
        assert_eq!(
            out,
            sample(&model, &ids[..3], 4, &cfg, &mut Rng(3)).unwrap()
        );
    }

    /// Inference keeps no graph: a model as `kiln eval` / `kiln generate` load it has its
    /// weights out of autograd; `forward_inference` over trainable weights and adapters (whose
    /// B is nonzero) gives `forward`'s logits untracked; the KV cache holds no graph.
    #[test]
    fn inference_keeps_no_graph() {
        use crate::model::lora::{Adapters, LoraSpec};
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/train/tiny/model");
        let dev = candle_core::Device::Cpu;
        let loaded = crate::formats::load_model(&dir, DType::F32, &dev, false).unwrap();
        let ids = Tensor::from_vec(vec![1u32, 40, 41, 42, 43], (1, 5), &dev).unwrap();
        assert!(
            !loaded.forward(&ids).unwrap().track_op(),
            "load_model: frozen"
        );

        let ck = crate::checkpoint::Checkpoint::open(&dir).unwrap();
        let model = DecoderModel::load(&ck, DType::F32, &dev).unwrap();
        let spec = LoraSpec {
            r: 2,
            alpha: 4.0,
            dropout: 0.0,
            rslora: false,
            target_modules: vec!["all-linear".into()],
        };
        let adapters = Adapters::new(&model, &spec, 5).unwrap();
        for l in adapters.layers.values() {
            l.b.set(
                &Tensor::ones(l.b.dims(), DType::F32, &dev)
                    .unwrap()
                    .affine(0.01, 0.0)
                    .unwrap(),
            )
            .unwrap();
        }
        let model = model.with_adapters(Some(std::sync::Arc::new(adapters)));
        let tracked = model.forward(&ids).unwrap();
        assert!(tracked.track_op(), "trainable weights build a graph");
        let inference = model.forward_inference(&ids).unwrap();
        assert!(!inference.track_op());
        let (a, b): (Vec<f32>, Vec<f32>) = (
            tracked.flatten_all().unwrap().to_vec1().unwrap(),
            inference.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert_eq!(a, b, "the same logits");
        let mut cache = model.new_cache();
        model.forward_cached(&ids, &mut cache).unwrap();
        assert_eq!(cache.len(), 5);
        assert!(!cache.holds_graph());
    }

    #[test]
    fn greedy_takes_the_largest_and_top_k_one_is_greedy() {
        let logits = [0.5f32, 3.0, -1.0, 2.9];
        let mut rng = Rng(1);
        let greedy = SamplingConfig {
            temperature: 0.0,
            ..Default::default()
        };
        assert_eq!(choose(&logits, &[], &greedy, &mut rng), 1);
        let k1 = SamplingConfig {
            top_k: 1,
            ..Default::default()
        };
        for _ in 0..20 {
            assert_eq!(choose(&logits, &[], &k1, &mut rng), 1);
        }
        // A repetition penalty of 10 on token 1 makes 3 the most likely.
        let pen = SamplingConfig {
            temperature: 0.0,
            repetition_penalty: 10.0,
            ..Default::default()
        };
        assert_eq!(choose(&logits, &[1], &pen, &mut rng), 3);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities ∝ e^x: token 0 holds ~0.84 of the mass; top_p 0.8 keeps it alone.
        let logits = [4.0f32, 2.0, 1.0, 0.0];
        let cfg = SamplingConfig {
            top_p: 0.8,
            ..Default::default()
        };
        let mut rng = Rng(7);
        for _ in 0..50 {
            assert_eq!(choose(&logits, &[], &cfg, &mut rng), 0);
        }
        // Sampling at temperature 1 draws each token about as often as its probability.
        let mut counts = [0usize; 4];
        let all = SamplingConfig::default();
        for _ in 0..20000 {
            counts[choose(&logits, &[], &all, &mut rng) as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&v| (v as f64).exp()).sum();
        for (c, &v) in counts.iter().zip(&logits) {
            let want = (v as f64).exp() / z;
            assert!((*c as f64 / 20000.0 - want).abs() < 0.015, "{c} vs {want}");
        }
    }
}
