//! Perplexity (`kiln eval`): the mean next-token negative log-likelihood over samples.

use super::{DecoderModel, ModelError};
use candle_core::{DType, Tensor};
use rayon::prelude::*;

/// What an evaluation measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    /// exp(mean NLL).
    pub perplexity: f64,
    /// Mean negative log-likelihood per predicted token (nats).
    pub nll: f64,
    /// Tokens predicted (each sample's length − 1).
    pub predicted: usize,
    /// Tokens run through the model.
    pub tokens: usize,
    /// Seconds spent.
    pub seconds: f64,
}

/// `ln Σ exp(x)` of a row of logits, in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    max + row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

/// The perplexity of `model` on `samples` (token ids), one sample at a time.
pub fn perplexity(model: &DecoderModel, samples: &[Vec<u32>]) -> Result<Perplexity, ModelError> {
    let started = std::time::Instant::now();
    let (mut nll, mut predicted, mut tokens) = (0f64, 0usize, 0usize);
    for s in samples {
        tokens += s.len();
        if s.len() < 2 {
            continue;
        }
        let ids = Tensor::from_vec(s.clone(), (1, s.len()), model.device())?;
        let logits: Vec<Vec<f32>> = model
            .forward_inference(&ids)?
            .to_dtype(DType::F32)?
            .squeeze(0)?
            .to_vec2()?;
        for (row, &target) in logits.iter().zip(&s[1..]) {
            nll += log_sum_exp(row) - row[target as usize] as f64;
            predicted += 1;
        }
    }
    if predicted == 0 {
        return Err(ModelError::Config(
            "no sample has two tokens: nothing to predict".into(),
        ));
    }
    let mean = nll / predicted as f64;
    Ok(Perplexity {
        perplexity: mean.exp(),
        nll: mean,
        predicted,
        tokens,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// A plain text's token ids under the tokenizer at `path` (`tokenizer.json`) as llama.cpp's
/// tools tokenize it (`common_tokenize(ctx, text, add_special = true)`): the BOS first where
/// the tokenizer adds one (so chunk boundaries fall where llama-perplexity's and
/// llama-imatrix's do), no other special token; and that BOS (`None` when it adds none).
pub fn tokenize_text(
    path: &std::path::Path,
    text: &str,
) -> Result<(Vec<u32>, Option<u32>), ModelError> {
    let t = tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::file(path, e))?;
    let bos = t
        .encode("", true)
        .map_err(|e| ModelError::file(path, e))?
        .get_ids()
        .first()
        .copied();
    let text_ids = t
        .encode(text, false)
        .map_err(|e| ModelError::file(path, format!("tokenizing: {e}")))?;
    let ids = bos
        .into_iter()
        .chain(text_ids.get_ids().iter().copied())
        .collect();
    Ok((ids, bos))
}

/// llama-perplexity's protocol (`tools/perplexity/perplexity.cpp`, `perplexity()`): the text's
/// tokens cut into non-overlapping chunks of `ctx`, the first token of each replaced by `bos`
/// when the tokenizer adds one, and in each chunk the tokens after its first half scored —
/// position `i ∈ [ctx/2, ctx − 1)` predicting token `i + 1` — so every scored token has at
/// least `ctx/2` tokens of context. A leftover shorter than `ctx` is not used.
pub fn chunks(ids: &[u32], ctx: usize, bos: Option<u32>) -> Vec<Vec<u32>> {
    ids.chunks_exact(ctx)
        .map(|c| {
            let mut c = c.to_vec();
            if let Some(b) = bos {
                c[0] = b;
            }
            c
        })
        .collect()
}

/// The log-softmax rows of the scored positions of one chunk (`[ctx/2, ctx − 1)`), f64.
fn scored_log_probs(model: &DecoderModel, chunk: &[u32]) -> Result<Vec<Vec<f64>>, ModelError> {
    let ctx = chunk.len();
    let ids = Tensor::from_vec(chunk.to_vec(), (1, ctx), model.device())?;
    // The output layer on the scored rows alone.
    let logits = model
        .forward_inference_from(&ids, ctx / 2)?
        .to_dtype(DType::F32)?
        .squeeze(0)?
        .narrow(0, 0, ctx - 1 - ctx / 2)?;
    let rows: Vec<Vec<f32>> = logits.to_vec2()?;
    Ok(rows
        .into_par_iter()
        .map(|row| {
            let lse = log_sum_exp(&row);
            row.iter().map(|&x| x as f64 - lse).collect()
        })
        .collect())
}

/// What [`chunked`] measured: perplexity and, against a reference model, llama-perplexity's
/// `--kl-divergence` figures.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkedEval {
    /// Chunks of `ctx` tokens evaluated.
    pub chunks: usize,
    /// Tokens scored (`chunks · (ctx − 1 − ctx/2)`).
    pub scored: usize,
    /// exp(mean NLL) of the model.
    pub perplexity: f64,
    /// Its standard error, as llama-perplexity estimates it (`ppl · σ(nll) / √n`).
    pub perplexity_stderr: f64,
    /// Against the reference, when one was given.
    pub kl: Option<KlDivergence>,
    /// Seconds spent.
    pub seconds: f64,
}

/// The model's distributions against a reference model's, token by token.
#[derive(Debug, Clone, PartialEq)]
pub struct KlDivergence {
    /// The reference's perplexity on the same tokens.
    pub reference_perplexity: f64,
    /// Mean of `KL(P_ref ‖ P)` over the scored tokens (nats).
    pub mean: f64,
    /// Median.
    pub median: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// The share of tokens whose most likely next token is the reference's ("Same top p").
    pub top1: f64,
}

/// The `q`-quantile of sorted `v` by linear interpolation (numpy's default).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let x = q * (v.len() - 1) as f64;
    let (i, f) = (x.floor() as usize, x - x.floor());
    if i + 1 < v.len() {
        v[i] * (1.0 - f) + v[i + 1] * f
    } else {
        v[i]
    }
}

/// `model` (and `reference`, if given) on `chunks` ([`chunks`]), one chunk at a time;
/// `progress(done, total)`.
pub fn chunked(
    model: &DecoderModel,
    reference: Option<&DecoderModel>,
    chunks: &[Vec<u32>],
    mut progress: impl FnMut(usize, usize),
) -> Result<ChunkedEval, ModelError> {
    let started = std::time::Instant::now();
    let Some(ctx) = chunks.first().map(Vec::len) else {
        return Err(ModelError::Config(
            "the text has fewer tokens than one chunk (--ctx)".into(),
        ));
    };
    if ctx < 4 {
        return Err(ModelError::Config(format!(
            "--ctx {ctx}: at least 4 tokens"
        )));
    }
    let (mut nlls, mut ref_nll, mut kls, mut same) = (Vec::new(), 0f64, Vec::new(), 0usize);
    for (c, chunk) in chunks.iter().enumerate() {
        let lp = scored_log_probs(model, chunk)?;
        let targets = &chunk[ctx / 2 + 1..];
        let rlp = reference.map(|r| scored_log_probs(r, chunk)).transpose()?;
        for (i, (row, &t)) in lp.iter().zip(targets).enumerate() {
            nlls.push(-row[t as usize]);
            if let Some(rlp) = &rlp {
                let base = &rlp[i];
                ref_nll -= base[t as usize];
                kls.push(
                    base.iter()
                        .zip(row)
                        .map(|(&b, &q)| b.exp() * (b - q))
                        .sum::<f64>()
                        .max(0.0),
                );
                let argmax = |r: &[f64]| {
                    r.iter()
                        .enumerate()
                        .fold(
                            (0, f64::NEG_INFINITY),
                            |m, (j, &x)| if x > m.1 { (j, x) } else { m },
                        )
                        .0
                };
                same += usize::from(argmax(base) == argmax(row));
            }
        }
        progress(c + 1, chunks.len());
    }
    let n = nlls.len() as f64;
    let mean = nlls.iter().sum::<f64>() / n;
    let var = nlls.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let ppl = mean.exp();
    let kl = reference.map(|_| {
        let mut sorted = kls.clone();
        sorted.sort_by(f64::total_cmp);
        KlDivergence {
            reference_perplexity: (ref_nll / n).exp(),
            mean: kls.iter().sum::<f64>() / n,
            median: quantile(&sorted, 0.5),
            p99: quantile(&sorted, 0.99),
            max: sorted.last().copied().unwrap_or(0.0),
            top1: same as f64 / n,
        }
    });
    Ok(ChunkedEval {
        chunks: chunks.len(),
        scored: nlls.len(),
        perplexity: ppl,
        perplexity_stderr: ppl * (var / n).sqrt(),
        kl,
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_llama_perplexity() {
        let ids: Vec<u32> = (10..30).collect();
        // 20 tokens, ctx 8: two chunks, the leftover 4 dropped, each starting with BOS.
        let c = chunks(&ids, 8, Some(1));
        assert_eq!(
            c,
            [
                vec![1, 11, 12, 13, 14, 15, 16, 17],
                vec![1, 19, 20, 21, 22, 23, 24, 25]
            ]
        );
        assert_eq!(chunks(&ids, 8, None)[1][0], 18);
        assert!(chunks(&ids, 21, None).is_empty());
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.5), 2.5);
        assert!((quantile(&[1.0, 2.0, 3.0, 4.0], 0.99) - (3.0 * 0.03 + 4.0 * 0.97)).abs() < 1e-12);
    }
}
