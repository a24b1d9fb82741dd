//! Supervised fine-tuning (TRL's `SFTTrainer`): its examples and its loss.

use super::{MicroBatch, TensorOf, read_data};
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::config_err;
use crate::train::data::pack::{self, Strategy};
use crate::train::data::{
    DataFormat, Dataset, LmExample, TextTokenizer, field, split_ids, with_eos,
};
use crate::train::losses::{self, TokenInputs};
use crate::train::ops::TensorOps;
use crate::train::runner::{OrTrain, Runner, Shifted};
use serde_json::Value;
use std::collections::BTreeMap;

/// SFT examples (TRL's `SFTTrainer` preprocessing): `text` gets the EOS appended and every
/// token is a label; `prompt`+`completion` gets the EOS appended to the completion and, with
/// `completion_only_loss` (TRL's default for this format), only the completion's tokens are
/// labels. Sequences are cut to `max_length` tokens, keeping the start.
pub fn sft_examples(
    data: &Dataset,
    tok: &TextTokenizer,
    completion_only_loss: bool,
    max_length: Option<usize>,
) -> Result<Vec<LmExample>, TrainError> {
    sft_examples_with(data, tok, completion_only_loss, false, max_length)
}

/// [`sft_examples`] with TRL's `assistant_only_loss`: for `messages` data, only the tokens
/// the chat template marks with `{% generation %}` are labels. Conversational data is
/// rendered with the chat template (no EOS appended: the template writes its own end of
/// turn); a conversational `prompt`+`completion` is split at the prompt rendered with the
/// assistant's header.
pub fn sft_examples_with(
    data: &Dataset,
    tok: &TextTokenizer,
    completion_only_loss: bool,
    assistant_only_loss: bool,
    max_length: Option<usize>,
) -> Result<Vec<LmExample>, TrainError> {
    let mut out = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let chat_err = |m: String| TrainError::Data {
            path: data.path.clone(),
            line: Some(r.line),
            message: m,
        };
        let conversational = r.fields.get("prompt").is_some_and(Value::is_array);
        let mut ex = match data.format {
            DataFormat::Messages => {
                let (ids, gen_mask) = tok
                    .encode_chat(&r.fields["messages"], false)
                    .map_err(chat_err)?;
                let mask = if assistant_only_loss {
                    if !gen_mask.contains(&1) {
                        return Err(chat_err(
                            "assistant_only_loss needs assistant tokens, and the chat template marks none (it has no {% generation %} block)".into(),
                        ));
                    }
                    gen_mask
                } else {
                    vec![1; ids.len()]
                };
                LmExample { ids, mask }
            }
            DataFormat::PromptCompletion if conversational => {
                let prompt = &r.fields["prompt"];
                let mut all = prompt.as_array().cloned().unwrap_or_default();
                all.extend(
                    r.fields["completion"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default(),
                );
                let (p, _) = tok.encode_chat(prompt, true).map_err(&chat_err)?;
                let (ids, gen_mask) = tok
                    .encode_chat(&Value::Array(all), false)
                    .map_err(&chat_err)?;
                let mut mask: Vec<u8> = (0..ids.len())
                    .map(|i| u8::from(i >= p.len() || !completion_only_loss))
                    .collect();
                if assistant_only_loss {
                    for (m, g) in mask.iter_mut().zip(&gen_mask) {
                        *m &= g;
                    }
                }
                LmExample { ids, mask }
            }
            DataFormat::Text => {
                // TRL 0.29.1 appends the EOS only to a column named `text` (its `add_eos`
                // checks that name, whatever `dataset_text_field` says).
                let text = if data.text_field == "text" {
                    with_eos(field(r, "text"), &tok.eos_token)
                } else {
                    field(r, "text").to_string()
                };
                let ids = tok.encode(&text).map_err(|m| TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: format!("tokenizing: {m}"),
                })?;
                let mask = vec![1; ids.len()];
                LmExample { ids, mask }
            }
            DataFormat::PromptCompletion => {
                let prompt = field(r, "prompt");
                let full = format!(
                    "{prompt}{}",
                    with_eos(field(r, "completion"), &tok.eos_token)
                );
                let (p, c) = split_ids(tok, data, r, prompt, &full)?;
                let label = u8::from(!completion_only_loss);
                let mut mask = vec![label; p.len()];
                mask.extend(std::iter::repeat_n(1, c.len()));
                let mut ids = p;
                ids.extend(c);
                LmExample { ids, mask }
            }
            other => {
                return Err(TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: format!("sft does not take {} data", other.columns().join("+")),
                });
            }
        };
        if let Some(n) = max_length {
            ex.ids.truncate(n);
            ex.mask.truncate(n);
        }
        out.push(ex);
    }
    Ok(out)
}

/// Supervised fine-tuning (TRL's `SFTTrainer`): causal-LM cross-entropy over the label
/// tokens, the token mean over the whole optimisation step. `pretrain` is the same over raw
/// text, packed by default.
pub struct SftTask {
    /// The tokenized sequences, before packing.
    sequences: Vec<LmExample>,
    /// The training examples: each one sequence, or a packed bin of several (each sequence in
    /// a bin its own row — positions from 0, attending only to itself, as TRL's padding-free
    /// collator runs a bin).
    examples: Vec<Vec<LmExample>>,
    num_items: f64,
    /// `loss_type` dft (TRL's DFT loss) rather than nll.
    dft: bool,
    /// `sft` or `pretrain`.
    name: &'static str,
    /// The packing of the set (`None`: none).
    packing: Option<Packing>,
}

/// TRL's `packing` / `packing_strategy` (`eval_packing` for an evaluation set): the strategy
/// and its `max_length`, or `None` without packing.
fn packing_of(config: &TrainConfig, eval: bool) -> Result<Option<Packing>, TrainError> {
    let train = config
        .option::<bool>("packing")?
        .unwrap_or(config.task == "pretrain");
    let on = if eval {
        config.option::<bool>("eval_packing")?.unwrap_or(train)
    } else {
        train
    };
    if !on {
        return Ok(None);
    }
    let name = config
        .option::<String>("packing_strategy")?
        .unwrap_or_else(|| "bfd".into());
    let strategy = Strategy::parse(&name).ok_or_else(|| {
        config_err(
            "packing_strategy",
            format!("`{name}` is not one of {}", Strategy::NAMES.join(", ")),
        )
    })?;
    let n = config.hyper.max_length.ok_or_else(|| {
        config_err(
            "max_length",
            "packing needs max_length (the packed length), as TRL requires",
        )
    })?;
    // TRL's padding-free collator runs bfd's bins (or any, with `padding_free`) one
    // sequence per position run; the other bins are single streams.
    let isolate =
        strategy == Strategy::Bfd || config.option::<bool>("padding_free")?.unwrap_or(false);
    Ok(Some(Packing {
        strategy,
        length: n,
        isolate,
    }))
}

/// How a set is packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packing {
    strategy: Strategy,
    /// `max_length`: a bin's tokens.
    length: usize,
    /// Each sequence of a bin attends only to itself, its positions from 0 (TRL's
    /// padding-free batches); else a bin is one stream.
    isolate: bool,
}

/// The training examples of `sequences`: packed, or each alone cut to `max_length`.
fn examples_of(
    sequences: &[LmExample],
    packing: Option<Packing>,
    max_length: Option<usize>,
) -> Vec<Vec<LmExample>> {
    match packing {
        Some(p) if p.isolate => pack::pack(sequences, p.length, p.strategy),
        Some(p) => pack::pack(sequences, p.length, p.strategy)
            .into_iter()
            .map(|bin| {
                vec![LmExample {
                    ids: bin.iter().flat_map(|e| e.ids.iter().copied()).collect(),
                    mask: bin.iter().flat_map(|e| e.mask.iter().copied()).collect(),
                }]
            })
            .collect(),
        None => sequences
            .iter()
            .map(|e| {
                let mut e = e.clone();
                if let Some(n) = max_length {
                    e.ids.truncate(n);
                    e.mask.truncate(n);
                }
                vec![e]
            })
            .collect(),
    }
}

impl SftTask {
    /// The examples of `config.train_data` (`text`, `prompt`+`completion` or `messages`),
    /// tokenized as TRL does; `completion_only_loss` (default on), `assistant_only_loss`.
    pub fn new(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let pretrain = config.task == "pretrain";
        let formats: &[DataFormat] = if pretrain {
            &[DataFormat::Text]
        } else {
            &[
                DataFormat::Text,
                DataFormat::PromptCompletion,
                DataFormat::Messages,
            ]
        };
        let data = read_data(config, formats)?;
        let completion_only = config
            .option::<bool>("completion_only_loss")?
            .unwrap_or(true);
        let assistant_only = config
            .option::<bool>("assistant_only_loss")?
            .unwrap_or(false);
        // Cut to max_length by packing or, without it, here (TRL's truncate_dataset).
        let sequences = sft_examples_with(&data, tok, completion_only, assistant_only, None)?;
        let packing = packing_of(config, false)?;
        let examples = examples_of(&sequences, packing, config.hyper.max_length);
        let dft = match config.option::<String>("loss_type")?.as_deref() {
            None | Some("nll") => false,
            Some("dft") => true,
            Some(other) => {
                return Err(config_err(
                    "loss_type",
                    format!("`{other}` is not one of nll, dft (TRL's SFTConfig)"),
                ));
            }
        };
        Ok(SftTask {
            sequences,
            examples,
            num_items: 0.0,
            dft,
            name: if pretrain { "pretrain" } else { "sft" },
            packing,
        })
    }

    /// `sft` or `pretrain`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Examples in the set (packed bins when packing).
    pub fn examples(&self) -> usize {
        self.examples.len()
    }

    /// Makes this task (built from the evaluation data) the evaluation's: packed as
    /// `eval_packing` says (default: as training).
    pub fn for_evaluation(&mut self, config: &TrainConfig) -> Result<(), TrainError> {
        let packing = packing_of(config, true)?;
        if packing != self.packing {
            self.examples = examples_of(&self.sequences, packing, config.hyper.max_length);
            self.packing = packing;
        }
        Ok(())
    }

    /// Counts the step's label tokens (transformers' `num_items_in_batch`: `labels[..., 1:]`
    /// over every micro-batch of the step).
    pub fn begin_step(&mut self, micro_batches: &[Vec<usize>]) {
        self.num_items = micro_batches
            .iter()
            .flatten()
            .flat_map(|&i| &self.examples[i])
            .map(|e| e.mask.iter().skip(1).map(|&m| f64::from(m)).sum::<f64>())
            .sum();
    }

    /// The loss of the examples `indices` (the token mean over the step), TRL's `entropy`
    /// (over the attention mask), `mean_token_accuracy` and `num_tokens`.
    pub fn loss<R: Runner>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let seqs: Vec<(Vec<u32>, Vec<u8>)> = indices
            .iter()
            .flat_map(|&i| &self.examples[i])
            .map(|e| (e.ids.clone(), e.mask.clone()))
            .collect();
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        if seqs.iter().all(|(i, _)| i.len() == 1) {
            // Only one-token sequences (a packed bin of them): nothing to predict, as TRL's
            // padding-free row masks every label; the loss is zero (kept on the graph) and
            // the entropy that of those tokens.
            let ids: Vec<Vec<u32>> = seqs.iter().map(|(i, _)| i.clone()).collect();
            let attention = vec![vec![true]; ids.len()];
            let logits = r.forward_masked(r.policy(), &ids, &attention)?;
            let loss = ops.affine(&ops.sum_all(&logits).tr()?, 0.0, 0.0).tr()?;
            let mut m = BTreeMap::new();
            let weights = vec![vec![1f32]; ids.len()];
            m.insert("entropy".into(), Shifted::entropy(ops, &logits, &weights)?);
            m.insert("mean_token_accuracy".into(), 0.0);
            m.insert("num_tokens".into(), 0.0);
            return Ok((loss, m, tokens));
        }
        let s = r.forward_shifted(r.policy(), &seqs, false)?;
        let inputs = TokenInputs {
            logps: s.logps.clone(),
            mask: s.mask.clone(),
            mask_host: s.mask_host.clone(),
        };
        let loss = if self.dft {
            losses::sft_dft(ops, &inputs, self.num_items).tr()?
        } else {
            losses::sft(ops, &inputs, self.num_items).tr()?
        };
        let mut m = BTreeMap::new();
        m.insert("entropy".into(), s.entropy_over(ops, &s.attention, true)?);
        m.insert(
            "mean_token_accuracy".into(),
            s.token_accuracy(ops, 0..seqs.len())?,
        );
        m.insert("num_tokens".into(), 0.0);
        Ok((loss, m, tokens))
    }
}
