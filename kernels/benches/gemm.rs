//! The bf16 dot-product kernel (`cpu::bf16_matmul`, AVX-512 BF16) and the packed GEMM's bf16
//! arithmetic (`cpu::gemm`, what a frozen bf16 Linear runs) beside the f32 GEMM
//! (`ops::packed_matmul::matmul_wt` on the widened weight: the packed f32 GEMM on AVX-512,
//! candle's `gemm` elsewhere), on a 1B Llama's Linear
//! shapes and a calibration sample's rows (64) or eight samples' (512), all threads, in
//! floating-point operations per second (criterion's "elem/s": 2·m·n·k per product).
//!
//! `cargo bench -p kiln-kernels --bench gemm` (prints a reason and measures only f32 where the
//! CPU has no AVX-512 BF16).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kiln_kernels::cpu::bf16_matmul;
use kiln_kernels::cpu::gemm::{self, Mat};
use kiln_kernels::ops::packed_matmul::{DenseRows, matmul_wt};
use std::hint::black_box;
use std::time::Duration;

fn values(n: usize, seed: u64, scale: f32) -> Vec<u16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let x = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            half::bf16::from_f32(x * scale).to_bits()
        })
        .collect()
}

fn widen(b: &[u16]) -> Vec<f32> {
    b.iter()
        .map(|&v| f32::from_bits(u32::from(v) << 16))
        .collect()
}

fn bench(c: &mut Criterion) {
    let native = bf16_matmul::available();
    if !native {
        println!("no AVX-512 BF16 on this CPU (or KILN_CPU narrows it): only the f32 GEMM runs");
    }
    let mut g = c.benchmark_group("gemm_x_wt");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    for (name, n, k) in [
        ("q_proj", 2048, 2048),
        ("gate_proj", 8192, 2048),
        ("down_proj", 2048, 8192),
    ] {
        let w = values(n * k, 1, 0.05);
        let wf = DenseRows::new(widen(&w), n, k).unwrap();
        for m in [64usize, 512] {
            let x = values(m * k, 2, 2.0);
            let xf = widen(&x);
            let mut y = vec![0f32; m * n];
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            let id = format!("{name}_{n}x{k}_m{m}");
            g.bench_function(BenchmarkId::new("f32_gemm", &id), |b| {
                b.iter(|| matmul_wt(black_box(&xf), m, &wf, &mut y).unwrap())
            });
            if native {
                g.bench_function(BenchmarkId::new("bf16_avx512", &id), |b| {
                    b.iter(|| bf16_matmul::matmul_wt(black_box(&x), &w, &mut y, (m, n, k)).unwrap())
                });
                // The packed GEMM's bf16 arithmetic on the same (bf16-valued) operands: `x`
                // read in rows, `Wᵀ` packed by register transposes.
                let wt = widen(&w);
                g.bench_function(BenchmarkId::new("packed_bf16", &id), |b| {
                    b.iter(|| {
                        gemm::matmul_bf16_rounded(
                            Mat::row_major(black_box(&xf), m, k),
                            Mat::row_major(&wt, n, k).t(),
                            &mut y,
                        )
                        .unwrap()
                    })
                });
            }
        }
    }
    g.finish();
}

/// A trained Linear's three products under autocast (`cpu::autocast`: TRL's `bf16=True`) on
/// the 254M demo model's MLP shapes for a batch of 8 × 128 tokens, beside the f32 ones
/// (`ops::packed_matmul::dense`), and the packed GEMM (`cpu::gemm`) called directly in both
/// arithmetics. On AVX-512 `dense` and `autocast` run on the packed GEMM themselves;
/// `KILN_CPU=avx2` measures their other paths (the `gemm` crate, candle's; autocast's bf16
/// values through it).
fn autocast(c: &mut Criterion) {
    use kiln_kernels::cpu::autocast;
    use kiln_kernels::ops::packed_matmul::dense;
    println!("autocast path: {:?}", autocast::path());
    let mut g = c.benchmark_group("linear_products_254m");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    let m = 1024;
    for (k, n) in [(1024usize, 4096usize), (4096, 1024)] {
        let x = widen(&values(m * k, 3, 2.0));
        let w = widen(&values(n * k, 4, 0.05));
        let dy = widen(&values(m * n, 5, 1e-3));
        let (mut y, mut dx, mut dw) = (vec![0f32; m * n], vec![0f32; m * k], vec![0f32; n * k]);
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        let id = format!("{k}x{n}");
        let d = (m, n, k);
        if k == 1024 {
            g.throughput(Throughput::Bytes((m * n * 6) as u64));
            g.bench_function(BenchmarkId::new("round_to_bf16", &id), |b| {
                b.iter(|| autocast::bits(black_box(&dy)))
            });
            g.bench_function(BenchmarkId::new("round_and_transpose", &id), |b| {
                b.iter(|| autocast::bits_t(black_box(&dy), m, n))
            });
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        }
        g.bench_function(BenchmarkId::new("f32_forward", &id), |b| {
            b.iter(|| dense::forward(black_box(&x), &w, d, &mut y).unwrap())
        });
        g.bench_function(BenchmarkId::new("bf16_forward", &id), |b| {
            b.iter(|| autocast::forward(black_box(&x), &w, d, &mut y).unwrap())
        });
        g.bench_function(BenchmarkId::new("f32_input_grad", &id), |b| {
            b.iter(|| dense::input_grad(black_box(&dy), &w, d, &mut dx).unwrap())
        });
        g.bench_function(BenchmarkId::new("bf16_input_grad", &id), |b| {
            b.iter(|| autocast::input_grad(black_box(&dy), &w, d, &mut dx).unwrap())
        });
        g.bench_function(BenchmarkId::new("f32_weight_grad", &id), |b| {
            b.iter(|| dense::weight_grad(black_box(&x), &dy, d, &mut dw).unwrap())
        });
        g.bench_function(BenchmarkId::new("bf16_weight_grad", &id), |b| {
            b.iter(|| autocast::weight_grad(black_box(&x), &dy, d, &mut dw).unwrap())
        });
        // The packed GEMM (`cpu::gemm`) on the same three products, each operand read in its
        // own layout: forward x · Wᵀ, input gradient dy · W, weight gradient dyᵀ · x.
        if gemm::available() {
            let (xm, wm, dym) = (
                Mat::row_major(&x, m, k),
                Mat::row_major(&w, n, k),
                Mat::row_major(&dy, m, n),
            );
            let products: [(&str, Mat, Mat); 3] = [
                ("forward", xm, wm.t()),
                ("input_grad", dym, wm),
                ("weight_grad", dym.t(), xm),
            ];
            for (what, a, bm) in products {
                let mut out = vec![0f32; a.rows * bm.cols];
                g.bench_function(BenchmarkId::new(format!("packed_f32_{what}"), &id), |b| {
                    b.iter(|| gemm::matmul(black_box(a), bm, &mut out).unwrap())
                });
                if gemm::bf16_available() {
                    g.bench_function(BenchmarkId::new(format!("packed_bf16_{what}"), &id), |b| {
                        b.iter(|| gemm::matmul_bf16_rounded(black_box(a), bm, &mut out).unwrap())
                    });
                }
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench, autocast);
criterion_main!(benches);
