//! Option groups and value types shared by the commands: `--device`, and the enums behind
//! `--format`, `--kv-cache`, `--calib-dtype` and `--size` (clap lists their values in
//! `--help` and rejects others with the list).

use clap::{Args, ValueEnum};
use kiln_runtime::export::recipe::KvCache;
use kiln_runtime::model::candle;

/// Where a model runs (`export --calib`, `eval`, `verify`).
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Where the model runs: `cpu`, `cuda[:N]` (feature `candle-cuda`) or `metal[:N]`
    /// (feature `candle-metal`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

impl DeviceArgs {
    /// The candle device, or a named error (an unknown kind, a backend built without its
    /// feature).
    pub fn device(&self) -> anyhow::Result<candle::Device> {
        Ok(kiln_runtime::model::device(&self.device)?)
    }

    /// Whether this is the default, the CPU.
    pub fn is_cpu(&self) -> bool {
        self.device == "cpu"
    }
}

/// `--kv-cache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheArg {
    /// FP8 E4M3 keys and values (`kv_cache_quant_algo: FP8`).
    Fp8,
    /// NVFP4 keys and values.
    Nvfp4,
}

impl From<KvCacheArg> for KvCache {
    fn from(k: KvCacheArg) -> Self {
        match k {
            KvCacheArg::Fp8 => KvCache::Fp8,
            KvCacheArg::Nvfp4 => KvCache::Nvfp4,
        }
    }
}

/// `--calib-dtype` (export) and `--dtype` (eval): the dtype a model runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RunDtype {
    /// float32: the most exact.
    F32,
    /// bfloat16, as ModelOpt calibrates and as transformers runs a bf16 checkpoint (the weights
    /// rounded to bf16 where they are wider). On CPUs with AVX-512 BF16 the Linears run that
    /// instruction's GEMM (about twice the f32 GEMM's speed).
    Bf16,
}

impl From<RunDtype> for candle::DType {
    fn from(d: RunDtype) -> Self {
        match d {
            RunDtype::F32 => candle::DType::F32,
            RunDtype::Bf16 => candle::DType::BF16,
        }
    }
}

/// `kiln demo-model --size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DemoSize {
    /// 17M parameters.
    Small,
    /// The export benchmark's Llama.
    #[value(name = "254m")]
    M254,
    /// The calibration benchmark's 1.1B Llama.
    #[value(name = "1b")]
    B1,
    /// 3.8B parameters (about 8 GB in bf16).
    #[value(name = "8gb")]
    Gb8,
}

impl DemoSize {
    /// The preset's name in `DemoConfig::preset`.
    pub fn preset(self) -> &'static str {
        match self {
            DemoSize::Small => "small",
            DemoSize::M254 => "254m",
            DemoSize::B1 => "1b",
            DemoSize::Gb8 => "8gb",
        }
    }
}
