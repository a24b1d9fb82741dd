//! Calibration data (`--calib FILE`): JSONL, one sample per line, `{"input_ids": [...]}`.
//! Lines of `{"text": ...}` need the model's tokenizer, which kiln does not run yet: they are a
//! named error rather than silently skipped.

use super::{DecoderModel, MaxCalibrator, ModelError};
use candle_core::Tensor;
use std::path::Path;

/// Reads up to `size` samples (all when `None`), each cut to `seq_len` tokens when given.
pub fn read_samples(
    path: &Path,
    size: Option<usize>,
    seq_len: Option<usize>,
) -> Result<Vec<Vec<u32>>, ModelError> {
    let bad =
        |line: usize, m: &str| ModelError::Config(format!("{}: line {line}: {m}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
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
            (None, Some(_)) => {
                return Err(bad(
                    i + 1,
                    "`text` samples need the model's tokenizer, which kiln does not run yet; give `input_ids`",
                ));
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
        return Err(ModelError::Config(format!(
            "{}: no calibration samples",
            path.display()
        )));
    }
    Ok(samples)
}

/// Max calibration of `model` over `samples`, one sample at a time; `progress` is told
/// after each.
pub fn calibrate_max(
    model: &DecoderModel,
    samples: &[Vec<u32>],
    mut progress: impl FnMut(usize),
) -> Result<MaxCalibrator, ModelError> {
    let mut calib = MaxCalibrator::default();
    for (i, s) in samples.iter().enumerate() {
        let ids = Tensor::from_vec(s.clone(), (1, s.len()), model.device())?;
        model.forward_observed(&ids, &mut calib)?;
        progress(i + 1);
    }
    calib.sync_experts();
    Ok(calib)
}
