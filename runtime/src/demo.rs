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
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size`.
    pub intermediate: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `vocab_size`.
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

impl DemoConfig {
    /// The named sizes `kiln demo-model --size` offers: `small` (the default, 17M parameters),
    /// `254m` (the export benchmark's Llama: hidden 1024, 12 layers, vocab 32000), `1b` (1.1B
    /// parameters, Llama-3.2-1B's layer shapes, for the calibration benchmark) and `8gb`
    /// (3.8B parameters, ~7.6 GB in bf16, for the memory benchmark).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "small" => Some(Self::default()),
            "254m" => Some(DemoConfig {
                hidden: 1024,
                intermediate: 4096,
                layers: 12,
                heads: 16,
                kv_heads: 8,
                vocab: 32000,
            }),
            "1b" => Some(DemoConfig {
                hidden: 2048,
                intermediate: 8192,
                layers: 16,
                heads: 32,
                kv_heads: 8,
                vocab: 32000,
            }),
            "8gb" => Some(DemoConfig {
                hidden: 3072,
                intermediate: 8192,
                layers: 36,
                heads: 24,
                kv_heads: 8,
                vocab: 32000,
            }),
            _ => None,
        }
    }

    /// The number of parameters.
    pub fn parameters(&self) -> u64 {
        let (h, i, l, v) = (
            self.hidden as u64,
            self.intermediate as u64,
            self.layers as u64,
            self.vocab as u64,
        );
        let kv = (self.kv_heads * (self.hidden / self.heads)) as u64;
        2 * v * h + h + l * (2 * h * h + 2 * kv * h + 3 * h * i + 2 * h)
    }
}

/// The demo's generator (determinism, not quality).
struct Rng(crate::rng::SplitMix64);

impl Rng {
    /// A normal sample (Box–Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.0.uniform().max(f64::MIN_POSITIVE), self.0.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

/// `n` bf16 values ~ N(0, std²), generated in fixed 64 Ki-element chunks each seeded from
/// `seed` and its index: the same bytes whatever the thread count, in parallel.
fn bf16_bytes(n: usize, std: f32, seed: u64) -> Vec<u8> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0u8; n * 2];
    out.par_chunks_mut(CHUNK * 2)
        .enumerate()
        .for_each(|(c, bytes)| {
            let mut rng = Rng(crate::rng::SplitMix64(
                seed ^ (c as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
            ));
            for pair in bytes.chunks_exact_mut(2) {
                pair.copy_from_slice(&half::bf16::from_f32(rng.normal() * std).to_le_bytes());
            }
        });
    out
}

/// Writes the demo checkpoint into `dir` (config.json, model.safetensors, generation_config.json)
/// and returns activation statistics for every Linear input, keyed as ModelOpt names them.
///
/// Long on purpose: the demo checkpoint written tensor by tensor in Hugging Face's order.
pub fn write_demo_model(dir: &Path, c: DemoConfig) -> Result<ActAmax, SinkError> {
    let head_dim = c.hidden / c.heads;
    let config = json!({
        "_name_or_path": "kiln-demo",
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

    let mut seeds = crate::rng::SplitMix64(0x6b69_6c6e); // "kiln"
    let mut amax_rng = crate::rng::SplitMix64(0x616d_6178); // "amax"
    let mut w = ShardWriter::new(dir, 5_000_000_000);
    let mut amax = Vec::new();
    // AWQ / SmoothQuant scales, one per input channel, in [0.5, 2): what a scale search would
    // hand the AWQ and SmoothQuant formats.
    let mut pqs_rng = crate::rng::SplitMix64(0x7071_7321); // "pqs!"
    let mut pqs = Vec::new();
    let ones: Vec<u8> = (0..c.hidden)
        .flat_map(|_| half::bf16::ONE.to_le_bytes())
        .collect();
    let random =
        |seeds: &mut crate::rng::SplitMix64, n: usize| bf16_bytes(n, 0.02, seeds.next_u64());
    w.write(
        "model.embed_tokens.weight",
        Dtype::BF16,
        &[c.vocab, c.hidden],
        &random(&mut seeds, c.vocab * c.hidden),
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
                &random(&mut seeds, out * inp),
            )?;
            amax.push((
                format!("{p}.{name}.input_quantizer"),
                1.0 + 4.0 * amax_rng.uniform() as f32,
            ));
            pqs.push((
                format!("{p}.{name}"),
                (0..inp)
                    .map(|_| half::bf16::from_f64(0.5 + 1.5 * pqs_rng.uniform()).to_f32())
                    .collect::<Vec<f32>>(),
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
        &random(&mut seeds, c.vocab * c.hidden),
    )?;
    amax.push(("lm_head.input_quantizer".into(), 8.0));
    w.finish()?;
    write_byte_tokenizer(dir)?;
    let mut act = ActAmax::from_values(amax);
    for (module, scales) in pqs {
        act.set_pre_quant_scale(&module, scales);
    }
    Ok(act)
}

/// The byte a byte-level tokenizer's symbol stands for, GPT-2's `bytes_to_unicode`:
/// printable Latin-1 bytes are themselves, the other 68 are moved to U+0100 onwards.
fn byte_symbol(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).expect("in range")
}

/// The special tokens of the demo tokenizer, ids 0 to 3; byte `b` is token `4 + b`.
pub const DEMO_SPECIAL_TOKENS: [&str; 4] = ["<unk>", "<s>", "</s>", "<pad>"];

/// The demo tokenizer's chat template: `<|role|>content` turns, the assistant's content and
/// EOS marked with `{% generation %}` (TRL's `assistant_only_loss`).
pub const DEMO_CHAT_TEMPLATE: &str = "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// Writes a byte-level tokenizer (`tokenizer.json`: BPE without merges, so every byte is
/// one token; a BOS `<s>` before every sequence, as Llama's tokenizer adds) and its
/// `tokenizer_config.json` (`</s>` ends sequences, `<pad>` pads) into `dir`. transformers
/// loads it as a `PreTrainedTokenizerFast`; any UTF-8 text round-trips.
pub fn write_byte_tokenizer(dir: &Path) -> Result<(), SinkError> {
    let mut vocab = serde_json::Map::new();
    for (i, t) in DEMO_SPECIAL_TOKENS.iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..=255u8 {
        vocab.insert(byte_symbol(b).to_string(), json!(4 + b as usize));
    }
    let added: Vec<serde_json::Value> = DEMO_SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    let config = json!({
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": false,
        "chat_template": DEMO_CHAT_TEMPLATE,
    });
    for (name, v) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config),
    ] {
        let path = dir.join(name);
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&v).expect("JSON") + "\n",
        )
        .map_err(|source| SinkError::Io { path, source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_documented_sizes() {
        assert_eq!(
            DemoConfig::preset("254m").unwrap().parameters(),
            254_305_280
        );
        let one = DemoConfig::preset("1b").unwrap().parameters();
        assert!((1_000_000_000..1_200_000_000).contains(&one), "{one}");
        let big = DemoConfig::preset("8gb").unwrap().parameters();
        assert!((3_700_000_000..3_900_000_000).contains(&big), "{big}");
        assert!(DemoConfig::preset("huge").is_none());
    }

    #[test]
    fn the_demo_model_is_the_same_bytes_whatever_the_thread_count() {
        let c = DemoConfig {
            hidden: 64,
            intermediate: 128,
            layers: 1,
            heads: 4,
            kv_heads: 2,
            vocab: 2000,
        };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        one.install(|| write_demo_model(a.path(), c)).unwrap();
        write_demo_model(b.path(), c).unwrap();
        let f = "model.safetensors";
        assert_eq!(
            std::fs::read(a.path().join(f)).unwrap(),
            std::fs::read(b.path().join(f)).unwrap()
        );
    }
}
