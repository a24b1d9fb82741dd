//! Calibration and evaluation data: JSONL, one sample per line, `{"input_ids": [...]}` or
//! `{"text": "..."}` — text is tokenized with the model's `tokenizer.json` (special tokens
//! added, as transformers' tokenizer call does).

use crate::model::{DecoderModel, MaxCalibrator, ModelError, Observer};
use candle_core::Tensor;
use std::path::Path;

/// Reads up to `size` samples (all when `None`), each cut to `seq_len` tokens when given;
/// text samples are an error (see [`read_samples_with`]).
pub fn read_samples(
    path: &Path,
    size: Option<usize>,
    seq_len: Option<usize>,
) -> Result<Vec<Vec<u32>>, ModelError> {
    read_samples_with(path, size, seq_len, None)
}

/// The tokenizer of the model in `dir` (`tokenizer.json`), if it has one.
pub fn model_tokenizer(dir: &Path) -> Result<Option<tokenizers::Tokenizer>, ModelError> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    tokenizers::Tokenizer::from_file(&path)
        .map(Some)
        .map_err(|e| ModelError::file(&path, e))
}

/// [`read_samples`], tokenizing `{"text"}` samples with `tokenizer`.
pub fn read_samples_with(
    path: &Path,
    size: Option<usize>,
    seq_len: Option<usize>,
    tokenizer: Option<&tokenizers::Tokenizer>,
) -> Result<Vec<Vec<u32>>, ModelError> {
    let bad = |line: usize, m: &str| ModelError::file(path, format!("line {line}: {m}"));
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::file(path, e))?;
    let mut samples = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        if size.is_some_and(|n| samples.len() >= n) {
            break;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(i + 1, &format!("not JSON: {e}")))?;
        let ids = match (v.get("input_ids"), v.get("text")) {
            (Some(ids), _) => ids
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                        .collect::<Option<Vec<u32>>>()
                })
                .ok_or_else(|| bad(i + 1, "`input_ids` must be a list of token ids"))?,
            (None, Some(text)) => {
                let text = text
                    .as_str()
                    .ok_or_else(|| bad(i + 1, "`text` must be a string"))?;
                let tokenizer = tokenizer.ok_or_else(|| {
                    bad(
                        i + 1,
                        "`text` samples need the model's tokenizer.json, and the model folder has none; give `input_ids`",
                    )
                })?;
                tokenizer
                    .encode(text, true)
                    .map_err(|e| bad(i + 1, &format!("cannot tokenize: {e}")))?
                    .get_ids()
                    .to_vec()
            }
            (None, None) => return Err(bad(i + 1, "expected `input_ids`")),
        };
        let ids = match seq_len {
            Some(l) => ids.into_iter().take(l).collect(),
            None => ids,
        };
        if ids.is_empty() {
            return Err(bad(i + 1, "no tokens"));
        }
        samples.push(ids);
    }
    if samples.is_empty() {
        return Err(ModelError::file(path, "no calibration samples"));
    }
    Ok(samples)
}

/// Max calibration of `model` over `samples`, one sample at a time; `progress` is told
/// after each.
pub fn calibrate_max(
    model: &DecoderModel,
    samples: &[Vec<u32>],
    progress: impl FnMut(usize),
) -> Result<MaxCalibrator, ModelError> {
    calibrate(model, samples, MaxCalibrator::default(), progress)
}

/// [`calibrate_max`] with a given calibrator (e.g. one that also keeps per-channel amax).
pub fn calibrate(
    model: &DecoderModel,
    samples: &[Vec<u32>],
    mut calib: MaxCalibrator,
    mut progress: impl FnMut(usize),
) -> Result<MaxCalibrator, ModelError> {
    for (i, s) in samples.iter().enumerate() {
        let ids = Tensor::from_vec(s.clone(), (1, s.len()), model.device())?;
        model.forward_observed(&ids, &mut calib)?;
        progress(i + 1);
    }
    if calib.syncs_experts() {
        calib.sync_experts(model.weights().vars().keys().map(String::as_str));
    }
    Ok(calib)
}

/// A calibration run stage by stage ([`calibrate_by_layer`]): an observer that is also told
/// when every sample has gone through a stage (the embeddings, each decoder layer, the head),
/// while that stage's weights are loaded.
pub trait LayerCalibration: Observer {
    /// Every sample went through the stage whose weights `model` holds.
    fn stage_done(
        &mut self,
        checkpoint: &crate::checkpoint::Checkpoint,
        model: &DecoderModel,
    ) -> Result<(), ModelError> {
        let _ = (checkpoint, model);
        Ok(())
    }
    /// Every stage is done (e.g. share statistics across MoE experts).
    fn finish(&mut self, checkpoint: &crate::checkpoint::Checkpoint) {
        let _ = checkpoint;
    }
}

impl LayerCalibration for MaxCalibrator {
    fn finish(&mut self, checkpoint: &crate::checkpoint::Checkpoint) {
        if self.syncs_experts() {
            self.sync_experts(checkpoint.tensors().map(|t| t.name.as_str()));
        }
    }
}

/// [`calibrate`] one decoder layer at a time (llm-compressor's sequential onloading): only
/// the embeddings, one layer's weights, or the head are in memory at once, with the hidden
/// states of every sample at the current layer boundary. The statistics equal [`calibrate`]'s.
/// `progress` is told (stages done, stages in total).
pub fn calibrate_by_layer<C: LayerCalibration>(
    checkpoint: &crate::checkpoint::Checkpoint,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    samples: &[Vec<u32>],
    calib: C,
    progress: impl FnMut(usize, usize),
) -> Result<C, ModelError> {
    // On a GPU, stage `i` (a decoder layer, or the head after the last) is read from the
    // checkpoint on a CPU thread while stage `i - 1` computes on the device; at most two stages
    // are in memory. On the CPU the loader would compete with the GEMMs for the same cores:
    // measured on the 1.1B demo with 2 cores, no faster (23–26 s either way) and one layer
    // more of memory (731 MB against 468 MB), so there stages load in turn.
    let prefetch = !device.is_cpu();
    by_layer(
        checkpoint, dtype, device, samples, calib, progress, prefetch,
    )
}

/// A layer-by-layer run's starting point: the decoder's layer count, every sample's hidden
/// states after the embeddings with its RoPE tables (computed once, not per layer), and the
/// loader of stage `i` (decoder layer `i`, or the head after the last).
pub(crate) struct Stages<'c> {
    pub layers: usize,
    pub hidden: Vec<(Tensor, (Tensor, Tensor))>,
    pub load: Box<dyn Fn(usize) -> Result<DecoderModel, ModelError> + Send + Sync + 'c>,
}

/// [`Stages`] for `samples` on `checkpoint`, the model in `dtype` on `device`.
pub(crate) fn stages<'c>(
    checkpoint: &'c crate::checkpoint::Checkpoint,
    dtype: candle_core::DType,
    device: &'c candle_core::Device,
    samples: &[Vec<u32>],
) -> Result<Stages<'c>, ModelError> {
    // Out of autograd: a calibration differentiates nothing, so no forward builds a graph.
    let part = move |keep: &dyn Fn(&str) -> bool| {
        let mut m = DecoderModel::load_part(checkpoint, dtype, device, keep)?;
        m.freeze()?;
        Ok::<_, ModelError>(m)
    };
    let layers = crate::model::DecoderConfig::from_json(checkpoint.config().raw())?.layers;
    let embed = part(&|n: &str| n == "model.embed_tokens.weight")?;
    // One sample at a time: batching samples of one length would pack each weight once per
    // batch, but moves some statistics by an ulp (MoE routing, the GEMM's blocking), and the
    // statistics must equal the whole-model calibration's.
    let hidden = samples
        .iter()
        .map(|s| {
            let h = embed
                .embed(&Tensor::from_vec(s.clone(), (1, s.len()), device)?)?
                .detach();
            let rope = embed.rope_tables(s.len(), h.dtype())?;
            Ok::<_, ModelError>((h, rope))
        })
        .collect::<Result<_, _>>()?;
    let tied = checkpoint.tensor("lm_head.weight").is_none();
    let load = move |stage: usize| {
        if stage < layers {
            let prefix = format!("model.layers.{stage}.");
            part(&|n: &str| n.starts_with(&prefix))
        } else {
            part(&|n: &str| {
                n == "model.norm.weight"
                    || n == "lm_head.weight"
                    || (tied && n == "model.embed_tokens.weight")
            })
        }
    };
    Ok(Stages {
        layers,
        hidden,
        load: Box::new(load),
    })
}

/// [`calibrate_by_layer`], loading the next stage on a second thread when `prefetch`.
fn by_layer<C: LayerCalibration>(
    checkpoint: &crate::checkpoint::Checkpoint,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    samples: &[Vec<u32>],
    mut calib: C,
    mut progress: impl FnMut(usize, usize),
    prefetch: bool,
) -> Result<C, ModelError> {
    let Stages {
        layers,
        mut hidden,
        load: load_stage,
    } = stages(checkpoint, dtype, device, samples)?;
    let load_stage = &load_stage;
    std::thread::scope(|scope| -> Result<(), ModelError> {
        let mut next = prefetch.then(|| scope.spawn(|| load_stage(0)));
        for stage in 0..=layers {
            let model = match next.take() {
                // A panic in the loader is a bug: it continues here.
                Some(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                None => load_stage(stage),
            }?;
            if stage < layers {
                if prefetch {
                    next = Some(scope.spawn(move || load_stage(stage + 1)));
                }
                for (h, rope) in hidden.iter_mut() {
                    // Detached: the weights are variables, and a kept graph would keep every
                    // layer.
                    *h = model.layer(h, stage, rope, &mut calib)?.detach();
                }
            } else {
                for (h, _) in &hidden {
                    // The head's input is all a calibration needs (the logits are not).
                    model.observe_head(h, &mut calib)?;
                }
            }
            calib.stage_done(checkpoint, &model)?;
            progress(stage + 1, layers + 1);
        }
        Ok(())
    })?;
    calib.finish(checkpoint);
    Ok(calib)
}

/// The amax of an input smoothed by `pre_quant_scale` `s`, from its per-channel amax `a`:
/// `round(max_c(round(a_c) · s_c))` with `round` the weight's dtype (ModelOpt's
/// `(_amax_for_smoothing.to(dtype) * pre_quant_scale).amax().to(dtype)`).
pub fn smoothed_amax(a: &[f32], s: &[f32], round: fn(f32) -> f32) -> f32 {
    round(
        a.iter()
            .zip(s)
            .map(|(&a, &s)| round(a) * s)
            .fold(0f32, f32::max),
    )
}

/// SmoothQuant's scales from per-channel statistics (ModelOpt's `smoothquant` postprocess):
/// for each Linear `m` in `linears` with weight `W` and input channel amax `a`,
/// `s = max|W[:, c]|^(1-α) / a^α` (in f32; channels whose amax is ~0 get 1 when any scale is
/// ~0; clamped to [1e-4, 1e4]) becomes its `pre_quant_scale`, and its input amax becomes
/// `max_c(a_c · s_c)` in the weight's dtype — the amax of the smoothed input. Returns
/// `(module, scale, input amax)`.
pub fn smoothquant_scales(
    checkpoint: &crate::checkpoint::Checkpoint,
    channels: &std::collections::BTreeMap<String, Vec<f32>>,
    linears: &[String],
    alpha: f32,
) -> Result<Vec<(String, Vec<f32>, f32)>, ModelError> {
    use half::{bf16, f16};
    use safetensors::Dtype;
    let mut out = Vec::new();
    for m in linears {
        let Some(a) = channels.get(m) else {
            return Err(ModelError::Config(format!(
                "no calibration statistics for `{m}` (no token reached it)"
            )));
        };
        let name = format!("{m}.weight");
        let meta = checkpoint.tensor(&name).ok_or_else(|| ModelError::Tensor {
            tensor: name.clone(),
            message: "missing".into(),
        })?;
        let cols = meta.shape.get(1).copied().unwrap_or(0);
        if cols != a.len() {
            return Err(ModelError::Tensor {
                tensor: name,
                message: format!("{cols} input channels, but {} were calibrated", a.len()),
            });
        }
        let (w, round): (Vec<f32>, fn(f32) -> f32) = match meta.dtype {
            Dtype::BF16 => (
                checkpoint
                    .read_as::<bf16>(&name)?
                    .into_iter()
                    .map(f32::from)
                    .collect(),
                |x| bf16::from_f32(x).to_f32(),
            ),
            Dtype::F16 => (
                checkpoint
                    .read_as::<f16>(&name)?
                    .into_iter()
                    .map(f32::from)
                    .collect(),
                |x| f16::from_f32(x).to_f32(),
            ),
            Dtype::F32 => (checkpoint.read_as::<f32>(&name)?, |x| x),
            other => {
                return Err(ModelError::Tensor {
                    tensor: name,
                    message: format!("dtype {other:?} cannot be smoothed"),
                });
            }
        };
        let mut wmax = vec![0f32; cols];
        for row in w.chunks_exact(cols) {
            for (m, &x) in wmax.iter_mut().zip(row) {
                *m = m.max(x.abs());
            }
        }
        // The statistics as ModelOpt holds them: in the model's dtype.
        let a: Vec<f32> = a.iter().map(|&x| round(x)).collect();
        let mut s: Vec<f32> = wmax
            .iter()
            .zip(&a)
            .map(|(&w, &a)| w.powf(1.0 - alpha) / a.powf(alpha))
            .collect();
        let eps = 1.0 / (1u64 << 31) as f32;
        if s.iter().any(|&x| x <= eps) {
            for (x, &a) in s.iter_mut().zip(&a) {
                if a <= eps {
                    *x = 1.0;
                }
            }
        }
        for x in s.iter_mut() {
            *x = x.clamp(1e-4, 1e4);
        }
        let input = smoothed_amax(&a, &s, round);
        out.push((m.clone(), s, input));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loading_the_next_layer_ahead_gives_the_same_statistics() {
        // The GPU path (the next stage read on a second thread), run on the CPU: the same
        // statistics as stage after stage.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/compat");
        for model in ["llama-tiny", "mixtral-tiny"] {
            let c = crate::checkpoint::Checkpoint::open(root.join(model).join("model")).unwrap();
            let samples = read_samples(&root.join(model).join("calib.jsonl"), None, None).unwrap();
            let run = |prefetch| {
                let mut stages = Vec::new();
                let calib = by_layer(
                    &c,
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                    &samples,
                    crate::model::MaxCalibrator::default().with_channels(),
                    |done, _| stages.push(done),
                    prefetch,
                )
                .unwrap();
                (calib.amax().clone(), calib.channels().cloned(), stages)
            };
            assert_eq!(run(true), run(false), "{model}");
        }
    }
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;

    #[test]
    fn text_samples_are_tokenized_with_the_models_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let vocab = [("[UNK]", 0u32), ("hello", 1), ("world", 2)]
            .into_iter()
            .map(|(w, i)| (w.to_string(), i))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut tok = tokenizers::Tokenizer::new(model);
        tok.with_pre_tokenizer(Some(Whitespace {}));
        tok.save(dir.path().join("tokenizer.json"), false).unwrap();
        let data = dir.path().join("data.jsonl");
        std::fs::write(
            &data,
            "{\"text\": \"hello world zzz\"}\n{\"input_ids\": [2, 1]}\n",
        )
        .unwrap();
        let tok = model_tokenizer(dir.path()).unwrap().unwrap();
        let samples = read_samples_with(&data, None, None, Some(&tok)).unwrap();
        assert_eq!(samples, [vec![1, 2, 0], vec![2, 1]]);
        let err = read_samples(&data, None, None).unwrap_err().to_string();
        assert!(
            err.contains("line 1: `text` samples need the model's tokenizer.json"),
            "{err}"
        );
    }
}
