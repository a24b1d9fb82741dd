//! The bitsandbytes writer (`--output-format bnb`): what transformers saves for a model loaded
//! with `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=…,
//! bnb_4bit_use_double_quant=True)` — QLoRA's base in PEFT. Every Linear but `lm_head` (as
//! transformers' `get_keys_to_not_convert` leaves it) is quantized by bitsandbytes 0.50.2's
//! own arithmetic (`kiln_kernels::ops::bnb`): 4-bit codes in blocks of 64 over the flattened
//! weight, each block's absmax double-quantized (8-bit, blocks of 256, around its mean), stored
//! as `weight` (`uint8 [n·k/2, 1]`), `weight.absmax`, `weight.nested_absmax`,
//! `weight.quant_map`, `weight.nested_quant_map` and the packed quant state
//! `weight.quant_state.bitsandbytes__<type>` (JSON bytes). Other tensors keep their dtype;
//! `config.json` gets transformers' `quantization_config`.

#[cfg(feature = "exec")]
pub mod read;
pub mod reader;

use crate::export::ExportError;
use crate::export::recipe::glob_match;
use crate::export::stats::ErrorStats;
use crate::export::writer::{
    Encoded, EncodedType, FloatValues, LinearWeight, OutputWriter, WriterEnd, WriterStart,
    WriterType, Written,
};
use crate::sink::ShardWriter;
use kiln_kernels::ops::bnb::{self as kb, DYNAMIC, QuantType};
use safetensors::Dtype;
use serde_json::{Map, Value as Json, json};

/// bitsandbytes' 4-bit block size (transformers' default).
pub const BLOCKSIZE: usize = 64;
/// The double quantization's block size.
pub const NESTED_BLOCKSIZE: usize = 256;

/// bitsandbytes' layout in one 4-bit type.
#[crate::writer(name = "bnb", reader = reader::BnbReader, crate = crate)]
pub struct BnbOutput {
    ty: QuantType,
    shards: Option<ShardWriter>,
    exclude: Vec<String>,
    include: Vec<String>,
    /// The checkpoint's float dtype name (`bfloat16`): the compute dtype the config states.
    dtype: String,
}

fn err(what: impl Into<String>) -> ExportError {
    ExportError::Writer {
        writer: "bnb".into(),
        what: what.into(),
    }
}

/// torch's name of a float dtype.
fn torch_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        _ => "float32",
    }
}

/// A float as Python's `repr` writes it (what `json.dumps` writes): the shortest round trip,
/// positional for 1e-4 ≤ |x| < 1e16, else `1.5e-05`.
pub fn python_repr(x: f64) -> String {
    if x == 0.0 || (1e-4..1e16).contains(&x.abs()) {
        let s = format!("{x}");
        if s.contains('.') || s.contains("inf") || s.contains("NaN") {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let s = format!("{x:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

impl BnbOutput {
    fn excluded(&self, module: &str) -> bool {
        !self.include.iter().any(|g| glob_match(g, module))
            && self.exclude.iter().any(|g| glob_match(g, module))
    }

    /// The tensors of Linear `module` (`[rows, cols]` of `dtype`) quantized.
    fn quantize(
        &self,
        module: &str,
        values: &[f32],
        rows: usize,
        cols: usize,
        dtype: Dtype,
    ) -> Result<Written, ExportError> {
        let kernel = |source| ExportError::Kernel {
            tensor: format!("{module}.weight"),
            source,
        };
        let n = values.len();
        let blocks = n.div_ceil(BLOCKSIZE);
        let mut packed = vec![0u8; n.div_ceil(2)];
        let mut absmax = vec![0f32; blocks];
        kb::quantize_4bit(self.ty, values, BLOCKSIZE, &mut packed, &mut absmax).map_err(kernel)?;
        let offset = kb::mean(&absmax);
        let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
        let mut codes = vec![0u8; blocks];
        let mut nested = vec![0f32; blocks.div_ceil(NESTED_BLOCKSIZE)];
        kb::quantize_blockwise(
            &DYNAMIC,
            &centred,
            NESTED_BLOCKSIZE,
            &mut codes,
            &mut nested,
        )
        .map_err(kernel)?;
        // What a loader decodes: the absmax back from its 8 bits, then the codes.
        let mut back = vec![0f32; blocks];
        kb::dequantize_blockwise(&DYNAMIC, &codes, &nested, NESTED_BLOCKSIZE, &mut back)
            .map_err(kernel)?;
        let back: Vec<f32> = back.iter().map(|v| v + offset).collect();
        let mut decoded = vec![0f32; n];
        kb::dequantize_4bit(self.ty, &packed, &back, BLOCKSIZE, &mut decoded).map_err(kernel)?;
        let error = ErrorStats::measure(values, |i| decoded[i]);
        let state = format!(
            "{{\"quant_type\": \"{}\", \"blocksize\": {BLOCKSIZE}, \"dtype\": \"{}\", \"shape\": \
             [{rows}, {cols}], \"nested_blocksize\": {NESTED_BLOCKSIZE}, \"nested_dtype\": \
             \"float32\", \"nested_offset\": {}}}",
            self.ty.name(),
            torch_name(dtype),
            python_repr(f64::from(offset))
        );
        let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let w = format!("{module}.weight");
        let t = |name: String, dtype, shape: Vec<usize>, data| Encoded {
            name,
            ty: EncodedType::Dtype(dtype),
            shape,
            data,
        };
        let tensors = vec![
            t(w.clone(), Dtype::U8, vec![packed.len(), 1], packed),
            t(format!("{w}.absmax"), Dtype::U8, vec![blocks], codes),
            t(
                format!("{w}.nested_absmax"),
                Dtype::F32,
                vec![nested.len()],
                f32s(&nested),
            ),
            t(
                format!("{w}.nested_quant_map"),
                Dtype::F32,
                vec![256],
                f32s(&DYNAMIC),
            ),
            t(
                format!("{w}.quant_map"),
                Dtype::F32,
                vec![16],
                f32s(self.ty.code()),
            ),
            t(
                format!("{w}.quant_state.bitsandbytes__{}", self.ty.name()),
                Dtype::U8,
                vec![state.len()],
                state.into_bytes(),
            ),
        ];
        Ok(Written {
            tensors,
            quantized: Some((self.ty.name().to_uppercase(), error)),
        })
    }
}

impl OutputWriter for BnbOutput {
    fn begin(&mut self, start: &WriterStart<'_>) -> Result<(), ExportError> {
        if start.recipe.kv_cache.is_some() {
            return Err(ExportError::WriterCannot {
                writer: "bnb".into(),
                what: "--kv-cache (bitsandbytes quantizes weights only)".into(),
                supported: vec!["nf4".into(), "fp4".into()],
            });
        }
        let c = start.checkpoint.config().raw();
        if ["num_local_experts", "num_experts"]
            .iter()
            .any(|k| c.get(*k).and_then(Json::as_u64).unwrap_or(0) > 0)
        {
            return Err(ExportError::WriterCannot {
                writer: "bnb".into(),
                what: format!(
                    "the MoE model {} (transformers holds its experts fused, outside \
                     bitsandbytes' Linear4bit)",
                    start.architecture
                ),
                supported: vec!["dense models".into()],
            });
        }
        self.exclude = start.recipe.exclude.clone();
        self.include = start.recipe.include.clone();
        self.dtype = start
            .checkpoint
            .tensors()
            .find(|t| matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32))
            .map_or("float32", |t| torch_name(t.dtype))
            .to_string();
        self.shards = Some(super::shards(start, 6));
        Ok(())
    }

    fn linear(&self, w: &LinearWeight<'_>) -> Result<Written, ExportError> {
        let dtype = w.values.dtype();
        self.quantize(w.module, &w.values.to_f32(), w.rows, w.cols, dtype)
    }

    fn tensor(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Written, ExportError> {
        // A Linear the exporters left unquantized (a router): transformers quantizes every
        // Linear but the output layer; embeddings and norms are not Linears.
        if let (Some(module), [rows, cols]) = (name.strip_suffix(".weight"), shape)
            && module != "lm_head"
            && !module.ends_with("embed_tokens")
            && !module.ends_with("norm")
            && !self.excluded(module)
            && let Some(values) = FloatValues::decode(dtype, &data)
        {
            return self.quantize(module, &values.view().to_f32(), *rows, *cols, dtype);
        }
        if name.ends_with("rotary_emb.inv_freq") {
            return Ok(Written::default());
        }
        Ok(Written::copied(name, dtype, shape, data))
    }

    fn write(&mut self, t: Encoded) -> Result<(), ExportError> {
        let EncodedType::Dtype(dtype) = t.ty else {
            return Err(err(format!("`{}` is not a safetensors tensor", t.name)));
        };
        self.shards
            .as_mut()
            .ok_or_else(|| err("written before `begin`"))?
            .write(&t.name, dtype, &t.shape, &t.data)?;
        Ok(())
    }

    fn engines(&self) -> Vec<crate::export::engines::EngineSupport> {
        crate::export::engines::bnb(self.ty.name())
    }

    fn finish(&mut self, end: &WriterEnd<'_>) -> Result<Vec<String>, ExportError> {
        let shards = self
            .shards
            .take()
            .ok_or_else(|| err("finished before `begin`"))?;
        let written = shards.finish()?;
        let mut files = written.files.clone();
        if files.len() > 1 {
            files.push("model.safetensors.index.json".into());
        }
        let mut config = end.checkpoint.config().raw().clone();
        config.insert(
            "quantization_config".into(),
            quantization_config(self.ty, &self.dtype),
        );
        files.extend(super::config_and_model_files(end, config, 2)?);
        Ok(files)
    }
}

/// transformers' `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=…,
/// bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=…)`, as `to_dict` saves it.
fn quantization_config(ty: QuantType, compute: &str) -> Json {
    let mut m = Map::new();
    for (k, v) in [
        ("_load_in_4bit", json!(true)),
        ("_load_in_8bit", json!(false)),
        ("bnb_4bit_compute_dtype", json!(compute)),
        ("bnb_4bit_quant_storage", json!("uint8")),
        ("bnb_4bit_quant_type", json!(ty.name())),
        ("bnb_4bit_use_double_quant", json!(true)),
        ("llm_int8_enable_fp32_cpu_offload", json!(false)),
        ("llm_int8_has_fp16_weight", json!(false)),
        ("llm_int8_skip_modules", Json::Null),
        ("llm_int8_threshold", json!(6.0)),
        ("load_in_4bit", json!(true)),
        ("load_in_8bit", json!(false)),
        ("quant_method", json!("bitsandbytes")),
    ] {
        m.insert(k.into(), v);
    }
    Json::Object(m)
}

impl WriterType for BnbOutput {
    fn formats() -> Vec<(&'static str, String)> {
        vec![
            (
                "nf4",
                "bitsandbytes NF4 (QLoRA's), blocks of 64, double quantization".into(),
            ),
            (
                "fp4",
                "bitsandbytes FP4, blocks of 64, double quantization".into(),
            ),
        ]
    }

    fn new(format: &str) -> Result<Self, ExportError> {
        let ty = match format {
            "nf4" => QuantType::Nf4,
            "fp4" => QuantType::Fp4,
            other => return Err(err(format!("no format `{other}` (nf4, fp4)"))),
        };
        Ok(BnbOutput {
            ty,
            shards: None,
            exclude: Vec::new(),
            include: Vec::new(),
            dtype: "float32".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_writes_them() {
        assert_eq!(python_repr(0.5207660794258118), "0.5207660794258118");
        assert_eq!(python_repr(1.0), "1.0");
        assert_eq!(python_repr(0.0), "0.0");
        assert_eq!(python_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_repr(0.0001), "0.0001");
        assert_eq!(python_repr(2e16), "2e+16");
        assert_eq!(python_repr(f64::from(0.1f32)), "0.10000000149011612");
    }
}
