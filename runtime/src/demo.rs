//! The built-in demo model: a small, deterministic, random Llama checkpoint (bf16) plus matching
//! activation statistics, so `kiln export` runs on a fresh machine with nothing downloaded.

use crate::export::act_amax::ActAmax;
use crate::sink::{ShardWriter, SinkError};
use safetensors::Dtype;
use serde_json::json;
use std::path::Path;

/// The demo model's size.
#[derive(Debug, Clone, Copy)]
pub struct DemoConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            hidden: 512,
            intermediate: 1536,
            layers: 4,
            heads: 8,
            kv_heads: 4,
            vocab: 4096,
        }
    }
}

/// SplitMix64: a tiny, well-known generator — the demo needs determinism, not quality.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A normal sample (Box–Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.unit().max(f64::MIN_POSITIVE), self.unit());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

fn bf16_bytes(n: usize, std: f32, rng: &mut Rng) -> Vec<u8> {
    (0..n)
        .flat_map(|_| half::bf16::from_f32(rng.normal() * std).to_le_bytes())
        .collect()
}

/// Writes the demo checkpoint into `dir` (config.json, model.safetensors, generation_config.json)
/// and returns activation statistics for every Linear input, keyed as ModelOpt names them.
pub fn write_demo_model(dir: &Path, c: DemoConfig) -> Result<ActAmax, SinkError> {
    let head_dim = c.hidden / c.heads;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "vocab_size": c.vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
    });
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| SinkError::Io { path, source })
    };
    write(
        "config.json",
        serde_json::to_string_pretty(&config).expect("JSON") + "\n",
    )?;
    write(
        "generation_config.json",
        "{\n  \"bos_token_id\": 1,\n  \"eos_token_id\": 2\n}\n".into(),
    )?;

    let mut rng = Rng(0x6b69_6c6e); // "kiln"
    let mut w = ShardWriter::new(dir, u64::MAX);
    let mut amax = Vec::new();
    let ones: Vec<u8> = (0..c.hidden)
        .flat_map(|_| half::bf16::ONE.to_le_bytes())
        .collect();
    w.write(
        "model.embed_tokens.weight",
        Dtype::BF16,
        &[c.vocab, c.hidden],
        &bf16_bytes(c.vocab * c.hidden, 0.02, &mut rng),
    )?;
    for l in 0..c.layers {
        let p = format!("model.layers.{l}");
        let linears = [
            ("self_attn.q_proj", c.heads * head_dim, c.hidden),
            ("self_attn.k_proj", c.kv_heads * head_dim, c.hidden),
            ("self_attn.v_proj", c.kv_heads * head_dim, c.hidden),
            ("self_attn.o_proj", c.hidden, c.heads * head_dim),
            ("mlp.gate_proj", c.intermediate, c.hidden),
            ("mlp.up_proj", c.intermediate, c.hidden),
            ("mlp.down_proj", c.hidden, c.intermediate),
        ];
        for (name, out, inp) in linears {
            w.write(
                &format!("{p}.{name}.weight"),
                Dtype::BF16,
                &[out, inp],
                &bf16_bytes(out * inp, 0.02, &mut rng),
            )?;
            amax.push((
                format!("{p}.{name}.input_quantizer"),
                1.0 + 4.0 * rng.unit() as f32,
            ));
        }
        w.write(
            &format!("{p}.input_layernorm.weight"),
            Dtype::BF16,
            &[c.hidden],
            &ones,
        )?;
        w.write(
            &format!("{p}.post_attention_layernorm.weight"),
            Dtype::BF16,
            &[c.hidden],
            &ones,
        )?;
    }
    w.write("model.norm.weight", Dtype::BF16, &[c.hidden], &ones)?;
    w.write(
        "lm_head.weight",
        Dtype::BF16,
        &[c.vocab, c.hidden],
        &bf16_bytes(c.vocab * c.hidden, 0.02, &mut rng),
    )?;
    amax.push(("lm_head.input_quantizer".into(), 8.0));
    w.finish()?;
    Ok(ActAmax::from_values(amax))
}
