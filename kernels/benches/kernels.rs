//! Kernel throughput: every quantize op and amax on 4096×4096 and 8192×8192 bf16, on one
//! thread and on all threads, in bytes read + written per second — beside a plain copy of the
//! input's bytes measured in the same run (the memory ceiling).
//!
//! `cargo bench -p kiln-kernels` (`KILN_BENCH_SIZES=4096` to run one size); the group
//! `vocab_rows_1024x32000`: the output layer's passes over the vocabulary.

mod common;

use common::{sizes, weights};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kiln_kernels::cpu;
use kiln_kernels::ops::{fp8, int, nvfp4};
use rayon::ThreadPool;
use std::hint::black_box;
use std::time::Duration;

fn pools() -> Vec<(String, ThreadPool)> {
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut v = vec![(
        "1t".to_string(),
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap(),
    )];
    if all > 1 {
        v.push((
            format!("{all}t"),
            rayon::ThreadPoolBuilder::new()
                .num_threads(all)
                .build()
                .unwrap(),
        ));
    }
    v
}

fn bench(c: &mut Criterion) {
    for side in sizes(&[4096, 8192]) {
        let (rows, cols) = (side, side);
        let n = rows * cols;
        let w = weights(n);
        let bytes_in = (n * 2) as u64;
        let amax = cpu::amax(&w);
        let mut row_amax = vec![0f32; rows];
        cpu::amax_rows(&w, rows, cols, &mut row_amax).unwrap();
        let channel: Vec<f32> = row_amax.iter().map(|&a| fp8::fp8_scale(a)).collect();
        let int8: Vec<f32> = row_amax.iter().map(|&a| int::int8_scale(a)).collect();
        let mut g128 = vec![0f32; n / 128];
        cpu::amax_blocks(&w, rows, cols, 128, &mut g128).unwrap();
        let int4: Vec<f32> = g128.iter().map(|&a| int::int4_scale(a)).collect();
        let mut tiles = vec![0f32; rows.div_ceil(128) * cols.div_ceil(128)];
        cpu::amax_tiles(&w, rows, cols, 128, &mut tiles).unwrap();
        let mut tile_amax = tiles.clone();
        let tiles: Vec<f32> = tiles.iter().map(|&a| fp8::fp8_scale(a)).collect();
        let ws2 = nvfp4::nvfp4_global_scale(amax);

        let mut out = vec![0u8; n];
        let mut out_i8 = vec![0i8; n];
        let mut scales = vec![0u8; n / 16];
        let mut src_copy = vec![0u8; n * 2];
        let src: &[u8] = bytemuck::cast_slice(&w);

        let mut g = c.benchmark_group(format!("kernels_{side}x{side}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        for (threads, pool) in pools() {
            let id = |op: &str| BenchmarkId::new(op, &threads);
            g.throughput(Throughput::Bytes(bytes_in * 2));
            g.bench_function(id("copy"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        use rayon::prelude::*;
                        src_copy
                            .par_chunks_mut(1 << 17)
                            .zip(src.par_chunks(1 << 17))
                            .for_each(|(d, s)| d.copy_from_slice(s))
                    });
                    black_box(&src_copy);
                })
            });
            g.throughput(Throughput::Bytes(bytes_in));
            g.bench_function(id("amax"), |b| {
                b.iter(|| black_box(pool.install(|| cpu::amax(&w))))
            });
            g.bench_function(id("amax_tiles128"), |b| {
                b.iter(|| {
                    pool.install(|| cpu::amax_tiles(&w, rows, cols, 128, &mut tile_amax))
                        .unwrap()
                })
            });
            g.throughput(Throughput::Bytes(bytes_in + n as u64));
            g.bench_function(id("fp8_per_tensor"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        cpu::quantize_fp8_per_tensor(&w, fp8::fp8_scale(amax), &mut out)
                    })
                    .unwrap()
                })
            });
            g.bench_function(id("fp8_per_channel"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        cpu::quantize_fp8_per_channel(&w, rows, cols, &channel, &mut out)
                    })
                    .unwrap()
                })
            });
            g.bench_function(id("fp8_block128"), |b| {
                b.iter(|| {
                    pool.install(|| cpu::quantize_fp8_tiles(&w, rows, cols, 128, &tiles, &mut out))
                        .unwrap()
                })
            });
            g.bench_function(id("int8_per_channel"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        cpu::quantize_int8_per_channel(&w, rows, cols, &int8, &mut out_i8)
                    })
                    .unwrap()
                })
            });
            g.throughput(Throughput::Bytes(bytes_in + n as u64 / 2));
            g.bench_function(id("int4_g128"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        cpu::quantize_int4_groups(&w, rows, cols, 128, &int4, &mut out[..n / 2])
                    })
                    .unwrap()
                })
            });
            g.throughput(Throughput::Bytes(bytes_in + n as u64 / 2 + n as u64 / 16));
            g.bench_function(id("nvfp4"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        cpu::quantize_nvfp4(&w, &[rows, cols], ws2, &mut out[..n / 2], &mut scales)
                    })
                    .unwrap()
                })
            });
            g.throughput(Throughput::Bytes(bytes_in + n as u64 / 2 + n as u64 / 32));
            g.bench_function(id("mxfp4"), |b| {
                b.iter(|| {
                    pool.install(|| {
                        cpu::quantize_mxfp4(&w, cols, &mut out[..n / 2], &mut scales[..n / 32])
                    })
                    .unwrap()
                })
            });
            g.throughput(Throughput::Bytes(bytes_in + n as u64 + n as u64 / 32));
            g.bench_function(id("mxfp8"), |b| {
                b.iter(|| {
                    pool.install(|| cpu::quantize_mxfp8(&w, cols, &mut out, &mut scales[..n / 32]))
                        .unwrap()
                })
            });
        }
        g.finish();
    }
}

/// The passes over the vocabulary a training step's output layer runs per chunk of rows
/// (`ops::fused`: the log-softmax at the label with the row's log-sum-exp, the entropy TRL
/// logs, the log-softmax's backward), on 1024 rows of a 32000-entry vocabulary (f32 logits, the
/// 254M demo model's), all threads, in bytes of logits read (+ written, for the backward) per
/// second, beside a copy of the logits in the same run.
fn vocab_rows(c: &mut Criterion) {
    use kiln_kernels::ops::fused::{Rows, token_entropy, token_logps, token_logps_backward};
    let (rows, vocab) = (1024, 32000);
    let logits: Vec<f32> = weights(rows * vocab)
        .iter()
        .map(|w| w.to_f32() * 8.0)
        .collect();
    let r = Rows {
        rows,
        vocab,
        per_group: rows,
        group_stride: rows * vocab,
        start: 0,
    };
    let labels: Vec<u32> = (0..rows as u32).map(|i| i * 31 % vocab as u32).collect();
    let (mut out, mut lse, mut ent) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
    let g = vec![1f32 / rows as f32; rows];
    let mut d = vec![0f32; rows * vocab];
    let bytes = (rows * vocab * 4) as u64;
    let mut group = c.benchmark_group("vocab_rows_1024x32000");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("copy", |b| {
        b.iter(|| {
            use rayon::prelude::*;
            d.par_chunks_mut(vocab)
                .zip(logits.par_chunks(vocab))
                .for_each(|(d, s)| d.copy_from_slice(s));
            black_box(&d);
        })
    });
    group.bench_function("token_logps", |b| {
        b.iter(|| token_logps(&logits, &r, &labels, &mut out, &mut lse).unwrap())
    });
    group.bench_function("token_entropy", |b| {
        b.iter(|| token_entropy(&logits, &r, &mut ent).unwrap())
    });
    group.throughput(Throughput::Bytes(2 * bytes));
    group.bench_function("token_logps_backward", |b| {
        b.iter(|| token_logps_backward(&logits, &r, &labels, &lse, &g, &mut d).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench, vocab_rows);
criterion_main!(benches);
