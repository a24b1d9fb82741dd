//! Where a training step's time goes, on the small demo Llama (17M parameters) with a batch
//! of 8 × 128 tokens in f32: the forward pass, the forward pass with the loss and the backward
//! pass, and the AdamW update of every weight. Throughput is in tokens.
//! `benches/peers/train_peer.py` compares whole steps with PyTorch + TRL.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::model::DecoderModel;
use kiln_runtime::model::candle::{DType, Device, Tensor};
use kiln_runtime::train::candle::ops::CandleOps;
use kiln_runtime::train::candle::optim::{AdamW, AdamWConfig};
use kiln_runtime::train::ops::TensorOps;

const BATCH: usize = 8;
const LEN: usize = 128;

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

criterion_group!(benches, bench);
criterion_main!(benches);
