//! Perplexity (`kiln eval`): the mean next-token negative log-likelihood over samples.

use super::{DecoderModel, ModelError};
use candle_core::{DType, Tensor};

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
            .forward(&ids)?
            .to_dtype(DType::F32)?
            .squeeze(0)?
            .to_vec2()?;
        for (row, &target) in logits.iter().zip(&s[1..]) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[target as usize] as f64;
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
