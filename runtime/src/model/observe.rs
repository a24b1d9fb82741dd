//! What a forward pass shows: the [`Observer`] seam calibration uses, and the max calibrator
//! (per-tensor and per-channel amax under ModelOpt's quantizer names).

use super::ModelError;
use candle_core::{D, DType, Tensor};
use std::collections::BTreeMap;

/// What a forward pass shows a calibration: the input of every Linear (by module path) and
/// the keys (after RoPE) and values of every attention module.
pub trait Observer {
    /// The input of the Linear at `module` (`[.., in_features]`).
    fn linear_input(&mut self, module: &str, x: &Tensor) -> Result<(), ModelError>;
    /// The keys and values `[batch, kv_heads, seq, head_dim]` of the attention at `attention`.
    fn key_value(&mut self, attention: &str, k: &Tensor, v: &Tensor) -> Result<(), ModelError>;
    /// The input of a quantizer that is not a Linear's `input_quantizer` (BMM experts:
    /// `<experts>.gate_up_proj_input_quantizer`, `<experts>.down_proj_input_quantizer`).
    fn quantizer_input(&mut self, quantizer: &str, x: &Tensor) -> Result<(), ModelError> {
        let _ = (quantizer, x);
        Ok(())
    }
    /// Whether every expert should also see every token (ModelOpt's optional
    /// `moe_calib_experts_ratio = 1`), besides the routed pass that gives the output.
    fn all_experts(&self) -> bool {
        false
    }
}

/// An observer that looks at nothing.
pub struct NoObserver;

impl Observer for NoObserver {
    fn linear_input(&mut self, _module: &str, _x: &Tensor) -> Result<(), ModelError> {
        Ok(())
    }
    fn key_value(&mut self, _attention: &str, _k: &Tensor, _v: &Tensor) -> Result<(), ModelError> {
        Ok(())
    }
}

/// Max calibration: per-tensor amax of every Linear input and of every attention's keys and
/// values, under ModelOpt's quantizer names (`<linear>.input_quantizer`,
/// `<attention>.k_bmm_quantizer`, `<attention>.v_bmm_quantizer`). A NaN input makes the amax
/// NaN.
#[derive(Debug, Clone)]
pub struct MaxCalibrator {
    amax: BTreeMap<String, f32>,
    all_experts: bool,
    /// Whether the experts of a block share their largest input amax at the end (ModelOpt).
    sync: bool,
    /// Keys and values: a moving average of each sample's (min, max) with this constant,
    /// rounded to bf16 after each step when the flag is set (llm-compressor's `minmax`).
    kv_average: Option<(f32, bool)>,
    /// The moving averages' state, by quantizer name.
    kv_state: BTreeMap<String, (f32, f32)>,
    /// Per-input-channel amax of every Linear input, when asked for (SmoothQuant).
    channels: Option<BTreeMap<String, Vec<f32>>>,
}

impl Default for MaxCalibrator {
    /// ModelOpt's default: each expert sees the tokens routed to it (its
    /// `moe_calib_experts_ratio` is unset), and the experts then share their maximum.
    fn default() -> Self {
        MaxCalibrator::new(false)
    }
}

/// max |x| over `x`, NaN if any value is NaN. A CPU tensor is read where it lies, by
/// `kiln_kernels::cpu::amax` (vectors, both cores; the same maximum as the fold below).
fn tensor_amax(x: &Tensor) -> Result<f32, ModelError> {
    use candle_core::{CpuStorage, Storage};
    if x.device().is_cpu() {
        let x = x.contiguous()?;
        let (g, l) = x.storage_and_layout();
        if let (Storage::Cpu(c), Some((a, b))) = (&*g, l.contiguous_offsets()) {
            match c {
                CpuStorage::BF16(v) => return Ok(kiln_kernels::cpu::amax(&v[a..b])),
                CpuStorage::F16(v) => return Ok(kiln_kernels::cpu::amax(&v[a..b])),
                CpuStorage::F32(v) => return Ok(kiln_kernels::cpu::amax(&v[a..b])),
                _ => {}
            }
        }
    }
    let v: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter().fold(0f32, |m, &a| {
        if m.is_nan() || a.is_nan() {
            f32::NAN
        } else {
            m.max(a.abs())
        }
    }))
}

impl MaxCalibrator {
    /// A calibrator; `all_experts`: every expert also sees every token (ModelOpt's
    /// `moe_calib_experts_ratio = 1`), else each expert sees only the tokens routed to it
    /// (ModelOpt's default).
    pub fn new(all_experts: bool) -> Self {
        MaxCalibrator {
            amax: BTreeMap::new(),
            all_experts,
            sync: true,
            kv_average: None,
            kv_state: BTreeMap::new(),
            channels: None,
        }
    }

    /// The calibrator `rules` ask for: ModelOpt's (routed tokens, the experts sharing their
    /// maximum; the KV cache's largest |value|) or llm-compressor's (every expert on every
    /// token, each its own statistics; the KV cache's moving average, kept in bf16 when
    /// `bf16`, the checkpoint's dtype).
    pub fn for_rules(rules: crate::export::writer::StatisticsRules, bf16: bool) -> Self {
        use crate::export::writer::MoeCalibration;
        let base = match rules.moe {
            MoeCalibration::RoutedShared => MaxCalibrator::new(false),
            MoeCalibration::AllTokensPerExpert => MaxCalibrator {
                sync: false,
                ..MaxCalibrator::new(true)
            },
        };
        MaxCalibrator {
            kv_average: rules.kv_moving_average.map(|c| (c, bf16)),
            ..base
        }
    }

    /// One sample's keys or values under llm-compressor's `minmax` observer: the first sets
    /// (min, max), each later one moves them by `c` of the way (torch's `lerp`), and the
    /// statistic is the larger magnitude of the two.
    fn kv_observe(
        &mut self,
        key: String,
        x: &Tensor,
        c: f32,
        bf16: bool,
    ) -> Result<(), ModelError> {
        let v: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let round = |a: f32| {
            if bf16 {
                half::bf16::from_f32(a).to_f32()
            } else {
                a
            }
        };
        let lo = round(v.iter().copied().fold(f32::INFINITY, f32::min));
        let hi = round(v.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        // torch.lerp: start + w·(end − start) for w < 0.5, in f32, then the tensor's dtype.
        let lerp = |s: f32, e: f32| round(s + c * (e - s));
        let state = self
            .kv_state
            .entry(key.clone())
            .and_modify(|(a, b)| {
                *a = lerp(*a, lo);
                *b = lerp(*b, hi);
            })
            .or_insert((lo, hi));
        let amax = state.0.abs().max(state.1.abs());
        self.amax.insert(key, amax);
        Ok(())
    }

    /// Whether the experts share their largest amax at the end ([`Self::sync_experts`]).
    pub fn syncs_experts(&self) -> bool {
        self.sync
    }

    /// Also records every Linear input's amax per input channel (SmoothQuant's statistics).
    pub fn with_channels(mut self) -> Self {
        self.channels = Some(BTreeMap::new());
        self
    }

    /// The per-channel input amax by Linear module path, when recorded.
    pub fn channels(&self) -> Option<&BTreeMap<String, Vec<f32>>> {
        self.channels.as_ref()
    }

    fn record(&mut self, key: String, a: f32) {
        let e = self.amax.entry(key).or_insert(0.0);
        *e = if e.is_nan() || a.is_nan() {
            f32::NAN
        } else {
            e.max(a)
        };
    }

    /// The amax seen so far, by quantizer name.
    pub fn amax(&self) -> &BTreeMap<String, f32> {
        &self.amax
    }

    /// Gives every expert of an MoE block the largest input amax among the experts, per
    /// Linear name (ModelOpt's `layer_sync_moe_local_experts_amax` after calibration),
    /// including experts no token reached. `linears` names every Linear module of the model
    /// (weight names without `.weight` are fine too: anything else is ignored).
    pub fn sync_experts<'a>(&mut self, linears: impl IntoIterator<Item = &'a str>) {
        // `<head>.experts.<i>.<rest>` → (head, rest).
        fn split(k: &str) -> Option<(String, String)> {
            let (head, tail) = k.split_once(".experts.")?;
            let (index, rest) = tail.split_once('.')?;
            index.parse::<usize>().ok()?;
            Some((head.to_string(), rest.to_string()))
        }
        fn nan_max(a: f32, b: f32) -> f32 {
            if a.is_nan() || b.is_nan() {
                f32::NAN
            } else {
                a.max(b)
            }
        }
        let mut max: BTreeMap<(String, String), f32> = BTreeMap::new();
        for (k, &v) in &self.amax {
            if let Some(g) = split(k).filter(|(_, r)| r.ends_with(".input_quantizer")) {
                let e = max.entry(g).or_insert(0.0);
                *e = nan_max(*e, v);
            }
        }
        let mut channel_max: BTreeMap<(String, String), Vec<f32>> = BTreeMap::new();
        for (k, v) in self.channels.iter().flatten() {
            if let Some(g) = split(k) {
                let e = channel_max.entry(g).or_insert_with(|| vec![0.0; v.len()]);
                for (a, &b) in e.iter_mut().zip(v) {
                    *a = nan_max(*a, b);
                }
            }
        }
        let mut modules: Vec<String> = self
            .amax
            .keys()
            .filter_map(|k| k.strip_suffix(".input_quantizer"))
            .map(str::to_string)
            .collect();
        modules.extend(
            linears
                .into_iter()
                .map(|m| m.strip_suffix(".weight").unwrap_or(m).to_string()),
        );
        for m in modules {
            let Some((head, rest)) = split(&m) else {
                continue;
            };
            if let Some(&v) = max.get(&(head.clone(), format!("{rest}.input_quantizer"))) {
                self.amax.insert(format!("{m}.input_quantizer"), v);
            }
            if let (Some(c), Some(v)) = (&mut self.channels, channel_max.get(&(head, rest))) {
                c.insert(m, v.clone());
            }
        }
    }
}

impl Observer for MaxCalibrator {
    fn linear_input(&mut self, module: &str, x: &Tensor) -> Result<(), ModelError> {
        if x.elem_count() == 0 {
            return Ok(());
        }
        self.record(format!("{module}.input_quantizer"), tensor_amax(x)?);
        if let Some(channels) = &mut self.channels {
            let k = x.dim(D::Minus1)?;
            let rows = x.elem_count() / k;
            let per: Vec<f32> = x
                .to_dtype(DType::F32)?
                .reshape((rows, k))?
                .abs()?
                .max(0)?
                .to_vec1()?;
            let e = channels
                .entry(module.to_string())
                .or_insert_with(|| vec![0.0; k]);
            for (a, b) in e.iter_mut().zip(per) {
                *a = a.max(b);
            }
        }
        Ok(())
    }
    fn quantizer_input(&mut self, quantizer: &str, x: &Tensor) -> Result<(), ModelError> {
        if x.elem_count() > 0 {
            self.record(quantizer.to_string(), tensor_amax(x)?);
        }
        Ok(())
    }
    fn key_value(&mut self, attention: &str, k: &Tensor, v: &Tensor) -> Result<(), ModelError> {
        if let Some((c, bf16)) = self.kv_average {
            self.kv_observe(format!("{attention}.k_bmm_quantizer"), k, c, bf16)?;
            return self.kv_observe(format!("{attention}.v_bmm_quantizer"), v, c, bf16);
        }
        self.record(format!("{attention}.k_bmm_quantizer"), tensor_amax(k)?);
        self.record(format!("{attention}.v_bmm_quantizer"), tensor_amax(v)?);
        Ok(())
    }
    fn all_experts(&self) -> bool {
        self.all_experts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The textbook amax: the largest |x| in f64, NaN if any value is NaN.
    fn textbook(t: &Tensor) -> Result<f32, ModelError> {
        let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        if v.iter().any(|x| x.is_nan()) {
            return Ok(f32::NAN);
        }
        Ok(v.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max) as f32)
    }

    #[test]
    fn tensor_amax_is_the_largest_magnitude_in_every_dtype_and_layout() -> Result<(), ModelError> {
        let (rows, cols) = (3, 4099);
        let base: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32) * 0.618).sin() * (1 + i % 7) as f32)
            .collect();
        let mut cases = vec![(base.clone(), (rows, cols)), (vec![-0.0; 64], (2, 32))];
        for (at, v) in [
            (5000, -1e30f32),
            (rows * cols - 1, f32::INFINITY),
            (17, f32::NAN),
        ] {
            let mut c = base.clone();
            c[at] = v;
            cases.push((c, (rows, cols)));
        }
        for (v, shape) in cases {
            let t = Tensor::from_vec(v, shape, &Device::Cpu)?;
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let t = t.to_dtype(dtype)?;
                // Contiguous, transposed and narrowed (both copied first), and rows at an
                // offset into the storage (read where they lie).
                let views = [
                    t.clone(),
                    t.t()?,
                    t.narrow(1, 1, shape.1 - 2)?,
                    t.narrow(0, 1, 1)?,
                ];
                for view in views {
                    let (got, want) = (tensor_amax(&view)?, textbook(&view)?);
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{dtype:?} {:?}: {got} against {want}",
                        view.dims()
                    );
                }
            }
        }
        Ok(())
    }
}
