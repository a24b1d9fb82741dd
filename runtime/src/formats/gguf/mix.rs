//! Which ggml type each tensor gets: `convert_hf_to_gguf.py`'s choices for the unquantized
//! file, then `llama-quantize`'s per-tensor mix for the file type (llama.cpp's
//! `src/llama-quant.cpp`, `llama_tensor_get_type`, with or without an imatrix, without
//! overrides). Only the branches that the file types kiln writes can reach are here
//! (docs/FORMATS.md §7.2).

use kiln_kernels::ops::gguf::GgufType;

/// ggml's F32, F16 and BF16 type numbers.
pub const F32: u32 = 0;
/// ggml's F16.
pub const F16: u32 = 1;
/// ggml's BF16.
pub const BF16: u32 = 30;

/// A llama.cpp file type (`general.file_type`), as `llama-quantize` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    /// Every tensor F32.
    F32,
    /// 2-D weights F16.
    F16,
    /// 2-D weights BF16.
    Bf16,
    /// Q8_0.
    Q8_0,
    /// Q4_0.
    Q4_0,
    /// Q4_1.
    Q4_1,
    /// Q5_0.
    Q5_0,
    /// Q5_1.
    Q5_1,
    /// Q2_K: Q2_K, with Q3_K / Q4_K for `attn_v`, Q3_K for `ffn_down` and `attn_output`.
    Q2K,
    /// Q3_K_S: Q3_K.
    Q3KS,
    /// Q3_K_M: Q3_K, with Q5_K / Q4_K for `attn_v`, Q5_K / Q4_K for `ffn_down`, Q4_K for
    /// `attn_output`.
    Q3KM,
    /// Q3_K_L: Q3_K, with Q5_K for `attn_v`, `ffn_down` and `attn_output`.
    Q3KL,
    /// Q4_K_S: Q4_K, with Q5_K for the first four `attn_v` and the first eighth's `ffn_down`.
    Q4KS,
    /// Q4_K_M: Q4_K, with Q6_K for `output`, and for `attn_v` / `ffn_down` in the
    /// `use_more_bits` layers.
    Q4KM,
    /// Q5_K_S: Q5_K.
    Q5KS,
    /// Q5_K_M: the same mix around Q5_K.
    Q5KM,
    /// Q6_K.
    Q6K,
    /// MXFP4_MOE: stacked experts MXFP4, other weights Q8_0.
    Mxfp4Moe,
    /// IQ4_NL: llama.cpp's non-linear 4-bit grid in blocks of 32.
    Iq4Nl,
    /// IQ4_XS: the same grid in super-blocks of 256 with 6-bit sub-block scales.
    Iq4Xs,
    /// IQ2_XXS (2.06 bits; needs an importance matrix).
    Iq2Xxs,
    /// IQ2_XS (2.31 bits; needs an importance matrix).
    Iq2Xs,
    /// IQ2_S: IQ2_XS with IQ3_S for `attn_v` and the first eighth's `ffn_down`.
    Iq2S,
    /// IQ2_M: IQ2_S with the same raises.
    Iq2M,
    /// IQ3_XXS (3.06 bits; needs an importance matrix).
    Iq3Xxs,
    /// IQ3_XS: IQ3_S with IQ3_XXS for `attn_q`, `attn_k` and the middle layers' FFN.
    Iq3Xs,
    /// IQ3_S (3.44 bits).
    Iq3S,
    /// IQ3_M: IQ3_S with Q4_K for `attn_v`, `attn_output` and the first eighth's `ffn_down`.
    Iq3M,
}

impl FileType {
    /// Every file type, in `--format` order (the first is the default).
    pub const ALL: [FileType; 28] = [
        FileType::Q4KM,
        FileType::Q5KM,
        FileType::Q6K,
        FileType::Q8_0,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q2K,
        FileType::Q3KS,
        FileType::Q3KM,
        FileType::Q3KL,
        FileType::Q4KS,
        FileType::Q5KS,
        FileType::Iq4Nl,
        FileType::Iq4Xs,
        FileType::Iq3M,
        FileType::Iq3S,
        FileType::Iq3Xs,
        FileType::Iq3Xxs,
        FileType::Iq2M,
        FileType::Iq2S,
        FileType::Iq2Xs,
        FileType::Iq2Xxs,
        FileType::Mxfp4Moe,
        FileType::F16,
        FileType::Bf16,
        FileType::F32,
    ];

    /// The `--format` name.
    pub fn cli_name(self) -> &'static str {
        match self {
            FileType::F32 => "f32",
            FileType::F16 => "f16",
            FileType::Bf16 => "bf16",
            FileType::Q8_0 => "q8-0",
            FileType::Q4_0 => "q4-0",
            FileType::Q4_1 => "q4-1",
            FileType::Q5_0 => "q5-0",
            FileType::Q5_1 => "q5-1",
            FileType::Q2K => "q2-k",
            FileType::Q3KS => "q3-k-s",
            FileType::Q3KM => "q3-k-m",
            FileType::Q3KL => "q3-k-l",
            FileType::Q4KS => "q4-k-s",
            FileType::Q4KM => "q4-k-m",
            FileType::Q5KS => "q5-k-s",
            FileType::Q5KM => "q5-k-m",
            FileType::Q6K => "q6-k",
            FileType::Mxfp4Moe => "mxfp4-moe",
            FileType::Iq4Nl => "iq4-nl",
            FileType::Iq4Xs => "iq4-xs",
            FileType::Iq2Xxs => "iq2-xxs",
            FileType::Iq2Xs => "iq2-xs",
            FileType::Iq2S => "iq2-s",
            FileType::Iq2M => "iq2-m",
            FileType::Iq3Xxs => "iq3-xxs",
            FileType::Iq3Xs => "iq3-xs",
            FileType::Iq3S => "iq3-s",
            FileType::Iq3M => "iq3-m",
        }
    }

    /// llama.cpp's name (`llama-quantize`'s argument).
    pub fn llama_name(self) -> &'static str {
        match self {
            FileType::F32 => "F32",
            FileType::F16 => "F16",
            FileType::Bf16 => "BF16",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_0 => "Q4_0",
            FileType::Q4_1 => "Q4_1",
            FileType::Q5_0 => "Q5_0",
            FileType::Q5_1 => "Q5_1",
            FileType::Q2K => "Q2_K",
            FileType::Q3KS => "Q3_K_S",
            FileType::Q3KM => "Q3_K_M",
            FileType::Q3KL => "Q3_K_L",
            FileType::Q4KS => "Q4_K_S",
            FileType::Q4KM => "Q4_K_M",
            FileType::Q5KS => "Q5_K_S",
            FileType::Q5KM => "Q5_K_M",
            FileType::Q6K => "Q6_K",
            FileType::Mxfp4Moe => "MXFP4_MOE",
            FileType::Iq4Nl => "IQ4_NL",
            FileType::Iq4Xs => "IQ4_XS",
            FileType::Iq2Xxs => "IQ2_XXS",
            FileType::Iq2Xs => "IQ2_XS",
            FileType::Iq2S => "IQ2_S",
            FileType::Iq2M => "IQ2_M",
            FileType::Iq3Xxs => "IQ3_XXS",
            FileType::Iq3Xs => "IQ3_XS",
            FileType::Iq3S => "IQ3_S",
            FileType::Iq3M => "IQ3_M",
        }
    }

    /// `general.file_type` (`enum llama_ftype`).
    pub fn number(self) -> u32 {
        match self {
            FileType::F32 => 0,
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q2K => 10,
            FileType::Q3KS => 11,
            FileType::Q3KM => 12,
            FileType::Q3KL => 13,
            FileType::Q4KS => 14,
            FileType::Q4KM => 15,
            FileType::Q5KS => 16,
            FileType::Q5KM => 17,
            FileType::Q6K => 18,
            FileType::Iq4Nl => 25,
            FileType::Iq4Xs => 30,
            FileType::Iq2Xxs => 19,
            FileType::Iq2Xs => 20,
            FileType::Iq3Xs => 22,
            FileType::Iq3Xxs => 23,
            FileType::Iq3S => 26,
            FileType::Iq3M => 27,
            FileType::Iq2S => 28,
            FileType::Iq2M => 29,
            FileType::Bf16 => 32,
            FileType::Mxfp4Moe => 38,
        }
    }

    /// The type most tensors get (`llama_ftype_get_default_type`); F32 / F16 / BF16 for the
    /// unquantized file types.
    pub fn default_type(self) -> u32 {
        match self {
            FileType::F32 => F32,
            FileType::F16 => F16,
            FileType::Bf16 => BF16,
            FileType::Q8_0 => GgufType::Q8_0.ggml_type(),
            FileType::Q4_0 => GgufType::Q4_0.ggml_type(),
            FileType::Q4_1 => GgufType::Q4_1.ggml_type(),
            FileType::Q5_0 => GgufType::Q5_0.ggml_type(),
            FileType::Q5_1 => GgufType::Q5_1.ggml_type(),
            FileType::Q2K => GgufType::Q2K.ggml_type(),
            FileType::Q3KS | FileType::Q3KM | FileType::Q3KL => GgufType::Q3K.ggml_type(),
            FileType::Q4KS | FileType::Q4KM => GgufType::Q4K.ggml_type(),
            FileType::Q5KS | FileType::Q5KM => GgufType::Q5K.ggml_type(),
            FileType::Q6K => GgufType::Q6K.ggml_type(),
            FileType::Mxfp4Moe => GgufType::Mxfp4.ggml_type(),
            FileType::Iq4Nl => GgufType::Iq4Nl.ggml_type(),
            FileType::Iq4Xs => GgufType::Iq4Xs.ggml_type(),
            FileType::Iq2Xxs => GgufType::Iq2Xxs.ggml_type(),
            FileType::Iq2Xs | FileType::Iq2S => GgufType::Iq2Xs.ggml_type(),
            FileType::Iq2M => GgufType::Iq2S.ggml_type(),
            FileType::Iq3Xxs => GgufType::Iq3Xxs.ggml_type(),
            FileType::Iq3Xs | FileType::Iq3S | FileType::Iq3M => GgufType::Iq3S.ggml_type(),
        }
    }

    /// Whether llama-quantize refuses the file type without an importance matrix (some of its
    /// tensors are IQ2_XXS, IQ2_XS, IQ2_S or IQ3_XXS: `attn_q` / `attn_k` for IQ3_XS).
    pub fn requires_imatrix(self) -> bool {
        matches!(
            self,
            FileType::Iq2Xxs
                | FileType::Iq2Xs
                | FileType::Iq2S
                | FileType::Iq2M
                | FileType::Iq3Xxs
                | FileType::Iq3Xs
        )
    }

    /// Whether the file type quantizes (its default type is a block type).
    pub fn quantizes(self) -> bool {
        !matches!(self, FileType::F32 | FileType::F16 | FileType::Bf16)
    }

    /// One line for `--format` listings.
    pub fn describe(self) -> String {
        match self {
            FileType::F32 | FileType::F16 | FileType::Bf16 => {
                format!(
                    "{}: unquantized, as convert_hf_to_gguf.py --outtype writes",
                    self.llama_name()
                )
            }
            _ => format!("{}: llama-quantize's mix", self.llama_name()),
        }
    }
}

/// What the mix needs to know about the model (`quantize_state_impl` and `hparams`).
#[derive(Debug, Clone, Copy)]
pub struct MixModel {
    /// `n_expert` (0 for dense models).
    pub experts: usize,
    /// `n_layer`.
    pub layers: usize,
    /// llama.cpp reports the model as `LLM_TYPE_70B` (Llama / Qwen2 with 80 layers and GQA):
    /// `attn_v` is raised from Q4_K to Q5_K.
    pub is_70b: bool,
    /// `output.weight` absent: `token_embd` is quantized as the output.
    pub tied_embeddings: bool,
    /// `n_gqa()`: attention heads per KV head.
    pub gqa: usize,
    /// llama-quantize was given an importance matrix (`qs.has_imatrix`).
    pub has_imatrix: bool,
}

/// llama.cpp's `tensor_category` of a GGUF tensor name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    AttnV,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" {
        Category::TokenEmbd
    } else if name.contains("attn_v.weight") {
        Category::AttnV
    } else if name.contains("attn_k.weight") {
        Category::AttnK
    } else if name.contains("attn_q.weight") {
        Category::AttnQ
    } else if name.contains("attn_output.weight") {
        Category::AttnOutput
    } else if name.contains("ffn_up") {
        Category::FfnUp
    } else if name.contains("ffn_gate") {
        Category::FfnGate
    } else if name.contains("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// Whether llama-quantize quantizes this tensor at all (`tensor_allows_quantization`), for
/// the tensors of the families kiln writes: 2-D and 3-D weights, not norms, not routers.
pub fn allows_quantization(name: &str, dims: usize) -> bool {
    dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
}

/// Whether llama-quantize refuses to make `name` of ggml type `ty` without importance weights
/// (`tensor_requires_imatrix`: the i-quants below three bits and IQ3_XXS, except for the
/// embeddings and the output).
pub fn requires_imatrix(name: &str, ty: u32) -> bool {
    if name == "token_embd.weight" || name == "output.weight" {
        return false;
    }
    [
        GgufType::Iq2Xxs,
        GgufType::Iq2Xs,
        GgufType::Iq2S,
        GgufType::Iq3Xxs,
    ]
    .iter()
    .any(|g| g.ggml_type() == ty)
}

/// The layer of a `blk.N.` tensor.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// `use_more_bits`: the first and last eighth of the layers, and every third between.
fn use_more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The type of `name` (`dims` dimensions, rows of `cols`) under `ftype`, before the fallback
/// (`llama_tensor_get_type_impl`, the branches of kiln's file types, in its order).
///
/// Long on purpose: one arm per tensor category, each llama.cpp's chain of file types.
fn mixed(ftype: FileType, m: &MixModel, name: &str, dims: usize, cols: usize) -> u32 {
    use FileType as F;
    let default = ftype.default_type();
    if !ftype.quantizes() {
        return default;
    }
    let cat = category(name);
    let block = |t: u32| {
        GgufType::ALL
            .iter()
            .find(|g| g.ggml_type() == t)
            .map_or(1, |g| g.block_elems())
    };
    let t = |g: GgufType| g.ggml_type();
    let (q3k, q4k, q5k, q6k, q8) = (
        t(GgufType::Q3K),
        t(GgufType::Q4K),
        t(GgufType::Q5K),
        t(GgufType::Q6K),
        t(GgufType::Q8_0),
    );
    let iq2_family = matches!(ftype, F::Iq2Xxs | F::Iq2Xs | F::Iq2S | F::Iq2M);
    let iq3s = t(GgufType::Iq3S);
    if cat == Category::Output || (m.tied_embeddings && cat == Category::TokenEmbd) {
        return if ftype == F::Mxfp4Moe || !cols.is_multiple_of(block(default)) {
            q8
        } else if iq2_family || ftype == F::Iq3Xxs {
            q5k
        } else if default != q8 {
            q6k
        } else {
            default
        };
    }
    if ftype == F::Mxfp4Moe {
        return if dims == 3 { default } else { q8 };
    }
    // The layer of a dense model's tensor (llama.cpp's counters), or of an expert tensor (its
    // name); `n` the layers.
    let layer = layer_of(name).unwrap_or(0);
    let n = m.layers;
    if cat == Category::TokenEmbd {
        return match ftype {
            F::Iq2Xxs | F::Iq2Xs => t(GgufType::Q2K),
            F::Iq2S | F::Iq2M | F::Iq3Xxs => iq3s,
            _ => default,
        };
    }
    if iq2_family {
        let s_or_m = matches!(ftype, F::Iq2S | F::Iq2M);
        return match cat {
            Category::AttnV if m.gqa >= 4 || m.experts >= 4 => q4k,
            Category::AttnV | Category::FfnDown if cat == Category::AttnV || layer < n / 8 => {
                if s_or_m {
                    iq3s
                } else {
                    t(GgufType::Q2K)
                }
            }
            Category::AttnK if m.experts == 8 => q4k,
            Category::AttnOutput if m.experts == 8 => q5k,
            Category::AttnOutput if s_or_m => iq3s,
            _ => default,
        };
    }
    match cat {
        Category::AttnV => {
            let mut ty = match ftype {
                F::Iq3Xxs if m.gqa >= 4 => q4k,
                F::Iq3Xxs if !m.has_imatrix => iq3s,
                F::Iq3Xs | F::Iq3S if m.gqa >= 4 => q4k,
                F::Iq3M => q4k,
                F::Q2K if m.gqa >= 4 => q4k,
                F::Q2K => q3k,
                F::Q3KM if layer < 2 => q5k,
                F::Q3KM => q4k,
                F::Q3KL => q5k,
                F::Iq4Nl | F::Iq4Xs if m.gqa >= 4 => q5k,
                F::Q4KM | F::Q5KM if use_more_bits(layer, n) => q6k,
                F::Q4KS if layer < 4 => q5k,
                _ => default,
            };
            if m.is_70b && (ty == q3k || ty == q4k) {
                ty = q5k;
            }
            if m.experts == 8 {
                ty = q8;
            }
            ty
        }
        Category::AttnK if m.experts == 8 => q8,
        Category::AttnK | Category::AttnQ => match ftype {
            F::Iq3Xs => t(GgufType::Iq3Xxs),
            F::Iq3Xxs => t(GgufType::Iq2S),
            _ => default,
        },
        Category::FfnDown => match ftype {
            F::Q2K => q3k,
            F::Iq3Xxs if !m.has_imatrix && layer < n / 8 => q4k,
            F::Iq3Xxs if !m.has_imatrix => q3k,
            F::Q3KM if layer < n / 16 => q5k,
            // `arch != FALCON || use_more_bits(…)`: Q4_K for every family kiln writes.
            F::Q3KM => q4k,
            F::Q3KL => q5k,
            F::Iq3M if layer < n / 8 || (m.experts == 8 && use_more_bits(layer, n)) => q4k,
            F::Q4KM if use_more_bits(layer, n) => q6k,
            F::Q4KM => default,
            F::Iq4Nl | F::Iq4Xs if layer < n / 8 && !m.has_imatrix => q5k,
            F::Q5KM if use_more_bits(layer, n) => q6k,
            F::Q4KS if layer < n / 8 => q5k,
            F::Q4_0 if m.has_imatrix && layer < n / 8 => t(GgufType::Q4_1),
            F::Q5_0 if m.has_imatrix && layer < n / 8 => t(GgufType::Q5_1),
            _ => default,
        },
        Category::AttnOutput if m.experts == 8 => match ftype {
            F::Q2K
            | F::Iq3Xs
            | F::Iq3Xxs
            | F::Q3KS
            | F::Q3KM
            | F::Iq4Nl
            | F::Q4KS
            | F::Q4KM
            | F::Iq3S
            | F::Iq3M
            | F::Iq4Xs => q5k,
            _ => default,
        },
        Category::AttnOutput => match ftype {
            F::Q2K => q3k,
            F::Iq3Xxs => iq3s,
            F::Q3KM | F::Iq3M => q4k,
            F::Q3KL => q5k,
            _ => default,
        },
        Category::FfnGate | Category::FfnUp
            if ftype == F::Iq3Xs && layer >= n / 8 && layer < 7 * n / 8 =>
        {
            t(GgufType::Iq3Xxs)
        }
        _ => default,
    }
}

/// The ggml type `llama-quantize` gives `name` (`dims` dimensions, rows of `cols`) in a file
/// of type `ftype`, and whether it fell back (rows not whole blocks of the chosen type).
/// `None`: llama-quantize leaves the tensor in its unquantized type.
pub fn tensor_type(
    ftype: FileType,
    m: &MixModel,
    name: &str,
    dims: usize,
    cols: usize,
) -> Option<(u32, bool)> {
    if !allows_quantization(name, dims) {
        return None;
    }
    let t = mixed(ftype, m, name, dims, cols);
    if !ftype.quantizes() {
        return Some((t, false));
    }
    let Some(g) = GgufType::ALL.iter().find(|g| g.ggml_type() == t) else {
        return Some((t, false));
    };
    if cols.is_multiple_of(g.block_elems()) {
        return Some((t, false));
    }
    // `tensor_type_fallback`: a 256-block type to the 32-block type llama.cpp names; F16 when
    // even that does not fit.
    let fallback = match g {
        GgufType::Iq2Xxs
        | GgufType::Iq2Xs
        | GgufType::Iq2S
        | GgufType::Iq3Xxs
        | GgufType::Iq3S
        | GgufType::Iq4Xs => GgufType::Iq4Nl.ggml_type(),
        GgufType::Q2K | GgufType::Q3K => GgufType::Q4_0.ggml_type(),
        GgufType::Q4K => GgufType::Q5_0.ggml_type(),
        GgufType::Q5K => GgufType::Q5_1.ggml_type(),
        GgufType::Q6K => GgufType::Q8_0.ggml_type(),
        _ => t,
    };
    if cols.is_multiple_of(32) && fallback != t {
        Some((fallback, true))
    } else {
        Some((F16, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(t: Option<(u32, bool)>) -> &'static str {
        match t {
            None => "keep",
            Some((F16, _)) => "F16",
            Some((t, _)) => GgufType::ALL
                .iter()
                .find(|g| g.ggml_type() == t)
                .map_or("?", |g| g.name()),
        }
    }

    #[test]
    fn q4_k_m_follows_llama_quantize() {
        let m = MixModel {
            experts: 0,
            layers: 32,
            is_70b: false,
            tied_embeddings: false,
            gqa: 1,
            has_imatrix: false,
        };
        let t = |n: &str, cols| name(tensor_type(FileType::Q4KM, &m, n, 2, cols));
        assert_eq!(t("output.weight", 4096), "Q6_K");
        assert_eq!(t("token_embd.weight", 4096), "Q4_K");
        // use_more_bits(i, 32): i < 4, i >= 28, (i - 4) % 3 == 2.
        let more: Vec<usize> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            more,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
        assert_eq!(t("blk.6.attn_v.weight", 4096), "Q6_K");
        assert_eq!(t("blk.7.attn_v.weight", 4096), "Q4_K");
        assert_eq!(t("blk.9.ffn_down.weight", 14336), "Q6_K");
        assert_eq!(t("blk.10.ffn_down.weight", 14336), "Q4_K");
        assert_eq!(t("blk.10.attn_q.weight", 4096), "Q4_K");
        assert_eq!(t("blk.10.attn_norm.weight", 4096), "keep");
        // Rows not whole 256-blocks fall back to llama.cpp's 32-block types.
        assert_eq!(t("blk.10.attn_q.weight", 4000), "Q5_0");
        assert_eq!(t("blk.6.attn_v.weight", 4000), "Q8_0");
        assert_eq!(t("blk.10.attn_q.weight", 100), "F16");
        // Tied embeddings: token_embd is the output.
        let tied = MixModel {
            tied_embeddings: true,
            ..m
        };
        assert_eq!(
            name(tensor_type(
                FileType::Q4KM,
                &tied,
                "token_embd.weight",
                2,
                4096
            )),
            "Q6_K"
        );
        // Eight experts: attn_v and attn_k Q8_0, attn_output Q5_K.
        let moe = MixModel { experts: 8, ..m };
        let t = |n: &str| name(tensor_type(FileType::Q4KM, &moe, n, 2, 4096));
        assert_eq!(t("blk.7.attn_v.weight"), "Q8_0");
        assert_eq!(t("blk.7.attn_k.weight"), "Q8_0");
        assert_eq!(t("blk.7.attn_output.weight"), "Q5_K");
        assert_eq!(t("blk.7.ffn_gate_inp.weight"), "keep");
    }

    #[test]
    fn low_bit_file_types_follow_llama_quantize() {
        let m = MixModel {
            experts: 0,
            layers: 32,
            is_70b: false,
            tied_embeddings: false,
            gqa: 4,
            has_imatrix: false,
        };
        let t = |m: &MixModel, f, n: &str, cols| name(tensor_type(f, m, n, 2, cols));
        // Q2_K: attn_v Q4_K with 4+ query heads per KV head, else Q3_K; ffn_down and
        // attn_output Q3_K.
        assert_eq!(t(&m, FileType::Q2K, "blk.9.attn_v.weight", 4096), "Q4_K");
        let few = MixModel { gqa: 2, ..m };
        assert_eq!(t(&few, FileType::Q2K, "blk.9.attn_v.weight", 4096), "Q3_K");
        assert_eq!(t(&m, FileType::Q2K, "blk.9.ffn_down.weight", 4096), "Q3_K");
        assert_eq!(
            t(&m, FileType::Q2K, "blk.9.attn_output.weight", 4096),
            "Q3_K"
        );
        assert_eq!(t(&m, FileType::Q2K, "blk.9.attn_q.weight", 4096), "Q2_K");
        assert_eq!(t(&m, FileType::Q2K, "output.weight", 4096), "Q6_K");
        // Q3_K_M: the first two attn_v Q5_K, then Q4_K; ffn_down Q5_K in the first 16th.
        assert_eq!(t(&m, FileType::Q3KM, "blk.1.attn_v.weight", 4096), "Q5_K");
        assert_eq!(t(&m, FileType::Q3KM, "blk.2.attn_v.weight", 4096), "Q4_K");
        assert_eq!(t(&m, FileType::Q3KM, "blk.1.ffn_down.weight", 4096), "Q5_K");
        assert_eq!(t(&m, FileType::Q3KM, "blk.2.ffn_down.weight", 4096), "Q4_K");
        assert_eq!(
            t(&m, FileType::Q3KM, "blk.2.attn_output.weight", 4096),
            "Q4_K"
        );
        assert_eq!(
            t(&m, FileType::Q3KS, "blk.2.attn_output.weight", 4096),
            "Q3_K"
        );
        assert_eq!(
            t(&m, FileType::Q3KL, "blk.20.ffn_down.weight", 4096),
            "Q5_K"
        );
        // Q4_K_S: the first four attn_v and the first eighth's ffn_down Q5_K.
        assert_eq!(t(&m, FileType::Q4KS, "blk.3.attn_v.weight", 4096), "Q5_K");
        assert_eq!(t(&m, FileType::Q4KS, "blk.4.attn_v.weight", 4096), "Q4_K");
        assert_eq!(t(&m, FileType::Q4KS, "blk.3.ffn_down.weight", 4096), "Q5_K");
        assert_eq!(t(&m, FileType::Q4KS, "blk.4.ffn_down.weight", 4096), "Q4_K");
        // IQ4_XS: attn_v Q5_K with GQA ≥ 4; the first eighth's ffn_down Q5_K only without an
        // importance matrix.
        assert_eq!(t(&m, FileType::Iq4Xs, "blk.9.attn_v.weight", 4096), "Q5_K");
        assert_eq!(
            t(&m, FileType::Iq4Xs, "blk.1.ffn_down.weight", 4096),
            "Q5_K"
        );
        let im = MixModel {
            has_imatrix: true,
            ..m
        };
        assert_eq!(
            t(&im, FileType::Iq4Xs, "blk.1.ffn_down.weight", 4096),
            "IQ4_XS"
        );
        // Q4_0 / Q5_0 with an importance matrix: the first eighth's ffn_down Q4_1 / Q5_1.
        assert_eq!(
            t(&im, FileType::Q4_0, "blk.3.ffn_down.weight", 4096),
            "Q4_1"
        );
        assert_eq!(t(&m, FileType::Q4_0, "blk.3.ffn_down.weight", 4096), "Q4_0");
        assert_eq!(
            t(&im, FileType::Q5_0, "blk.3.ffn_down.weight", 4096),
            "Q5_1"
        );
        // The 70B bump: Q3_K / Q4_K attn_v to Q5_K.
        let big = MixModel {
            is_70b: true,
            ..few
        };
        assert_eq!(t(&big, FileType::Q2K, "blk.9.attn_v.weight", 8192), "Q5_K");
        // Rows of 576 (SmolLM2): the 256-block types fall back as llama-quantize's
        // `tensor_type_fallback` says.
        assert_eq!(t(&m, FileType::Q2K, "blk.9.attn_q.weight", 576), "Q4_0");
        assert_eq!(t(&m, FileType::Q3KS, "blk.9.attn_q.weight", 576), "Q4_0");
        assert_eq!(t(&m, FileType::Iq4Xs, "blk.9.attn_q.weight", 576), "IQ4_NL");
        assert_eq!(t(&m, FileType::Iq4Nl, "blk.9.attn_q.weight", 576), "IQ4_NL");
        // The output: Q8_0 when its rows are not whole blocks of the file's default type.
        assert_eq!(t(&m, FileType::Iq4Xs, "output.weight", 576), "Q8_0");
        // IQ4_NL's blocks of 32 fit: Q6_K, which falls back to Q8_0.
        assert_eq!(t(&m, FileType::Iq4Nl, "output.weight", 576), "Q8_0");
        assert_eq!(t(&m, FileType::Iq4Nl, "output.weight", 512), "Q6_K");
        assert_eq!(t(&m, FileType::Q2K, "output.weight", 576), "Q8_0");
    }

    #[test]
    fn i_quant_file_types_follow_llama_quantize() {
        let m = MixModel {
            experts: 0,
            layers: 32,
            is_70b: false,
            tied_embeddings: false,
            gqa: 2,
            has_imatrix: true,
        };
        let t = |m: &MixModel, f, n: &str| name(tensor_type(f, m, n, 2, 4096));
        // IQ2_XXS / IQ2_XS: attn_v and the first eighth's ffn_down Q2_K (Q4_K with GQA ≥ 4),
        // the embeddings Q2_K, the output Q5_K.
        assert_eq!(t(&m, FileType::Iq2Xxs, "blk.9.attn_v.weight"), "Q2_K");
        assert_eq!(t(&m, FileType::Iq2Xxs, "blk.3.ffn_down.weight"), "Q2_K");
        assert_eq!(t(&m, FileType::Iq2Xxs, "blk.4.ffn_down.weight"), "IQ2_XXS");
        assert_eq!(t(&m, FileType::Iq2Xs, "token_embd.weight"), "Q2_K");
        assert_eq!(t(&m, FileType::Iq2Xs, "output.weight"), "Q5_K");
        let gqa4 = MixModel { gqa: 4, ..m };
        assert_eq!(t(&gqa4, FileType::Iq2Xxs, "blk.9.attn_v.weight"), "Q4_K");
        // IQ2_S is IQ2_XS with IQ3_S raises; IQ2_M is IQ2_S's.
        assert_eq!(t(&m, FileType::Iq2S, "blk.9.attn_q.weight"), "IQ2_XS");
        assert_eq!(t(&m, FileType::Iq2S, "blk.9.attn_v.weight"), "IQ3_S");
        assert_eq!(t(&m, FileType::Iq2M, "blk.9.attn_q.weight"), "IQ2_S");
        assert_eq!(t(&m, FileType::Iq2M, "blk.9.attn_output.weight"), "IQ3_S");
        assert_eq!(t(&m, FileType::Iq2M, "token_embd.weight"), "IQ3_S");
        // IQ3_XXS: attn_q / attn_k IQ2_S, attn_output IQ3_S, attn_v IQ3_XXS with an imatrix.
        assert_eq!(t(&m, FileType::Iq3Xxs, "blk.9.attn_q.weight"), "IQ2_S");
        assert_eq!(t(&m, FileType::Iq3Xxs, "blk.9.attn_output.weight"), "IQ3_S");
        assert_eq!(t(&m, FileType::Iq3Xxs, "blk.9.attn_v.weight"), "IQ3_XXS");
        let plain = MixModel {
            has_imatrix: false,
            ..m
        };
        assert_eq!(t(&plain, FileType::Iq3Xxs, "blk.9.attn_v.weight"), "IQ3_S");
        assert_eq!(t(&plain, FileType::Iq3Xxs, "blk.9.ffn_down.weight"), "Q3_K");
        // IQ3_XS: the middle layers' ffn_gate / ffn_up IQ3_XXS.
        assert_eq!(t(&m, FileType::Iq3Xs, "blk.9.ffn_up.weight"), "IQ3_XXS");
        assert_eq!(t(&m, FileType::Iq3Xs, "blk.2.ffn_gate.weight"), "IQ3_S");
        assert_eq!(t(&m, FileType::Iq3Xs, "blk.28.ffn_gate.weight"), "IQ3_S");
        // IQ3_M: attn_v Q4_K, attn_output Q4_K, the first eighth's ffn_down Q4_K.
        assert_eq!(t(&m, FileType::Iq3M, "blk.9.attn_v.weight"), "Q4_K");
        assert_eq!(t(&m, FileType::Iq3M, "blk.9.attn_output.weight"), "Q4_K");
        assert_eq!(t(&m, FileType::Iq3M, "blk.3.ffn_down.weight"), "Q4_K");
        assert_eq!(t(&m, FileType::Iq3M, "blk.4.ffn_down.weight"), "IQ3_S");
        assert_eq!(t(&m, FileType::Iq3S, "blk.4.ffn_down.weight"), "IQ3_S");
        // Rows of 576 fall back to IQ4_NL.
        assert_eq!(
            name(tensor_type(
                FileType::Iq2Xs,
                &m,
                "blk.4.attn_q.weight",
                2,
                576
            )),
            "IQ4_NL"
        );
        assert!(requires_imatrix(
            "blk.0.attn_q.weight",
            GgufType::Iq3Xxs.ggml_type()
        ));
        assert!(!requires_imatrix(
            "output.weight",
            GgufType::Iq2Xxs.ggml_type()
        ));
        assert!(!requires_imatrix(
            "blk.0.attn_q.weight",
            GgufType::Iq3S.ggml_type()
        ));
    }

    #[test]
    fn other_file_types() {
        let m = MixModel {
            experts: 0,
            layers: 4,
            is_70b: false,
            tied_embeddings: false,
            gqa: 1,
            has_imatrix: false,
        };
        let t = |f, n: &str, dims| name(tensor_type(f, &m, n, dims, 512));
        assert_eq!(t(FileType::Q4_0, "output.weight", 2), "Q6_K");
        assert_eq!(t(FileType::Q8_0, "output.weight", 2), "Q8_0");
        assert_eq!(t(FileType::Q4_0, "blk.0.attn_v.weight", 2), "Q4_0");
        assert_eq!(
            t(FileType::Mxfp4Moe, "blk.0.ffn_up_exps.weight", 3),
            "MXFP4"
        );
        assert_eq!(t(FileType::Mxfp4Moe, "blk.0.attn_q.weight", 2), "Q8_0");
        assert_eq!(t(FileType::Mxfp4Moe, "output.weight", 2), "Q8_0");
        assert_eq!(t(FileType::F16, "blk.0.attn_q.weight", 2), "F16");
        assert_eq!(t(FileType::F16, "output.weight", 2), "F16");
    }
}
