//! GPTQ's two costs per Linear, on Qwen2.5-Coder-1.5B's shapes (hidden 1536, MLP 8960):
//! the inverse Cholesky factor of the dampened Hessian (`inverse_upper_cholesky`, `n × n`)
//! and the column-by-column quantization of a `[rows, cols]` weight against it
//! (`gptq::quantize`, w4a16 groups of 128, activation order). Throughput in FLOP:
//! `n³` for the factorization (a Cholesky `n³/3` and a triangular inverse `n³/3`, each as
//! multiply-adds), `2·rows·cols²/2` for GPTQ's updates.
//! `KILN_GPTQ_BENCH_SIZES=1536,8960` picks the Hessian sizes.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kiln_runtime::calibrate::gptq::{
    GptqGrid, GptqSettings, IntGrid, inverse_upper_cholesky, quantize,
};

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
}

/// A Hessian `2 XᵀX / t` of `t` random inputs, dampened: symmetric positive definite.
fn hessian(n: usize) -> Vec<f32> {
    let t = 256.max(n / 8);
    let mut seed = 7u64;
    let x: Vec<f32> = (0..t * n).map(|_| lcg(&mut seed)).collect();
    let mut h = vec![0f32; n * n];
    for row in x.chunks_exact(n) {
        for i in 0..n {
            let xi = row[i] * 2.0 / t as f32;
            for (hj, &xj) in h[i * n..(i + 1) * n].iter_mut().zip(row) {
                *hj += xi * xj;
            }
        }
    }
    let mean = (0..n).map(|i| h[i * n + i]).sum::<f32>() / n as f32;
    for i in 0..n {
        h[i * n + i] += 0.01 * mean;
    }
    h
}

fn sizes() -> Vec<usize> {
    std::env::var("KILN_GPTQ_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1536, 8960])
}

fn factor(c: &mut Criterion) {
    let mut g = c.benchmark_group("gptq_factor");
    g.sample_size(10);
    for n in sizes() {
        let h: Vec<f64> = hessian(n).iter().map(|&v| f64::from(v)).collect();
        g.throughput(Throughput::Elements((n * n * n) as u64));
        g.bench_function(format!("inverse_upper_cholesky/{n}"), |b| {
            b.iter(|| inverse_upper_cholesky(&h, n).unwrap());
        });
    }
    g.finish();
}

fn columns(c: &mut Criterion) {
    let mut g = c.benchmark_group("gptq_quantize");
    g.sample_size(10);
    let rows = 1536;
    for cols in sizes() {
        let h = hessian(cols);
        let mut seed = 11u64;
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed) * 0.1).collect();
        let grid = IntGrid {
            bits: 4,
            symmetric: true,
            group: 128,
        };
        let params: Vec<(f32, i8)> = w
            .chunks_exact(128)
            .map(|g| (g.iter().fold(0f32, |m, x| m.max(x.abs())) / 7.5, 0))
            .collect();
        let grid = GptqGrid::Int { grid, params };
        g.throughput(Throughput::Elements((rows * cols * cols) as u64));
        g.bench_function(format!("w4a16_g128/{rows}x{cols}"), |b| {
            b.iter(|| quantize(&w, rows, cols, &h, &grid, |x| x, GptqSettings::default()));
        });
    }
    g.finish();
}

fn gram(c: &mut Criterion) {
    use kiln_runtime::model::candle::{Device, Tensor};
    let mut g = c.benchmark_group("gptq_xtx");
    g.sample_size(10);
    let t = 512;
    for cols in sizes() {
        let mut seed = 3u64;
        let x: Vec<f32> = (0..t * cols).map(|_| lcg(&mut seed)).collect();
        let xt = Tensor::from_vec(x.clone(), (t, cols), &Device::Cpu).unwrap();
        g.throughput(Throughput::Elements((t * cols * cols) as u64));
        g.bench_function(format!("candle_full/{t}x{cols}"), |b| {
            b.iter(|| xt.t().unwrap().matmul(&xt).unwrap());
        });
        let mut out = vec![0f32; cols * cols];
        g.bench_function(format!("lower/{t}x{cols}"), |b| {
            b.iter(|| kiln_kernels::ops::linalg::gram_lower_f32(&x, t, cols, &mut out));
        });
    }
    g.finish();
}

criterion_group!(benches, factor, columns, gram);
criterion_main!(benches);
