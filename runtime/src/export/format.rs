//! The format catalogue: every quantization format kiln writes, with ModelOpt's names for it
//! (`--format`, `quant_algo`), its config entries and the exact tensor layout of a quantized
//! Linear (docs/FORMATS.md §2). Export, load and verify all read formats from here.

use safetensors::Dtype;
use serde_json::{Value, json};

/// A quantization format (`--format`), with ModelOpt's names for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Format {
    /// FP8 E4M3 weights and inputs, per-tensor scales.
    Fp8,
    /// FP8 weights with per-output-channel scales; inputs quantized dynamically per token.
    Fp8PerChannel,
    /// FP8 weights in 128×128 blocks, weight-only.
    Fp8Block,
    /// INT8 weights, per-channel scales; 16-bit activations.
    Int8Wo,
    /// SmoothQuant INT8 weights and inputs.
    Int8Sq,
    /// AWQ INT4 weights in groups of 128.
    Int4Awq,
    /// AWQ INT4 weights with FP8 activations.
    W4a8Awq,
    /// NVFP4 weights and inputs.
    Nvfp4,
    /// NVFP4 with AWQ smoothing.
    Nvfp4Awq,
    /// NVFP4 weights, 16-bit activations.
    W4a16Nvfp4,
    /// MXFP4 weights.
    Mxfp4,
    /// MXFP8 weights.
    Mxfp8,
}

impl Format {
    /// Every format, in `--format` order.
    pub const ALL: [Format; 12] = [
        Format::Fp8,
        Format::Fp8PerChannel,
        Format::Fp8Block,
        Format::Int8Wo,
        Format::Int8Sq,
        Format::Int4Awq,
        Format::W4a8Awq,
        Format::Nvfp4,
        Format::Nvfp4Awq,
        Format::W4a16Nvfp4,
        Format::Mxfp4,
        Format::Mxfp8,
    ];

    /// The `--format` spelling.
    pub fn cli_name(self) -> &'static str {
        match self {
            Format::Fp8 => "fp8",
            Format::Fp8PerChannel => "fp8-per-channel",
            Format::Fp8Block => "fp8-block",
            Format::Int8Wo => "int8-wo",
            Format::Int8Sq => "int8-sq",
            Format::Int4Awq => "int4-awq",
            Format::W4a8Awq => "w4a8-awq",
            Format::Nvfp4 => "nvfp4",
            Format::Nvfp4Awq => "nvfp4-awq",
            Format::W4a16Nvfp4 => "w4a16-nvfp4",
            Format::Mxfp4 => "mxfp4",
            Format::Mxfp8 => "mxfp8",
        }
    }

    /// ModelOpt's `quant_algo` (docs/FORMATS.md §2).
    pub fn quant_algo(self) -> &'static str {
        match self {
            Format::Fp8 => "FP8",
            Format::Fp8PerChannel => "FP8_PER_CHANNEL_PER_TOKEN",
            Format::Fp8Block => "fp8_pb_wo",
            Format::Int8Wo => "W8A16",
            Format::Int8Sq => "W8A8_SQ_PER_CHANNEL",
            Format::Int4Awq => "W4A16_AWQ",
            Format::W4a8Awq => "W4A8_AWQ",
            Format::Nvfp4 => "NVFP4",
            Format::Nvfp4Awq => "NVFP4_AWQ",
            Format::W4a16Nvfp4 => "W4A16_NVFP4",
            Format::Mxfp4 => "mxfp4",
            Format::Mxfp8 => "MXFP8",
        }
    }

    /// The block size of the format with `--group-size` `group` (AWQ's INT4 blocks, 128 by
    /// default, take 32, 64 or 128; the others are fixed).
    pub fn block(self, group: Option<usize>) -> Option<usize> {
        match self {
            Format::Int4Awq | Format::W4a8Awq => Some(group.unwrap_or(128)),
            _ => self.group_size().map(|g| g as usize),
        }
    }

    /// The block sizes `--group-size` may choose for this format (empty: fixed).
    pub fn block_sizes(self) -> &'static [usize] {
        match self {
            Format::Int4Awq | Format::W4a8Awq => &[32, 64, 128],
            _ => &[],
        }
    }

    /// The default block size written as `group_size`, where the format has one.
    pub fn group_size(self) -> Option<u32> {
        match self {
            Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq => Some(16),
            Format::Int4Awq | Format::W4a8Awq => Some(128),
            Format::Mxfp4 | Format::Mxfp8 => Some(32),
            _ => None,
        }
    }

    /// Whether the format writes a static `input_scale` (so it needs activation statistics).
    pub fn needs_input_scale(self) -> bool {
        matches!(
            self,
            Format::Fp8 | Format::Int8Sq | Format::W4a8Awq | Format::Nvfp4 | Format::Nvfp4Awq
        )
    }

    /// The input quantizer's `maxbound` (what a zero amax becomes, docs/FORMATS.md "Where a comes
    /// from") and the divisor of the input scale.
    pub fn input_bound_and_divisor(self) -> (f32, f32) {
        match self {
            Format::Nvfp4 | Format::Nvfp4Awq => (6.0, 6.0 * 448.0),
            Format::Int8Sq => (127.0, 127.0),
            _ => (448.0, 448.0),
        }
    }

    /// Whether q/k/v and gate/up share `input_scale` and `weight_scale_2` (docs/FORMATS.md §4.2).
    pub fn shares_group_scales(self) -> bool {
        matches!(
            self,
            Format::Nvfp4 | Format::Nvfp4Awq | Format::W4a16Nvfp4 | Format::W4a8Awq
        )
    }

    /// Whether Linears sharing an input (q/k/v, gate/up) share its amax, the max over them
    /// (`preprocess_linear_fusion`: every format with a static input scale but FP8).
    pub fn shares_input_amax(self) -> bool {
        self.shares_group_scales() || self == Format::Int8Sq
    }

    /// The per-layer dict of `hf_quant_config.json` (docs/FORMATS.md §3.2), with `--group-size`
    /// `group`.
    pub fn layer_config(self, group: Option<usize>) -> Value {
        let gs = self.block(group);
        match self {
            // Unmapped formats (`mxfp4`, `fp8_pb_wo`) record the raw name only, like FP8/INT8.
            Format::Fp8
            | Format::Fp8PerChannel
            | Format::Int8Wo
            | Format::Int8Sq
            | Format::Fp8Block
            | Format::Mxfp4 => {
                json!({"quant_algo": self.quant_algo()})
            }
            Format::Int4Awq | Format::W4a8Awq | Format::Nvfp4Awq => {
                json!({"quant_algo": self.quant_algo(), "group_size": gs,
                "has_zero_point": false, "pre_quant_scale": true})
            }
            _ => json!({"quant_algo": self.quant_algo(), "group_size": gs}),
        }
    }

    /// `config_groups.group_0` of `config.json`'s `quantization_config`, for the formats
    /// ModelOpt writes one for (docs/FORMATS.md §3.4); `None` for the others.
    pub fn config_group(self) -> Option<Value> {
        let gs = self.group_size();
        match self {
            Format::Fp8 => Some(json!({
                "input_activations": {"dynamic": false, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": false, "num_bits": 8, "type": "float"},
                "targets": ["Linear"],
            })),
            Format::Nvfp4 => Some(json!({
                "input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": gs},
                "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": gs},
                "targets": ["Linear"],
            })),
            Format::W4a16Nvfp4 => Some(json!({
                "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": gs},
                "targets": ["Linear"],
            })),
            _ => None,
        }
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Format::ALL
            .into_iter()
            .find(|f| f.cli_name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Format::ALL.iter().map(|f| f.cli_name()).collect();
                format!(
                    "unknown format `{s}` (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.cli_name())
    }
}

/// One tensor of a quantized Linear's layout: its name under the module, dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    /// The name under the module: `weight`, `weight_scale`, `weight_scale_2`, `input_scale`.
    pub local: &'static str,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// The first tensor of `layout` that is missing or has another dtype or shape, or a scale
/// present that the layout does not have.
fn missing_or_wrong<'a>(
    layout: &[TensorLayout],
    written: &impl Fn(&str) -> Option<(Dtype, &'a [usize])>,
) -> Option<String> {
    for want in layout {
        match written(want.local) {
            None => return Some(format!("`{}` is missing", want.local)),
            Some((dtype, shape)) if dtype != want.dtype || shape != want.shape.as_slice() => {
                return Some(format!(
                    "`{}` is {dtype:?} {shape:?}, the format has {:?} {:?}",
                    want.local, want.dtype, want.shape
                ));
            }
            Some(_) => {}
        }
    }
    ["weight_scale_2", "input_scale"]
        .into_iter()
        .find(|l| written(l).is_some() && !layout.iter().any(|t| t.local == *l))
        .map(|local| format!("`{local}` is present, and the format has none"))
}

/// Tensors a quantized Linear may carry beside its layout: `pre_quant_scale` (AWQ /
/// SmoothQuant formats, when no norm absorbed it), `bias`, and the KV-cache scales.
const OPTIONAL_LOCALS: [&str; 4] = ["pre_quant_scale", "bias", "k_scale", "v_scale"];

impl Format {
    /// The format whose `quant_algo` is `algo` (`hf_quant_config.json`, `config.json`), in
    /// any case: ModelOpt writes the unmapped formats raw (`mxfp4`, `fp8_pb_wo`), and other
    /// producers upper-case them (`MXFP4`).
    pub fn from_quant_algo(algo: &str) -> Option<Format> {
        Format::ALL
            .into_iter()
            .find(|f| f.quant_algo().eq_ignore_ascii_case(algo))
    }

    /// The tensors of a Linear with an `[rows, cols]` (`[out, in]`) weight quantized to this
    /// format, as ModelOpt writes them (docs/FORMATS.md §2). `pre_quant_scale` is not listed: it is
    /// present only where no norm absorbed the AWQ scale.
    /// `group`: `--group-size` (AWQ's INT4 blocks; `None`: the format's default).
    pub fn linear_layout(
        self,
        rows: usize,
        cols: usize,
        group: Option<usize>,
    ) -> Vec<TensorLayout> {
        let block = self.block(group).unwrap_or(1);
        let t = |local, dtype, shape: &[usize]| TensorLayout {
            local,
            dtype,
            shape: shape.to_vec(),
        };
        let scalar = |local| t(local, Dtype::F32, &[]);
        let mut out = match self {
            Format::Fp8 => vec![
                t("weight", Dtype::F8_E4M3, &[rows, cols]),
                scalar("weight_scale"),
            ],
            Format::Fp8PerChannel => vec![
                t("weight", Dtype::F8_E4M3, &[rows, cols]),
                t("weight_scale", Dtype::F32, &[rows]),
            ],
            Format::Fp8Block => {
                let (tr, tc) = (rows.div_ceil(128), cols.div_ceil(128));
                let shape: &[usize] = if tr * tc == 1 { &[] } else { &[tr, 1, tc, 1] };
                vec![
                    t("weight", Dtype::F8_E4M3, &[rows, cols]),
                    t("weight_scale", Dtype::F32, shape),
                ]
            }
            Format::Int8Wo | Format::Int8Sq => vec![
                t("weight", Dtype::I8, &[rows, cols]),
                t("weight_scale", Dtype::F32, &[rows]),
            ],
            Format::Int4Awq | Format::W4a8Awq => vec![
                t("weight", Dtype::U8, &[rows / 2, cols]),
                t("weight_scale", Dtype::F32, &[rows, cols / block]),
            ],
            Format::Nvfp4 | Format::Nvfp4Awq | Format::W4a16Nvfp4 => vec![
                t("weight", Dtype::U8, &[rows, cols / 2]),
                t("weight_scale", Dtype::F8_E4M3, &[rows, cols / 16]),
                scalar("weight_scale_2"),
            ],
            Format::Mxfp4 => vec![
                t("weight", Dtype::U8, &[rows, cols / 2]),
                t("weight_scale", Dtype::U8, &[rows, cols / 32]),
            ],
            Format::Mxfp8 => vec![
                t("weight", Dtype::F8_E4M3, &[rows, cols]),
                t("weight_scale", Dtype::U8, &[rows, cols / 32]),
            ],
        };
        if self == Format::W4a8Awq {
            out.push(scalar("weight_scale_2"));
        }
        if self.needs_input_scale() {
            out.push(scalar("input_scale"));
        }
        out
    }

    /// What is wrong with a Linear's tensors for this format (`None`: they have its layout).
    /// `written(local)` gives the dtype and shape of the module's tensor `local`, if present.
    /// `group`: the block size it was written with (`None`: the format's default).
    pub fn layout_problem<'a>(
        self,
        rows: usize,
        cols: usize,
        group: Option<usize>,
        written: impl Fn(&str) -> Option<(Dtype, &'a [usize])>,
    ) -> Option<String> {
        if let Some(p) = missing_or_wrong(&self.linear_layout(rows, cols, group), &written) {
            return Some(p);
        }
        if written("pre_quant_scale").is_some() && !self.has_pre_quant_scale() {
            return Some("`pre_quant_scale` is present, and the format has none".into());
        }
        None
    }

    /// The tensors of a BMM experts projection (GPT-OSS, Llama4: `[E, in, out]`, one quantizer
    /// across the experts) quantized to this format, as ModelOpt writes them
    /// (docs/FORMATS.md §4.3c); `local` `weight` is the projection itself and the others are
    /// its `_weight_scale`, `_weight_scale_2`, `_input_scale`. `None` for the formats ModelOpt
    /// 0.47 cannot write there.
    pub fn bmm_layout(self, experts: usize, rows: usize, cols: usize) -> Option<Vec<TensorLayout>> {
        let t = |local, dtype, shape: &[usize]| TensorLayout {
            local,
            dtype,
            shape: shape.to_vec(),
        };
        let scalar = |local| t(local, Dtype::F32, &[]);
        let e = experts;
        let mut out = match self {
            Format::Fp8 => vec![
                t("weight", Dtype::F8_E4M3, &[e, rows, cols]),
                scalar("weight_scale"),
            ],
            Format::Fp8PerChannel => vec![
                t("weight", Dtype::F8_E4M3, &[e, rows, cols]),
                t("weight_scale", Dtype::F32, &[e]),
            ],
            Format::Fp8Block => vec![
                t("weight", Dtype::F8_E4M3, &[e, rows, cols]),
                t(
                    "weight_scale",
                    Dtype::F32,
                    &[e, rows.div_ceil(128), 1, cols.div_ceil(128), 1],
                ),
            ],
            Format::Nvfp4 | Format::W4a16Nvfp4 => vec![
                t("weight", Dtype::U8, &[e, rows / 2, cols]),
                t("weight_scale", Dtype::F8_E4M3, &[e, rows / 16, cols]),
                scalar("weight_scale_2"),
            ],
            Format::Mxfp8 => vec![
                t("weight", Dtype::F8_E4M3, &[e, rows, cols]),
                t("weight_scale", Dtype::U8, &[e, rows, cols / 32]),
            ],
            Format::Mxfp4 => vec![
                t("weight", Dtype::U8, &[e, rows, cols / 2]),
                t("weight_scale", Dtype::U8, &[e, rows, cols / 32]),
            ],
            _ => return None,
        };
        if self.needs_input_scale() {
            out.push(scalar("input_scale"));
        }
        Some(out)
    }

    /// What is wrong with a BMM experts projection's tensors for this format (`None`: they
    /// have its layout); `written(local)` as for [`Format::layout_problem`], `local` as in
    /// [`Format::bmm_layout`].
    pub fn bmm_layout_problem<'a>(
        self,
        experts: usize,
        rows: usize,
        cols: usize,
        written: impl Fn(&str) -> Option<(Dtype, &'a [usize])>,
    ) -> Option<String> {
        match self.bmm_layout(experts, rows, cols) {
            Some(layout) => missing_or_wrong(&layout, &written),
            None => Some("ModelOpt cannot write BMM experts in this format".into()),
        }
    }

    /// A `MIXED_PRECISION` checkpoint's `config_groups` entry for modules in this format
    /// (without `targets`), as ModelOpt's `_quant_algo_to_group_config` writes it; `group_size`
    /// is the per-layer dict's. ModelOpt has none for `mxfp4` and `fp8_pb_wo` (an empty entry).
    pub fn mixed_group(self, group_size: Option<u32>) -> serde_json::Map<String, Value> {
        let gs = |default: u32| group_size.unwrap_or(default);
        let float = |bits: u32| json!({"dynamic": false, "num_bits": bits, "type": "float"});
        let grouped = |bits: u32, kind: &str, g: u32| json!({"dynamic": false, "num_bits": bits, "type": kind, "group_size": g});
        let channel = |kind: &str| json!({"dynamic": false, "num_bits": 8, "type": kind, "strategy": "channel"});
        let entry = match self {
            Format::Fp8 => json!({"input_activations": float(8), "weights": float(8)}),
            Format::Fp8PerChannel => {
                json!({"input_activations": float(8), "weights": channel("float")})
            }
            Format::Nvfp4 => json!({
                "input_activations": grouped(4, "float", gs(16)),
                "weights": grouped(4, "float", gs(16)),
            }),
            Format::Int4Awq => json!({"weights": grouped(4, "int", gs(128))}),
            Format::W4a16Nvfp4 => json!({"weights": grouped(4, "float", gs(16))}),
            Format::Nvfp4Awq | Format::W4a8Awq => json!({
                "input_activations": grouped(8, "float", gs(128)),
                "weights": grouped(4, "float", gs(128)),
            }),
            Format::Int8Wo => {
                json!({"weights": {"dynamic": false, "num_bits": 8, "type": "int"}})
            }
            Format::Int8Sq => json!({
                "input_activations": {"dynamic": false, "num_bits": 8, "type": "int"},
                "weights": channel("int"),
            }),
            Format::Mxfp8 => json!({
                "input_activations": grouped(8, "float", gs(32)),
                "weights": grouped(8, "float", gs(32)),
            }),
            Format::Mxfp4 | Format::Fp8Block => json!({}),
        };
        match entry {
            Value::Object(m) => m,
            _ => unreachable!("every entry is an object"),
        }
    }

    /// Whether the format may carry `pre_quant_scale` (AWQ and SmoothQuant).
    pub fn has_pre_quant_scale(self) -> bool {
        matches!(
            self,
            Format::Int4Awq | Format::W4a8Awq | Format::Nvfp4Awq | Format::Int8Sq
        )
    }

    /// Whether `local` is a tensor name a Linear of this format may carry.
    pub fn knows_local(self, local: &str) -> bool {
        OPTIONAL_LOCALS.contains(&local)
            || self
                .linear_layout(2, 128, None)
                .iter()
                .any(|t| t.local == local)
    }
}
