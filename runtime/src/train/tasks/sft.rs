//! Supervised fine-tuning (TRL's `SFTTrainer`): its examples and its loss.

use super::{MicroBatch, TensorOf, read_data};
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::config_err;
use crate::train::data::{
    DataFormat, Dataset, LmExample, TextTokenizer, field, split_ids, with_eos,
};
use crate::train::losses::{self, TokenInputs};
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
                let text = with_eos(field(r, "text"), &tok.eos_token);
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
/// tokens, the token mean over the whole optimisation step.
pub struct SftTask {
    examples: Vec<LmExample>,
    num_items: f64,
    /// `loss_type` dft (TRL's DFT loss) rather than nll.
    dft: bool,
}

impl SftTask {
    /// The examples of `config.train_data` (`text`, `prompt`+`completion` or `messages`),
    /// tokenized as TRL does; `completion_only_loss` (default on), `assistant_only_loss`.
    pub fn new(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let data = read_data(
            config,
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
            examples,
            num_items: 0.0,
            dft,
        })
    }

    /// Examples in the set.
    pub fn examples(&self) -> usize {
        self.examples.len()
    }

    /// Counts the step's label tokens (transformers' `num_items_in_batch`: `labels[..., 1:]`
    /// over every micro-batch of the step).
    pub fn begin_step(&mut self, micro_batches: &[Vec<usize>]) {
        self.num_items = micro_batches
            .iter()
            .flatten()
            .map(|&i| {
                self.examples[i]
                    .mask
                    .iter()
                    .skip(1)
                    .map(|&m| f64::from(m))
                    .sum::<f64>()
            })
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
            .map(|&i| (self.examples[i].ids.clone(), self.examples[i].mask.clone()))
            .collect();
        let s = r.forward_shifted(r.policy(), &seqs)?;
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
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        let mut m = BTreeMap::new();
        m.insert(
            "entropy".into(),
            Shifted::entropy(ops, &s.full_logits, &s.attention)?,
        );
        m.insert(
            "mean_token_accuracy".into(),
            s.token_accuracy(ops, 0..seqs.len())?,
        );
        m.insert("num_tokens".into(), 0.0);
        Ok((loss, m, tokens))
    }
}
