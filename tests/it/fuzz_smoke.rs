//! The fuzz targets (fuzz/targets.rs) on the stable toolchain, for CI: each target runs its
//! committed seeds (fuzz/corpus/<target>/) and then, for a fixed time, inputs made from them
//! by a seeded mutator (bit flips, byte insertions and deletions, duplicated and spliced
//! ranges, boundary integers written over the data, truncation). No coverage guidance: that is
//! libFuzzer's, in the longer runs RELIABILITY.md records. A panic fails the test and leaves the
//! input in `target/fuzz-smoke/<target>.crash`; an input slower than 10 s is a hang and fails
//! likewise.
//!
//! `KILN_FUZZ_SECONDS` sets the time per target (default 4).

#[path = "../../fuzz/targets.rs"]
mod targets;

use std::path::Path;
use std::time::{Duration, Instant};

/// xorshift64*: the same inputs on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Integers that sit on boundaries (lengths, offsets, counts), little-endian.
const INTERESTING: [u64; 10] = [
    0,
    1,
    7,
    0x7f,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 62,
    u64::MAX,
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        let n = input.len();
        match rng.below(8) {
            0 if n > 0 => {
                let i = rng.below(n);
                input[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(n + 1);
                input.insert(i, rng.next() as u8);
            }
            2 if n > 0 => {
                let i = rng.below(n);
                let len = 1 + rng.below((n - i).min(16));
                input.drain(i..i + len);
            }
            3 if n > 0 => {
                let i = rng.below(n);
                let len = 1 + rng.below((n - i).min(64));
                let chunk = input[i..i + len].to_vec();
                let at = rng.below(n + 1);
                input.splice(at..at, chunk);
            }
            4 if n > 0 => {
                let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let width = [1, 2, 4, 8][rng.below(4)];
                let i = rng.below(n);
                let end = (i + width).min(n);
                input[i..end].copy_from_slice(&v[..end - i]);
            }
            5 if n > 0 => input.truncate(rng.below(n)),
            6 => {
                // Splice in part of another seed.
                let other = &seeds[rng.below(seeds.len())];
                if !other.is_empty() {
                    let i = rng.below(other.len());
                    let len = 1 + rng.below((other.len() - i).min(128));
                    let at = rng.below(n + 1);
                    input.splice(at..at, other[i..i + len].iter().copied());
                }
            }
            _ if n > 0 => {
                // An ASCII digit run: JSON numbers, lengths in text.
                let i = rng.below(n);
                let digits = format!("{}", INTERESTING[rng.below(INTERESTING.len())]);
                let end = (i + digits.len()).min(n);
                input[i..end].copy_from_slice(&digits.as_bytes()[..end - i]);
            }
            _ => input.push(rng.next() as u8),
        }
    }
}

fn run_one(name: &str, target: fn(&[u8]), input: &[u8]) {
    let started = Instant::now();
    let outcome = std::panic::catch_unwind(|| target(input));
    let slow = started.elapsed() > Duration::from_secs(10);
    if outcome.is_err() || slow {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("../fuzz-smoke");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.crash"));
        std::fs::write(&path, input).unwrap();
        panic!(
            "fuzz target `{name}`: {} on the input saved in {}",
            if slow {
                "a hang (over 10 s)"
            } else {
                "a panic"
            },
            path.display()
        );
    }
}

#[test]
fn readers_survive_mutated_inputs() {
    let seconds: u64 = std::env::var("KILN_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for (name, target) in targets::TARGETS {
        let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(corpus.join(name))
            .unwrap_or_else(|e| panic!("fuzz/corpus/{name}: {e}"))
            .map(|f| std::fs::read(f.unwrap().path()).unwrap())
            .collect();
        seeds.sort();
        assert!(!seeds.is_empty(), "fuzz/corpus/{name} has seeds");
        for s in &seeds {
            run_one(name, target, s);
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let mut runs = 0u64;
        while Instant::now() < deadline {
            let mut input = seeds[rng.below(seeds.len())].clone();
            mutate(&mut rng, &seeds, &mut input);
            run_one(name, target, &input);
            runs += 1;
        }
        println!(
            "{name}: {} seeds, {runs} mutated inputs in {seconds} s",
            seeds.len()
        );
    }
}

#[test]
fn the_seeds_and_companions_are_valid_inputs() {
    // Mutations of valid inputs reach past the first checks: the adapter targets' fixed
    // companions load, every TOML seed applies for some task, every training-data seed reads.
    let d = tempfile::tempdir().unwrap();
    std::fs::write(
        d.path().join("adapter_config.json"),
        targets::ADAPTER_CONFIG,
    )
    .unwrap();
    std::fs::write(
        d.path().join("adapter_model.safetensors"),
        targets::tiny_adapter_weights(),
    )
    .unwrap();
    let modules = vec![("model.layers.0.self_attn.q_proj".to_string(), 4, 4)];
    let cpu = kiln_runtime::model::candle::Device::Cpu;
    kiln_runtime::model::lora::Adapters::load_peft_for(d.path(), &modules, &cpu).unwrap();
    // The quantized exports the CT / MLX targets start from decode.
    for (config, weights) in [
        (targets::CT_CONFIG, targets::CT_WEIGHTS),
        (targets::MLX_CONFIG, targets::MLX_WEIGHTS),
    ] {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("config.json"), config).unwrap();
        std::fs::write(d.path().join("model.safetensors"), weights).unwrap();
        let f32 = kiln_runtime::model::candle::DType::F32;
        let w = kiln_runtime::formats::load(d.path(), f32, &cpu, true)
            .unwrap()
            .weights;
        w.get("model.layers.0.mlp.down_proj.weight").unwrap();
    }
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for f in std::fs::read_dir(corpus.join("train_toml")).unwrap() {
        let f = f.unwrap().path();
        let text = std::fs::read_to_string(&f).unwrap();
        let applies = ["sft", "grpo"].iter().any(|task| {
            let mut c = kiln_runtime::TrainConfig::new(task, "candle", "m", "o");
            kiln_runtime::train::fields::defaults_for(&mut c);
            kiln::cli::apply_toml(&mut c, &text, &f).is_ok()
        });
        assert!(applies, "{}", f.display());
    }
    use kiln_runtime::train::data::{DataFormat, Dataset};
    let all = [
        DataFormat::Text,
        DataFormat::PromptCompletion,
        DataFormat::Messages,
        DataFormat::Preference,
        DataFormat::Unpaired,
        DataFormat::Prompt,
    ];
    for f in std::fs::read_dir(corpus.join("train_jsonl")).unwrap() {
        let f = f.unwrap().path();
        Dataset::read(&f, &all).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
}
