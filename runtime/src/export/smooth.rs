//! AWQ and SmoothQuant with given scales (docs/FORMATS.md §4.2): the weight smoothing, the resmooth
//! of Linears that share an input, and the folding of the shared scale into the norm that
//! produces that input — ModelOpt's arithmetic, step for step.
//!
//! The per-input-channel scales `p` come from calibration: `kiln export --calib` searches
//! them (AWQ, `calibrate::awq`) or computes them (SmoothQuant), or `--act-amax` gives them
//! (`<linear>.input_quantizer._pre_quant_scale`). For a Linear
//! with weight `W`:
//! 1. smooth: `W₁ = round(W · (1/p))` per input channel, in f32 (`1/p` in f32, `p` as given:
//!    ModelOpt smooths by its f32 search result), rounded to the weight's dtype; the quantizer
//!    then holds `p` in the weight's dtype, and the steps below start from that;
//! 2. resmooth a shared-input group (q/k/v, gate/up): `avg = mean(p_i)` as PyTorch computes it
//!    on the CPU (an f32 mean rounded once to the dtype); a member whose
//!    `p_i ≠ avg` becomes `round(W₁ · p_i / avg)` in f32;
//! 3. AWQ formats fold `avg` into the producing norm (`round(norm · avg)`) and write no
//!    `pre_quant_scale` for the group; other Linears (o_proj, down_proj) and every SmoothQuant
//!    Linear keep `pre_quant_scale = avg` in the weight's dtype.

use super::ExportError;
use super::groups::input_group;
use super::recipe::{Format, Recipe};
use crate::export::act_amax::ActAmax;
use crate::module_tree::{Linear, ModuleTree};
use kiln_kernels::Element;
use std::collections::HashMap;

/// How one Linear is smoothed.
#[derive(Debug, Clone)]
pub struct LinearSmoothing {
    /// Its own scale `p` (one per input channel) as given, in f32: step 1 divides by it.
    pub own: Vec<f32>,
    /// NVFP4 AWQ: the next Linear's scale, folded into this one's output rows (ModelOpt's
    /// `fuse_prequant_to_linear`: o_proj's into v_proj, down_proj's into up_proj).
    pub row_scale: Option<Vec<f32>>,
    /// Resmooths in order, each `(from, to)`: the weight becomes `W · from / to` where the two
    /// differ (the mean over experts of one Linear name, then over a shared-input group).
    pub steps: Vec<(Vec<f32>, Vec<f32>)>,
    /// The scale written as its `pre_quant_scale`; `None` when it went into the previous
    /// Linear's rows or into a norm.
    pub scale: Option<Vec<f32>>,
}

/// `fuse_prequant_to_linear`'s pairs: in a module whose class name contains one of the
/// names, the first Linear absorbs the second's scale in its output rows.
const PREQUANT_FUSION: [(&[&str], (&str, &str)); 2] = [
    (
        &["LlamaAttention", "Qwen3Attention", "Qwen3MoeAttention"],
        ("v_proj", "o_proj"),
    ),
    (
        &["LlamaMLP", "Qwen3MLP", "Qwen3MoeMLP"],
        ("up_proj", "down_proj"),
    ),
];

/// The smoothing of one export: per Linear, and the norms that absorb a group's scale.
#[derive(Debug, Clone, Default)]
pub struct SmoothPlan {
    linears: HashMap<String, LinearSmoothing>,
    /// Norm weight tensor → the factor it is multiplied by.
    norms: HashMap<String, Vec<f32>>,
}

/// The formats whose Linears are smoothed by a pre-quant scale.
pub fn uses_pre_quant_scale(format: Format) -> bool {
    matches!(
        format,
        Format::Int4Awq | Format::W4a8Awq | Format::Nvfp4Awq | Format::Int8Sq
    )
}

/// The formats that fold a group's scale into its norm (every AWQ format; SmoothQuant keeps
/// the scale on each Linear).
fn folds_into_norm(format: Format) -> bool {
    matches!(format, Format::Int4Awq | Format::W4a8Awq | Format::Nvfp4Awq)
}

/// The norm producing the input of a shared-input group under `parent` (`<layer>.self_attn` or
/// `<layer>.mlp`), in the decoder families' layout.
fn producing_norm(tree: &ModuleTree, group_parent: &str) -> Option<String> {
    let (layer, block) = group_parent.rsplit_once('.')?;
    let norm = match block {
        "self_attn" => "input_layernorm",
        "mlp" => "post_attention_layernorm",
        _ => return None,
    };
    let path = format!("{layer}.{norm}");
    tree.find(&path)
        .filter(|m| m.tensor("weight").is_some())
        .map(|_| format!("{path}.weight"))
}

/// PyTorch's CPU `torch.stack(scales).mean(0)` in a 16-bit dtype: the sum accumulated in f32,
/// divided by the count in f32, rounded once to the dtype.
fn mean_as<T: Element>(scales: &[&[f32]]) -> Vec<f32> {
    let n = scales.len() as f32;
    (0..scales[0].len())
        .map(|c| {
            let sum = scales.iter().fold(0f32, |acc, s| acc + s[c]);
            T::round_f32(sum / n)
        })
        .collect()
}

impl SmoothPlan {
    /// The plan for `recipe` over `tree`, with the scales in `act`; `None` for formats without
    /// pre-quant scales. Every quantized Linear needs a scale of its input width; MoE experts
    /// are refused (ModelOpt averages scales across experts; not implemented).
    ///
    /// Long on purpose: the checks on the given scales, then ModelOpt's steps in its order
    /// (each Linear's own scale, the NVFP4-AWQ pre-quant fusion, the mean over experts, the
    /// shared-input groups and their norms).
    pub fn build<T: Element>(
        tree: &ModuleTree,
        recipe: &Recipe,
        act: &ActAmax,
        in_features: impl Fn(&str) -> Option<usize>,
        out_features: impl Fn(&str) -> Option<usize>,
    ) -> Result<Option<Self>, ExportError> {
        let format = recipe.format;
        if act.has_weight_amax() && format != Format::Int4Awq {
            return Err(ExportError::Unsupported {
                target: "<linear>.weight_quantizer".into(),
                format,
                reason: "does not take weight amax (AWQ's clipping search): only int4-awq does"
                    .into(),
            });
        }
        if !uses_pre_quant_scale(format) {
            return Ok(None);
        }
        let quantized: Vec<String> = tree
            .walk()
            .filter(|m| {
                m.class_chain().is::<Linear>()
                    && m.tensor("weight").is_some()
                    && recipe.quantizes(m.path())
            })
            .map(|m| m.path().to_string())
            .collect();
        // Experts stored as 3-D tensors have no per-expert Linears to smooth.
        if let Some(m) = tree.walk().find(|m| {
            m.local_name() == "experts"
                && !super::moe::is_iterable_experts(m)
                && m.tensors().iter().any(|t| t.shape.len() == 3)
        }) {
            return Err(ExportError::Unsupported {
                target: m.path().to_string(),
                format,
                reason: "cannot export 3-D experts yet: AWQ / SmoothQuant scales are per expert Linear; leave them unquantized with --exclude '*.experts*' or choose another format".into(),
            });
        }
        let missing: Vec<String> = quantized
            .iter()
            .filter(|m| act.pre_quant_scale(m).is_none())
            .map(|m| format!("{m}.input_quantizer._pre_quant_scale"))
            .collect();
        if !missing.is_empty() {
            return Err(ExportError::MissingActAmax {
                format,
                quantizers: missing,
            });
        }
        for m in &quantized {
            let (got, want) = (
                act.pre_quant_scale(m).map_or(0, <[f32]>::len),
                in_features(m).unwrap_or(0),
            );
            if got != want {
                return Err(ExportError::StatisticLength {
                    quantizer: format!("{m}.input_quantizer._pre_quant_scale"),
                    found: got,
                    expected: format!("the Linear has {want} input channels"),
                });
            }
        }
        let mut plan = SmoothPlan::default();
        for m in &quantized {
            // The weight is smoothed by the scale as given (ModelOpt smooths by its f32 search
            // result); the quantizer stores it in the weight's dtype.
            let own = act.pre_quant_scale(m).unwrap_or_default().to_vec();
            let stored = own.iter().map(|&x| T::round_f32(x)).collect();
            plan.linears.insert(
                m.clone(),
                LinearSmoothing {
                    scale: Some(stored),
                    own,
                    row_scale: None,
                    steps: Vec::new(),
                },
            );
        }
        // ModelOpt's order: the pre-quant fusion (NVFP4 AWQ), the mean over experts (AWQ),
        // then shared-input groups.
        if format == Format::Nvfp4Awq {
            plan.fuse_prequant_to_linear(tree, &out_features);
        }
        if folds_into_norm(format) {
            plan.average_over_experts::<T>(tree);
        }
        for m in &quantized {
            let module = tree
                .find(m)
                .ok_or_else(|| ExportError::MissingModule { module: m.clone() })?;
            let group: Vec<String> = input_group(module, |p| recipe.quantizes(p))
                .into_iter()
                .filter(|g| plan.linears.get(g).is_some_and(|l| l.scale.is_some()))
                .collect();
            if group.len() < 2 || group[0] != *m {
                continue;
            }
            let norm = folds_into_norm(format)
                .then(|| module.parent().and_then(|p| producing_norm(tree, p.path())))
                .flatten();
            let avg = plan.resmooth::<T>(&group);
            if let Some(norm) = norm {
                for g in &group {
                    if let Some(l) = plan.linears.get_mut(g) {
                        l.scale = None;
                    }
                }
                plan.norms.insert(norm, avg);
            }
        }
        Ok(Some(plan))
    }

    /// Resmooths `members` (all holding a scale) to the mean of their scales; returns it.
    fn resmooth<T: Element>(&mut self, members: &[String]) -> Vec<f32> {
        let current: Vec<Vec<f32>> = members
            .iter()
            .map(|m| self.linears[m].scale.clone().unwrap_or_default())
            .collect();
        let views: Vec<&[f32]> = current.iter().map(Vec::as_slice).collect();
        let avg = mean_as::<T>(&views);
        for (m, from) in members.iter().zip(current) {
            if let Some(l) = self.linears.get_mut(m) {
                l.steps.push((from, avg.clone()));
                l.scale = Some(avg.clone());
            }
        }
        avg
    }

    /// AWQ on MoE: every expert's Linear of one name is resmoothed to the mean over experts
    /// (`get_experts_list` + `preprocess_linear_fusion(resmooth_only=True)`).
    fn average_over_experts<T: Element>(&mut self, tree: &ModuleTree) {
        for experts in tree.walk().filter(|m| super::moe::is_iterable_experts(m)) {
            let mut names: Vec<&str> = Vec::new();
            for e in experts.children() {
                for l in e.children() {
                    if !names.contains(&l.local_name()) {
                        names.push(l.local_name());
                    }
                }
            }
            for name in names {
                let members: Vec<String> = experts
                    .children()
                    .filter_map(|e| e.child(name))
                    .map(|l| l.path().to_string())
                    .filter(|p| self.linears.get(p).is_some_and(|l| l.scale.is_some()))
                    .collect();
                if members.len() > 1 {
                    self.resmooth::<T>(&members);
                }
            }
        }
    }

    /// NVFP4 AWQ, before any resmooth: v_proj takes o_proj's scale and up_proj down_proj's,
    /// in their output rows, when the sizes agree (a GQA v_proj is narrower: skipped, as
    /// ModelOpt does); the giver then writes no `pre_quant_scale`.
    fn fuse_prequant_to_linear(
        &mut self,
        tree: &ModuleTree,
        out_features: &impl Fn(&str) -> Option<usize>,
    ) {
        for module in tree.walk() {
            for (classes, (into, from)) in PREQUANT_FUSION {
                if !classes.iter().any(|c| module.class_name().contains(c)) {
                    continue;
                }
                let (into, from) = (
                    format!("{}.{into}", module.path()),
                    format!("{}.{from}", module.path()),
                );
                let Some(scale) = self.linears.get(&from).and_then(|l| l.scale.clone()) else {
                    continue;
                };
                if out_features(&into) != Some(scale.len()) || !self.linears.contains_key(&into) {
                    continue;
                }
                if let Some(l) = self.linears.get_mut(&into) {
                    l.row_scale = Some(scale);
                }
                if let Some(l) = self.linears.get_mut(&from) {
                    l.scale = None;
                }
            }
        }
    }

    /// How the Linear at `module` is smoothed, if it is.
    pub fn linear(&self, module: &str) -> Option<&LinearSmoothing> {
        self.linears.get(module)
    }

    /// The factor norm weight `tensor` is multiplied by, if any.
    pub fn norm_factor(&self, tensor: &str) -> Option<&[f32]> {
        self.norms.get(tensor).map(Vec::as_slice)
    }
}

impl LinearSmoothing {
    /// Whether the weight was rescaled after its own smoothing (a resmooth to a different
    /// mean, or NVFP4 AWQ's row scale): ModelOpt then recalibrates the weight's amax.
    pub fn rescaled(&self) -> bool {
        self.row_scale.is_some() || self.steps.iter().any(|(from, to)| from != to)
    }

    /// The smoothed weight `[rows, cols]` (steps 1 and 2 above, with NVFP4 AWQ's row scale
    /// between them).
    pub fn apply<T: Element>(&self, w: &[T], cols: usize) -> Vec<T> {
        let inv: Vec<f32> = self.own.iter().map(|&p| 1.0 / p).collect();
        let inv = inv.as_slice();
        // A step whose two scales are equal leaves the weight alone (`torch.equal` first).
        let steps: Vec<(&[f32], &[f32])> = self
            .steps
            .iter()
            .filter(|(from, to)| from != to)
            .map(|(from, to)| (from.as_slice(), to.as_slice()))
            .collect();
        let steps = steps.as_slice();
        w.chunks_exact(cols)
            .enumerate()
            .flat_map(|(r, row)| {
                let row_scale = self.row_scale.as_ref().map(|s| s[r]);
                row.iter().enumerate().map(move |(c, &x)| {
                    let mut w = T::round_f32(x.to_f32() * inv[c]);
                    if let Some(f) = row_scale {
                        w = T::round_f32(w * f);
                    }
                    for (from, to) in steps {
                        w = T::round_f32(w * from[c] / to[c]);
                    }
                    T::from_f32(w)
                })
            })
            .collect()
    }
}

/// `norm · factor` per channel, rounded to the norm's dtype (step 3).
pub fn fold_norm<T: Element>(norm: &[T], factor: &[f32]) -> Vec<T> {
    norm.iter()
        .zip(factor)
        .map(|(&n, &f)| T::from_f32(n.to_f32() * f))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    #[allow(clippy::excessive_precision)] // the exact bf16 values PyTorch printed
    fn the_mean_rounds_like_pytorch_on_the_cpu() {
        // torch 2.9: torch.stack([1.984375, 3.03125, 0.10302734375] as bf16).mean(0) is
        // 1.703125 — one rounding of the f32 mean. Rounding the sum to bf16 first would give
        // 1.7109375.
        let (a, b, c) = ([1.984375f32], [3.03125f32], [0.10302734375f32]);
        assert_eq!(mean_as::<bf16>(&[&a, &b, &c]), [1.703125]);
    }

    #[test]
    fn smoothing_divides_then_resmooths_in_f32() {
        let s = LinearSmoothing {
            own: vec![2.0, 0.5],
            row_scale: None,
            steps: vec![(vec![2.0, 0.5], vec![1.0, 1.0])],
            scale: Some(vec![1.0, 1.0]),
        };
        let w = [bf16::from_f32(3.0), bf16::from_f32(-1.0)];
        // 3/2·2/1 = 3, −1·2·0.5 = −1: the round trip through p and avg.
        let out = s.apply(&w, 2);
        assert_eq!(out, [bf16::from_f32(3.0), bf16::from_f32(-1.0)]);
        let fold = fold_norm(&[bf16::from_f32(1.5)], &[3.0]);
        assert_eq!(fold, [bf16::from_f32(4.5)]);
    }
}
