//! Where a training step's time goes, on the small demo Llama (17M parameters) with a batch
//! of 8 × 128 tokens in f32: the forward pass, the forward pass with the loss and the backward
//! pass, and the AdamW update of every weight (throughput in tokens); and, on the 254M demo
//! model's Linear shapes, candle's f32 GEMM alone and one trained Linear's forward and backward
//! (throughput in FLOP).
//! `benches/peers/train_peer.py` compares whole steps with PyTorch + TRL.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::model::DecoderModel;
use kiln_runtime::model::candle::{DType, Device, Tensor, Var};
use kiln_runtime::train::candle::ops::CandleOps;
use kiln_runtime::train::candle::optim::{AdamW, AdamWConfig};
use kiln_runtime::train::ops::TensorOps;

const BATCH: usize = 8;
const LEN: usize = 128;

/// candle's f32 matmul alone on the 254M demo model's Linear shapes (8 × 128 tokens, hidden
/// 1024, MLP 4096) in the three layouts a trained Linear runs: `x · Wᵀ` (forward), `dy · W`
/// (input gradient), `xᵀ · dy` (weight gradient). Throughput in FLOP: the ceiling the
/// training step's GEMMs run against.
fn matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul_f32");
    g.sample_size(10);
    let m = BATCH * LEN;
    for (k, n) in [(1024, 4096), (4096, 1024)] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        let dy = Tensor::randn(0f32, 1.0, (m, n), &Device::Cpu).unwrap();
        g.throughput(Throughput::Elements((2 * m * k * n) as u64));
        g.bench_function(format!("x_wt/{m}x{k}x{n}"), |b| {
            b.iter(|| x.matmul(&w.t().unwrap()).unwrap());
        });
        g.bench_function(format!("dy_w/{m}x{k}x{n}"), |b| {
            b.iter(|| dy.matmul(&w).unwrap());
        });
        g.bench_function(format!("xt_dy/{m}x{k}x{n}"), |b| {
            b.iter(|| x.t().unwrap().matmul(&dy).unwrap());
        });
    }
    g.finish();
}

/// One trained Linear's forward and backward on the 254M demo model's shapes (8 × 128 tokens,
/// hidden 1024, MLP 4096), as candle's composition (`reshape`, `matmul` with `w.t()`,
/// `reshape`: four graph nodes) and as kiln's one op (`model::dense_linear`); throughput in
/// FLOP (three GEMMs of `2·m·k·n` each).
fn linear(c: &mut Criterion) {
    let mut g = c.benchmark_group("linear_fwd_bwd_f32");
    g.sample_size(10);
    for (k, n) in [(1024, 4096), (4096, 1024)] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (BATCH, LEN, k), &Device::Cpu).unwrap())
            .unwrap();
        let w =
            Var::from_tensor(&Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu).unwrap()).unwrap();
        g.throughput(Throughput::Elements((3 * 2 * BATCH * LEN * k * n) as u64));
        g.bench_function(format!("candle_composition/{k}x{n}"), |b| {
            b.iter(|| {
                let y = x
                    .as_tensor()
                    .reshape((BATCH * LEN, k))
                    .unwrap()
                    .matmul(&w.as_tensor().t().unwrap())
                    .unwrap()
                    .reshape((BATCH, LEN, n))
                    .unwrap();
                y.sum_all().unwrap().backward().unwrap()
            });
        });
        g.bench_function(format!("dense_linear/{k}x{n}"), |b| {
            b.iter(|| {
                let y = kiln_runtime::model::dense_linear::linear(x.as_tensor(), w.as_tensor())
                    .unwrap();
                y.sum_all().unwrap().backward().unwrap()
            });
        });
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    write_demo_model(dir.path(), DemoConfig::default()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let model = DecoderModel::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let ops = CandleOps {
        device: Device::Cpu,
    };
    let ids: Vec<u32> = (0..BATCH * LEN).map(|i| 4 + (i * 7 % 250) as u32).collect();
    let ids = Tensor::from_vec(ids, (BATCH, LEN), &Device::Cpu).unwrap();
    let labels = ids.narrow(1, 1, LEN - 1).unwrap().contiguous().unwrap();
    let mut g = c.benchmark_group("train_step_small_demo_8x128");
    g.sample_size(10);
    g.throughput(Throughput::Elements((BATCH * LEN) as u64));
    g.bench_function("forward", |b| {
        b.iter(|| model.forward(&ids).unwrap());
    });
    let loss = || {
        let logits = model.forward(&ids).unwrap().narrow(1, 0, LEN - 1).unwrap();
        let logps = ops.token_logps(&logits, &labels).unwrap();
        ops.affine(&ops.mean_all(&logps).unwrap(), -1.0, 0.0)
            .unwrap()
    };
    g.bench_function("forward_loss_backward", |b| {
        b.iter(|| loss().backward().unwrap());
    });
    let params: Vec<_> = model
        .weights()
        .vars()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let grads = loss().backward().unwrap();
    let grads: Vec<Option<Tensor>> = params
        .iter()
        .map(|(_, v)| grads.get(v.as_tensor()).cloned())
        .collect();
    let mut adam = AdamW::new(
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        params,
    )
    .unwrap();
    g.bench_function("adamw_update", |b| {
        b.iter(|| adam.update(1e-6, &grads).unwrap());
    });
    g.finish();
}

criterion_group!(benches, matmul, linear, bench);
criterion_main!(benches);
