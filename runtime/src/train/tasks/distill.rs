//! Knowledge distillation (TRL's `GKDTrainer`, `trl.experimental.gkd`): the student learns the
//! teacher's whole next-token distributions over each conversation's completion, by the
//! generalized Jensen–Shannon divergence ([`losses::generalized_jsd`]); with probability
//! `lmbda` a micro-batch's completions are the student's own samples (on-policy), with
//! `seq_kd` the teacher's.
//!
//! The teacher is any model kiln reads (a quantized export saves memory); it runs on candle
//! (CPU, no graph) whatever the student's backend, its logits handed to the student's.

use super::{MicroBatch, TensorOf, read_data};
use crate::model::DecoderModel;
use crate::model::generate::{Rng, SamplingConfig};
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::config_err;
use crate::train::data::{DataFormat, TextTokenizer};
use crate::train::losses;
use crate::train::ops::TensorOps;
use crate::train::runner::{OrTrain, Runner};
use candle_core::{Device, Tensor};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A conversation as GKD's collator (TRL's `DataCollatorForChatML`) tokenizes it: the whole
/// conversation rendered without special tokens, and where its last message begins.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The prompt's tokens (every message but the last, with the assistant's header).
    pub prompt: Vec<u32>,
    /// The last message's tokens.
    pub completion: Vec<u32>,
}

/// The conversations of `messages` data, cut to `max_length` as TRL's collator cuts them
/// (the completion's end kept; then as much of the prompt's end as fits).
pub fn conversations(
    data: &crate::train::data::Dataset,
    tok: &TextTokenizer,
    max_length: Option<usize>,
) -> Result<Vec<Conversation>, TrainError> {
    data.records
        .iter()
        .map(|r| {
            let err = |m: String| TrainError::Data {
                path: data.path.clone(),
                line: Some(r.line),
                message: m,
            };
            let messages = r.fields["messages"].as_array().cloned().unwrap_or_default();
            if messages.len() < 2 {
                return Err(err(
                    "distillation needs a prompt and a last message to learn (two messages or more)"
                        .into(),
                ));
            }
            let prompt = Value::Array(messages[..messages.len() - 1].to_vec());
            let prompt_text = tok.render_chat(&prompt, true, false).map_err(&err)?;
            let full = tok
                .render_chat(&Value::Array(messages), false, false)
                .map_err(&err)?;
            let (ids, offsets) = tok.encode_plain_offsets(&full).map_err(&err)?;
            let start = offsets
                .iter()
                .position(|&(s, _)| s >= prompt_text.len())
                .unwrap_or(ids.len());
            let (mut p, mut c) = (ids[..start].to_vec(), ids[start..].to_vec());
            if let Some(n) = max_length
                && p.len() + c.len() > n
            {
                if c.len() >= n {
                    c = c[c.len() - n..].to_vec();
                    p.clear();
                } else {
                    p = p[p.len() - (n - c.len())..].to_vec();
                }
            }
            Ok(Conversation {
                prompt: p,
                completion: c,
            })
        })
        .collect()
}

/// A micro-batch row's layout.
#[derive(Debug, Clone)]
struct Row {
    prompt: Vec<u32>,
    completion: Vec<u32>,
    /// Generated (on-policy or by the teacher): the prompts left-padded to the batch's longest,
    /// the completions after them (as `generate` lays a batch out); else the whole
    /// conversation left-padded (the collator's layout).
    generated: bool,
}

/// GKD (TRL's `GKDTrainer`): the generalized JSD between the student's and the teacher's
/// next-token distributions over each completion.
pub struct DistillTask {
    conversations: Vec<Conversation>,
    teacher: Arc<DecoderModel>,
    beta: f64,
    lmbda: f64,
    seq_kd: bool,
    sampling: SamplingConfig,
    /// The on-policy draws and the samplers' stream.
    rng: Rng,
    /// This step's generated rows, by example index.
    generated: BTreeMap<usize, Row>,
}

impl DistillTask {
    /// GKD's options, TRL's `GKDConfig` defaults: `teacher_model_name_or_path` (required;
    /// any model kiln reads), `beta` 0.5, `lmbda` 0.5, `temperature` 0.9 (sampling only, as
    /// TRL's loss takes the logits as they are), `max_new_tokens` 128, `seq_kd` false; data:
    /// `messages` conversations.
    pub fn new(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let data = read_data(config, &[DataFormat::Messages])?;
        let conversations = conversations(&data, tok, config.hyper.max_length)?;
        let teacher_path = config
            .option::<String>("teacher_model_name_or_path")?
            .ok_or_else(|| {
                config_err(
                    "teacher_model_name_or_path",
                    "distill needs the teacher model (a folder or file kiln reads, quantized or not)",
                )
            })?;
        let teacher = crate::formats::load_model(
            std::path::Path::new(&teacher_path),
            candle_core::DType::F32,
            &Device::Cpu,
            true,
        )
        .map_err(|e| config_err("teacher_model_name_or_path", format!("{teacher_path}: {e}")))?;
        if teacher.is_classifier() {
            return Err(config_err(
                "teacher_model_name_or_path",
                format!(
                    "{teacher_path} is a sequence classifier (a reward model); the teacher must be a causal language model"
                ),
            ));
        }
        let o = |k: &str| config.option::<f64>(k);
        let beta = o("beta")?.unwrap_or(0.5);
        let lmbda = o("lmbda")?.unwrap_or(0.5);
        for (name, v) in [("beta", beta), ("lmbda", lmbda)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(config_err(name, format!("{v} is not in [0, 1]")));
            }
        }
        let temperature = o("temperature")?.unwrap_or(0.9);
        if temperature <= 0.0 {
            return Err(config_err("temperature", "must be positive (GKD samples)"));
        }
        Ok(DistillTask {
            conversations,
            teacher: Arc::new(teacher),
            beta,
            lmbda,
            seq_kd: config.option::<bool>("seq_kd")?.unwrap_or(false),
            sampling: SamplingConfig {
                temperature,
                top_k: 0,
                max_new_tokens: config.option::<usize>("max_new_tokens")?.unwrap_or(128),
                eos: vec![tok.eos_id],
                ..SamplingConfig::default()
            },
            rng: Rng(config.hyper.seed ^ 0x0067_6b64),
            generated: BTreeMap::new(),
        })
    }

    /// Conversations in the set.
    pub fn examples(&self) -> usize {
        self.conversations.len()
    }

    /// The draws' stream position (saved with checkpoints).
    pub fn state(&self) -> Value {
        serde_json::json!({ "rng": self.rng.0 })
    }

    /// Restores [`DistillTask::state`].
    pub fn restore(&mut self, state: &Value) -> Result<(), TrainError> {
        if let Some(r) = state["rng"].as_u64() {
            self.rng.0 = r;
        }
        Ok(())
    }

    /// Evaluation: the data as it is, never generated (TRL evaluates the collator's batches).
    pub fn for_evaluation(&mut self) {
        self.lmbda = 0.0;
        self.seq_kd = false;
    }

    /// Per micro-batch of the step, TRL's `training_step`: with `seq_kd` the teacher's
    /// completions, then with probability `lmbda` the student's own.
    pub fn begin_step<R: Runner>(
        &mut self,
        r: &R,
        micro_batches: &[Vec<usize>],
    ) -> Result<(), TrainError> {
        self.generated.clear();
        for mb in micro_batches {
            if self.seq_kd {
                for &i in mb {
                    let prompt = self.prompt_of(i, r.tokenizer())?;
                    let c = crate::model::generate::sample(
                        &self.teacher,
                        &prompt,
                        1,
                        &self.sampling,
                        &mut self.rng,
                    )?
                    .remove(0);
                    self.generated.insert(
                        i,
                        Row {
                            prompt,
                            completion: c,
                            generated: true,
                        },
                    );
                }
            }
            if self.lmbda > 0.0 && self.rng.uniform() <= self.lmbda {
                for &i in mb {
                    let prompt = self.prompt_of(i, r.tokenizer())?;
                    let c = r
                        .sample(&prompt, 1, &self.sampling, &mut self.rng)?
                        .remove(0);
                    self.generated.insert(
                        i,
                        Row {
                            prompt,
                            completion: c,
                            generated: true,
                        },
                    );
                }
            }
        }
        Ok(())
    }

    /// Example `i`'s prompt (a BOS alone when truncation left it empty: generation needs one
    /// token to start from).
    fn prompt_of(&self, i: usize, tok: &TextTokenizer) -> Result<Vec<u32>, TrainError> {
        let p = self.conversations[i].prompt.clone();
        if !p.is_empty() {
            return Ok(p);
        }
        tok.bos_id.map(|b| vec![b]).ok_or_else(|| {
            config_err(
                "max_length",
                "a conversation cut to its completion leaves no prompt to generate from",
            )
        })
    }

    /// The loss of the examples `indices`: TRL's `compute_loss` over the collator's batch
    /// (left-padded; the completion read from the longest prompt's end on, as TRL slices it).
    pub fn loss<R: Runner>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let pad = r.pad_id();
        let rows: Vec<Row> = indices
            .iter()
            .map(|i| {
                self.generated.get(i).cloned().unwrap_or_else(|| Row {
                    prompt: self.conversations[*i].prompt.clone(),
                    completion: self.conversations[*i].completion.clone(),
                    generated: false,
                })
            })
            .collect();
        let p_max = rows
            .iter()
            .map(|r| r.prompt.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let generated = rows.iter().any(|r| r.generated);
        // The batch's length: the collator's longest conversation, or the longest prompt plus
        // the longest generation.
        let len = if generated {
            p_max + rows.iter().map(|r| r.completion.len()).max().unwrap_or(0)
        } else {
            rows.iter()
                .map(|r| r.prompt.len() + r.completion.len())
                .max()
                .unwrap_or(0)
        };
        if len <= p_max {
            return Err(config_err(
                "max_length",
                "a batch with no completion tokens after its longest prompt: nothing to distill",
            ));
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut attention = Vec::with_capacity(rows.len());
        let mut labelled = Vec::with_capacity(rows.len());
        for row in &rows {
            let (left, right) = if generated {
                (p_max - row.prompt.len(), len - p_max - row.completion.len())
            } else {
                (len - row.prompt.len() - row.completion.len(), 0)
            };
            let mut r_ids = vec![pad; left];
            r_ids.extend(&row.prompt);
            r_ids.extend(&row.completion);
            r_ids.extend(std::iter::repeat_n(pad, right));
            let start = left + row.prompt.len();
            let end = start + row.completion.len();
            // Generated rows: TRL masks every pad token (attention and labels).
            let att: Vec<bool> = (0..len)
                .map(|j| (left..end).contains(&j) && !(generated && r_ids[j] == pad))
                .collect();
            let lab: Vec<f32> = (p_max..len)
                .map(|j| f32::from(u8::from((start..end).contains(&j) && att[j])))
                .collect();
            ids.push(r_ids);
            attention.push(att);
            labelled.push(lab);
        }
        let width = len - p_max;
        let flat: Vec<f64> = labelled.iter().flatten().map(|&m| f64::from(m)).collect();
        let count: f64 = flat.iter().sum();
        let mask = ops.tensor(&flat, &[rows.len(), width]).tr()?;
        let tokens = attention
            .iter()
            .map(|a| a.iter().filter(|&&x| x).count() as u64)
            .sum();
        if let Some(jsd) = self.fused_jsd(r, &ids, &attention, p_max - 1..len - 1)? {
            // `generalized_jsd`'s mask and mean over the per-position values.
            let masked = ops.mul(&jsd, &mask).tr()?;
            let loss = ops
                .affine(&ops.sum_all(&masked).tr()?, 1.0 / count.max(1.0), 0.0)
                .tr()?;
            return Ok((loss, BTreeMap::new(), tokens));
        }
        let student = r.forward_masked(r.policy(), &ids, &attention)?;
        let student = ops.narrow(&student, 1, p_max - 1, width).tr()?;
        let teacher = self.teacher_logits(&ids, &attention, p_max - 1, width)?;
        let (sv, tv) = (
            ops.dims(&student).last().copied(),
            teacher.1.last().copied(),
        );
        if sv != tv {
            return Err(config_err(
                "teacher_model_name_or_path",
                format!(
                    "the teacher's vocabulary ({} tokens) is not the student's ({}): distillation compares their distributions token by token",
                    tv.unwrap_or(0),
                    sv.unwrap_or(0)
                ),
            ));
        }
        let teacher = ops.tensor_f32(&teacher.0, &teacher.1).tr()?;
        let loss =
            losses::generalized_jsd(ops, &student, &teacher, &mask, count, self.beta).tr()?;
        Ok((loss, BTreeMap::new(), tokens))
    }

    /// The per-position JSD `[batch, at.len()]` from the fused heads (the student's through the
    /// runner, the teacher's rows here), neither model's logits held; `None` where either head
    /// cannot run so (the caller takes the logits).
    fn fused_jsd<R: Runner>(
        &self,
        r: &R,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        at: std::ops::Range<usize>,
    ) -> Result<Option<TensorOf<R>>, TrainError> {
        let (b, t) = (ids.len(), ids.first().map_or(0, Vec::len));
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let x = Tensor::from_vec(flat, (b, t), &Device::Cpu)?;
        let scored = crate::model::HeadPositions {
            attention,
            positions: None,
            at: at.clone(),
            scale: 1.0,
        };
        let Some(teacher) = self.teacher.head_rows(&x, &scored)? else {
            return Ok(None);
        };
        let q = crate::train::runner::HeadQuery {
            ids,
            attention,
            positions: None,
            at,
            labels: &[],
            scale: 1.0,
        };
        r.forward_masked_jsd(r.policy(), &q, teacher, self.beta)
    }

    /// The teacher's logits at positions `from..from + width` of the batch, on the host.
    fn teacher_logits(
        &self,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        from: usize,
        width: usize,
    ) -> Result<(Vec<f32>, Vec<usize>), TrainError> {
        let (b, t) = (ids.len(), ids[0].len());
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let x = Tensor::from_vec(flat, (b, t), &Device::Cpu)?;
        let logits = self
            .teacher
            .forward_masked(&x, attention)?
            .detach()
            .narrow(1, from, width)?
            .to_dtype(candle_core::DType::F32)?;
        let dims = logits.dims().to_vec();
        Ok((logits.flatten_all()?.to_vec1()?, dims))
    }
}
