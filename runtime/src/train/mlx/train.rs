//! Training on MLX under the shared loop (`train/driver.rs`): the model's arrays (or LoRA's `A`
//! and `B` beside the frozen base weights) are the arguments `value_and_grad` differentiates;
//! the data, tokenisation, LoRA plan (initialisation, dropout streams, PEFT files), losses,
//! schedules and logging are the candle backend's, so both backends train the same way.

use super::model::{MlxDecoder, MlxLora, MlxWeights, mlx_err};
use super::ops::MlxOps;
use crate::checkpoint::Checkpoint;
use crate::model::lora::{Adapters, LoraSpec, linear_modules_of};
use crate::train::data::{DataFormat, Dataset, LmExample, TextTokenizer, sft_examples_with};
use crate::train::driver::{Stepper, drive};
use crate::train::losses::{self, TokenInputs};
use crate::train::ops::TensorOps;
use crate::train::{TrainConfig, TrainError, TrainObserver, TrainReport};
use mlx_rs::Array;
use mlx_rs::error::Exception;
use mlx_rs::ops;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const BACKEND: &str = "mlx";

fn backend_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Backend {
        backend: BACKEND.into(),
        message: e.to_string(),
    }
}

fn config_err(field: &str, message: impl Into<String>) -> TrainError {
    TrainError::Config {
        field: field.into(),
        message: message.into(),
    }
}

/// The model, its trainable arrays and the tokenizer, ready to train on MLX.
pub struct MlxSetup {
    /// The run's configuration.
    pub config: TrainConfig,
    decoder: MlxDecoder,
    /// Every weight; under LoRA these stay as loaded.
    base: MlxWeights,
    /// LoRA: the adapters' plan (targets, scale, dropout stream, PEFT files); candle holds
    /// their storage on the CPU for initialisation and saving only.
    adapters: Option<Adapters>,
    /// The Linear layers (module, inputs, outputs).
    modules: Vec<(String, usize, usize)>,
    /// The trainable arrays' names (PEFT's for adapters, the tensor names otherwise).
    names: Vec<String>,
    /// The model's tokenizer.
    pub tokenizer: TextTokenizer,
}

impl MlxSetup {
    /// Loads the model named by `config` (f32) and makes or loads its adapters.
    pub fn load(config: &TrainConfig) -> Result<(Self, Vec<Array>), TrainError> {
        if config.merge && config.lora.is_none() && config.init_adapter.is_none() {
            return Err(config_err(
                "merge",
                "--merge needs LoRA (full fine-tuning already writes full weights)",
            ));
        }
        let checkpoint = Checkpoint::open(&config.model).map_err(crate::model::ModelError::from)?;
        let (decoder, base) = MlxDecoder::load(&checkpoint)?;
        let tokenizer = TextTokenizer::from_model_dir(&config.model)?;
        let shapes: Vec<(String, Vec<usize>)> = base
            .iter()
            .map(|(n, a)| (n.clone(), a.shape().iter().map(|&d| d as usize).collect()))
            .collect();
        let modules = linear_modules_of(shapes.iter().map(|(n, s)| (n.as_str(), s.as_slice())));
        let cpu = candle_core::Device::Cpu;
        let adapters = match (&config.lora, &config.init_adapter) {
            (None, None) => None,
            (_, Some(dir)) => Some(Adapters::load_peft_for(dir, &modules, &cpu)?),
            (Some(l), None) => {
                let spec = LoraSpec {
                    r: l.r,
                    alpha: l.lora_alpha,
                    dropout: l.lora_dropout,
                    rslora: l.use_rslora,
                    target_modules: l.target_modules.clone(),
                };
                Some(Adapters::new_for(&modules, &spec, config.hyper.seed, &cpu)?)
            }
        };
        // The dropout stream seeded as the candle backend seeds it.
        let adapters = adapters.map(|a| {
            a.with_dropout_state(config.hyper.seed ^ 0x6472_6f70)
                .set_training(true)
        });
        let (names, params) = match &adapters {
            Some(a) => {
                let mut names = Vec::new();
                let mut params = Vec::new();
                for (name, var) in a.vars() {
                    params.push(to_array(var.as_tensor())?);
                    names.push(name);
                }
                (names, params)
            }
            None => base.iter().map(|(n, a)| (n.clone(), a.clone())).unzip(),
        };
        Ok((
            MlxSetup {
                config: config.clone(),
                decoder,
                base,
                adapters,
                modules,
                names,
                tokenizer,
            },
            params,
        ))
    }

    /// The weights and adapters a forward pass runs with, given the trainable arrays.
    fn parts(&self, params: &[Array]) -> (MlxWeights, BTreeMap<String, MlxLora>) {
        match &self.adapters {
            Some(a) => {
                let mut lora = BTreeMap::new();
                for ((m, l), pair) in a.layers().iter().zip(params.chunks(2)) {
                    lora.insert(
                        m.clone(),
                        MlxLora {
                            a: pair[0].clone(),
                            b: pair[1].clone(),
                            scale: l.scale as f32,
                            dropout: l.dropout,
                        },
                    );
                }
                (self.base.clone(), lora)
            }
            None => {
                let w = self
                    .names
                    .iter()
                    .cloned()
                    .zip(params.iter().cloned())
                    .collect();
                (w, BTreeMap::new())
            }
        }
    }
}

fn to_array(t: &candle_core::Tensor) -> Result<Array, TrainError> {
    let v: Vec<f32> = t
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let shape: Vec<i32> = t.dims().iter().map(|&d| d as i32).collect();
    Ok(Array::from_slice(&v, &shape))
}

fn host(a: &Array) -> Result<Vec<f32>, TrainError> {
    let a = a
        .as_type::<f32>()
        .map_err(mlx_err)?
        .contiguous()
        .map_err(mlx_err)?;
    a.eval().map_err(mlx_err)?;
    Ok(a.as_slice::<f32>().to_vec())
}

/// Supervised fine-tuning on MLX: TRL's SFT objective (the candle backend's examples and
/// loss).
pub struct MlxSft {
    examples: Vec<LmExample>,
    num_items: f64,
}

impl MlxSft {
    /// The examples of `config.train_data`, as the candle backend prepares them.
    pub fn new(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let path = config
            .train_data
            .as_ref()
            .ok_or_else(|| config_err("train_data", "required (a JSONL file)"))?;
        let data = Dataset::read(
            path,
            &[
                DataFormat::Text,
                DataFormat::PromptCompletion,
                DataFormat::Messages,
            ],
        )?;
        let completion_only = config
            .option::<bool>("completion_only_loss")?
            .unwrap_or(true);
        let assistant_only = config
            .option::<bool>("assistant_only_loss")?
            .unwrap_or(false);
        let examples = sft_examples_with(
            &data,
            tok,
            completion_only,
            assistant_only,
            config.hyper.max_length,
        )?;
        Ok(MlxSft {
            examples,
            num_items: 0.0,
        })
    }
}

/// A right-padded batch: ids, attention, labels and their mask (shifted).
struct Batch {
    ids: Vec<Vec<u32>>,
    attention: Vec<Vec<bool>>,
    labels: Vec<f64>,
    mask_host: Vec<Vec<f32>>,
    len: usize,
}

fn batch(examples: &[&LmExample], pad: u32) -> Result<Batch, TrainError> {
    let len = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    if len < 2 {
        return Err(config_err(
            "max_length",
            "every sequence of a batch is shorter than two tokens: nothing to predict",
        ));
    }
    let mut b = Batch {
        ids: Vec::new(),
        attention: Vec::new(),
        labels: Vec::new(),
        mask_host: Vec::new(),
        len,
    };
    for e in examples {
        let mut ids = e.ids.clone();
        ids.resize(len, pad);
        let mut m: Vec<f32> = e.mask.iter().map(|&x| f32::from(x)).collect();
        m.resize(len, 0.0);
        b.mask_host.push(m[1..].to_vec());
        b.labels.extend(ids[1..].iter().map(|&i| f64::from(i)));
        b.attention
            .push((0..len).map(|j| j < e.ids.len()).collect());
        b.ids.push(ids);
    }
    Ok(b)
}

/// The MLX backend under the training loop.
struct MlxStepper {
    setup: MlxSetup,
    sft: MlxSft,
    eval: Option<MlxSft>,
    params: Vec<Array>,
    grads: Vec<Option<Array>>,
    m: Vec<Array>,
    v: Vec<Array>,
    decay: Vec<bool>,
    step: u64,
}

impl MlxStepper {
    /// The SFT loss of `b` (and, on the side, the logits) with `params`.
    fn loss(
        setup: &MlxSetup,
        params: &[Array],
        b: &Batch,
        num_items: f64,
        training: bool,
    ) -> Result<(Array, Array), Exception> {
        let (w, lora) = setup.parts(params);
        let dropout = setup
            .adapters
            .as_ref()
            .filter(|_| training)
            .and_then(|a| a.dropout_rng());
        let logits = setup
            .decoder
            .forward_with(&w, &lora, dropout, &b.ids, Some(&b.attention))?;
        let n = b.ids.len() as i32;
        let len = b.len as i32;
        let shifted = ops::split_at_indices(&logits, &[len - 1], 1)?.remove(0);
        let labels: Vec<u32> = b.ids.iter().flat_map(|r| r[1..].to_vec()).collect();
        let labels = Array::from_slice(&labels, &[n, len - 1]);
        let logps = MlxOps.token_logps(&shifted, &labels)?;
        let flat: Vec<f32> = b.mask_host.iter().flatten().copied().collect();
        let inputs = TokenInputs {
            logps,
            mask: Array::from_slice(&flat, &[n, len - 1]),
            mask_host: b.mask_host.clone(),
        };
        let loss = losses::sft(&MlxOps, &inputs, num_items)?;
        Ok((loss, mlx_rs::stop_gradient(&logits)?))
    }

    /// TRL's SFT figures from the logits of `b`.
    fn figures(b: &Batch, logits: &Array) -> Result<BTreeMap<String, f64>, TrainError> {
        let len = b.len as i32;
        let full = MlxOps.token_entropy(logits).map_err(mlx_err)?;
        let h: Vec<f64> = MlxOps.to_f64(&full).map_err(mlx_err)?;
        let att: Vec<f32> = b
            .attention
            .iter()
            .flatten()
            .map(|&a| f32::from(u8::from(a)))
            .collect();
        let shifted = ops::split_at_indices(logits, &[len - 1], 1)
            .map_err(mlx_err)?
            .remove(0);
        let pred = MlxOps
            .to_f64(&MlxOps.argmax(&shifted).map_err(mlx_err)?)
            .map_err(mlx_err)?;
        let mask: Vec<f32> = b.mask_host.iter().flatten().copied().collect();
        Ok(BTreeMap::from([
            ("entropy".to_string(), losses::masked_mean(&h, &att)),
            (
                "mean_token_accuracy".to_string(),
                losses::token_accuracy(&pred, &b.labels, &mask),
            ),
            ("num_tokens".to_string(), 0.0),
        ]))
    }
}

impl Stepper for MlxStepper {
    fn task(&self) -> &'static str {
        "sft"
    }
    fn backend(&self) -> &'static str {
        BACKEND
    }
    fn examples(&self) -> usize {
        self.sft.examples.len()
    }
    fn trainable_parameters(&self) -> u64 {
        self.params
            .iter()
            .map(|p| p.shape().iter().product::<i32>() as u64)
            .sum()
    }
    fn begin_step(&mut self, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        // transformers counts `labels[..., 1:] != -100` over every micro-batch of the step.
        self.sft.num_items = micro_batches
            .iter()
            .flatten()
            .map(|&i| {
                self.sft.examples[i]
                    .mask
                    .iter()
                    .skip(1)
                    .map(|&m| f64::from(m))
                    .sum::<f64>()
            })
            .sum();
        Ok(())
    }
    fn micro_batch(
        &mut self,
        indices: &[usize],
        _count: usize,
    ) -> Result<(f64, BTreeMap<String, f64>, u64), TrainError> {
        let examples: Vec<&LmExample> = indices.iter().map(|&i| &self.sft.examples[i]).collect();
        let b = batch(&examples, self.setup.tokenizer.pad_id)?;
        let logits = std::cell::RefCell::new(None);
        let setup = &self.setup;
        let num_items = self.sft.num_items;
        let f = |p: &[Array]| -> Result<Vec<Array>, Exception> {
            let (loss, l) = Self::loss(setup, p, &b, num_items, true)?;
            *logits.borrow_mut() = Some(l);
            Ok(vec![loss])
        };
        let argnums: Vec<i32> = (0..self.params.len() as i32).collect();
        let (value, grads) =
            mlx_rs::transforms::value_and_grad_with_argnums(f, &argnums[..])(&self.params)
                .map_err(mlx_err)?;
        for (acc, g) in self.grads.iter_mut().zip(grads) {
            *acc = Some(match acc.take() {
                Some(old) => ops::add(&old, &g).map_err(mlx_err)?,
                None => g,
            });
        }
        let loss = f64::from(host(&value[0])?[0]);
        let logits = logits
            .into_inner()
            .ok_or_else(|| backend_err("the loss did not run"))?;
        let figures = Self::figures(&b, &logits)?;
        let tokens = examples.iter().map(|e| e.ids.len() as u64).sum();
        Ok((loss, figures, tokens))
    }
    fn update(&mut self, lr: f64) -> Result<f64, TrainError> {
        let h = &self.setup.config.hyper;
        // torch's clip_grad_norm_: the global norm of the per-tensor norms.
        let mut total = 0f64;
        for g in self.grads.iter().flatten() {
            let n = host(
                &ops::sqrt(
                    &ops::square(g)
                        .map_err(mlx_err)?
                        .sum(None)
                        .map_err(mlx_err)?,
                )
                .map_err(mlx_err)?,
            )?[0];
            total += f64::from(n) * f64::from(n);
        }
        let norm = total.sqrt();
        let coef = h
            .max_grad_norm
            .map_or(1.0, |max| (max / (norm + 1e-6)).min(1.0));
        // torch's AdamW (single-tensor path), as the candle backend computes it.
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - h.adam_beta1.powi(t);
        let bc2_sqrt = (1.0 - h.adam_beta2.powi(t)).sqrt();
        let s = |x: f64| Array::from_f32(x as f32);
        let update = |p: &Array,
                      g: &Array,
                      m: &Array,
                      v: &Array,
                      decay: bool|
         -> Result<(Array, Array, Array), Exception> {
            let g = if h.max_grad_norm.is_some() {
                ops::multiply(g, s(coef))?
            } else {
                g.clone()
            };
            let p = if decay && h.weight_decay != 0.0 {
                ops::multiply(p, s(1.0 - lr * h.weight_decay))?
            } else {
                p.clone()
            };
            let m = ops::add(
                m,
                &ops::multiply(&ops::subtract(&g, m)?, s(1.0 - h.adam_beta1))?,
            )?;
            let v = ops::add(
                &ops::multiply(v, s(h.adam_beta2))?,
                &ops::multiply(&ops::square(&g)?, s(1.0 - h.adam_beta2))?,
            )?;
            let denom = ops::add(
                &ops::divide(&ops::sqrt(&v)?, s(bc2_sqrt))?,
                s(h.adam_epsilon),
            )?;
            let p = ops::subtract(&p, &ops::multiply(&ops::divide(&m, &denom)?, s(lr / bc1))?)?;
            Ok((p, m, v))
        };
        for i in 0..self.params.len() {
            let Some(g) = self.grads[i].take() else {
                continue;
            };
            let (p, m, v) = update(&self.params[i], &g, &self.m[i], &self.v[i], self.decay[i])
                .map_err(mlx_err)?;
            mlx_rs::transforms::eval([&p, &m, &v]).map_err(mlx_err)?;
            self.params[i] = p;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(norm)
    }
    fn evaluate(&mut self, tokens: u64) -> Result<Option<BTreeMap<String, f64>>, TrainError> {
        let Some(eval) = &self.eval else {
            return Ok(None);
        };
        let bs = self.setup.config.hyper.per_device_eval_batch_size.max(1);
        let (mut loss, mut count) = (0f64, 0usize);
        let mut totals: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        let idx: Vec<usize> = (0..eval.examples.len()).collect();
        for chunk in idx.chunks(bs) {
            let examples: Vec<&LmExample> = chunk.iter().map(|&i| &eval.examples[i]).collect();
            let num_items: f64 = examples
                .iter()
                .map(|e| e.mask.iter().skip(1).map(|&m| f64::from(m)).sum::<f64>())
                .sum();
            let b = batch(&examples, self.setup.tokenizer.pad_id)?;
            let (l, logits) =
                Self::loss(&self.setup, &self.params, &b, num_items, false).map_err(mlx_err)?;
            loss += f64::from(host(&l)?[0]) * chunk.len() as f64;
            count += chunk.len();
            for (k, v) in Self::figures(&b, &logits)? {
                let e = totals.entry(k).or_insert((0.0, 0));
                e.0 += v;
                e.1 += 1;
            }
        }
        let mut out: BTreeMap<String, f64> = totals
            .into_iter()
            .map(|(k, (s, n))| (format!("eval_{k}"), s / n as f64))
            .collect();
        out.insert("eval_num_tokens".into(), tokens as f64);
        out.insert("eval_loss".into(), loss / count.max(1) as f64);
        Ok(Some(out))
    }
    fn save_checkpoint(&self, _step: u64, _tokens: u64) -> Result<PathBuf, TrainError> {
        Err(config_err(
            "save_steps",
            "resumable checkpoints are not written by the MLX backend yet (use --backend candle)",
        ))
    }
    fn resume(&mut self, _dir: &Path) -> Result<(u64, u64), TrainError> {
        Err(config_err(
            "resume",
            "the MLX backend cannot resume a run yet (use --backend candle)",
        ))
    }
    fn save_output(&self) -> Result<PathBuf, TrainError> {
        let setup = &self.setup;
        crate::train::output::save_into(&setup.config.output, |dir| {
            let base = setup.config.model.display().to_string();
            match &setup.adapters {
                Some(a) => {
                    // The trained arrays back into the adapters' storage, then PEFT's files.
                    for ((_, var), p) in a.vars().iter().zip(&self.params) {
                        let data = host(p)?;
                        let t = candle_core::Tensor::from_vec(
                            data,
                            var.as_tensor().dims(),
                            &candle_core::Device::Cpu,
                        )?;
                        var.set(&t)?;
                    }
                    a.save_peft_for(dir, &setup.modules, &base)?;
                    if setup.config.merge {
                        let merged_dir = crate::train::output::merged_dir(dir)?;
                        let (w, lora) = setup.parts(&self.params);
                        let tensors = w.iter().map(|(name, arr)| {
                            let module = name.strip_suffix(".weight").unwrap_or(name);
                            let arr = match lora.get(module) {
                                Some(l) => ops::matmul(&l.b, &l.a)
                                    .and_then(|d| ops::multiply(&d, Array::from_f32(l.scale)))
                                    .and_then(|d| ops::add(arr, &d))
                                    .map_err(mlx_err)?,
                                None => arr.clone(),
                            };
                            let dims = arr.shape().iter().map(|&d| d as usize).collect();
                            Ok((name.clone(), dims, host(&arr)?))
                        });
                        crate::train::output::write_full(
                            &setup.config.model,
                            &merged_dir,
                            tensors,
                        )?;
                    }
                    Ok(())
                }
                None => {
                    let tensors = setup.names.iter().zip(&self.params).map(|(name, p)| {
                        let dims = p.shape().iter().map(|&d| d as usize).collect();
                        Ok((name.clone(), dims, host(p)?))
                    });
                    crate::train::output::write_full(&setup.config.model, dir, tensors)
                }
            }
        })
    }
}

/// `sft` on MLX.
#[crate::trainer(task = "sft", backend = "mlx", crate = crate)]
pub struct MlxSftTrainer {
    stepper: MlxStepper,
}

impl crate::Trainer for MlxSftTrainer {
    fn new(config: &TrainConfig) -> Result<Self, TrainError> {
        if config.hyper.save_steps.is_some() {
            return Err(config_err(
                "save_steps",
                "resumable checkpoints are not written by the MLX backend yet (use --backend candle)",
            ));
        }
        let (setup, params) = MlxSetup::load(config)?;
        let sft = MlxSft::new(config, &setup.tokenizer)?;
        let eval = match &config.eval_data {
            Some(path) => {
                let mut c = config.clone();
                c.train_data = Some(path.clone());
                Some(MlxSft::new(&c, &setup.tokenizer)?)
            }
            None => None,
        };
        let zeros = |p: &Array| ops::zeros_like(p).map_err(mlx_err);
        let m = params.iter().map(zeros).collect::<Result<Vec<_>, _>>()?;
        let v = params.iter().map(zeros).collect::<Result<Vec<_>, _>>()?;
        let decay = setup
            .names
            .iter()
            .map(|n| crate::train::candle::optim::decays(n))
            .collect();
        Ok(MlxSftTrainer {
            stepper: MlxStepper {
                grads: vec![None; params.len()],
                setup,
                sft,
                eval,
                params,
                m,
                v,
                decay,
                step: 0,
            },
        })
    }

    fn train(&mut self, observer: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
        let config = self.stepper.setup.config.clone();
        drive(&config, &mut self.stepper, observer)
    }
}
