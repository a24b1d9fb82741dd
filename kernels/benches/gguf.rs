//! llama.cpp's GGUF quantizations on 1024×1024 f32 — the readable reference (`ops::gguf`, one
//! thread) and `cpu::quantize_gguf` (the k-quants' lane searches, the other types the
//! reference's code) on one thread and on every thread, and with importance weights
//! (`cpu::quantize_gguf_with`, every thread) — in bytes read + written per second,
//! beside a plain copy of the input's bytes measured in the same run (the memory ceiling).
//!
//! `cargo bench -p kiln-kernels --bench gguf`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kiln_kernels::cpu;
use kiln_kernels::ops::gguf::{GgufType, quantize};
use std::hint::black_box;
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let (rows, cols) = (1024, 1024);
    let n = rows * cols;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i as u64 * 2_654_435_761 % 10_007) as f32 / 5003.5 - 1.0) * 0.02)
        .collect();
    let bytes_in = (n * 4) as u64;
    // Importance weights shaped like an imatrix's (positive, spread over decades).
    let w: Vec<f32> = (0..cols)
        .map(|i| 10f32.powf(((i * 7919) % 1000) as f32 / 500.0 - 2.0))
        .collect();
    let mut g = c.benchmark_group("gguf_reference_1024x1024_f32");
    g.measurement_time(Duration::from_secs(3)).sample_size(10);
    let src: &[u8] = bytemuck::cast_slice(&x);
    let mut dst = vec![0u8; src.len()];
    g.throughput(Throughput::Bytes(bytes_in * 2));
    g.bench_function("copy", |b| b.iter(|| dst.copy_from_slice(black_box(src))));
    for ty in GgufType::ALL {
        let mut out = vec![0u8; ty.bytes_for(n)];
        g.throughput(Throughput::Bytes(bytes_in + out.len() as u64));
        if kiln_kernels::ops::gguf::needs_weights(ty) {
            // IQ2_XXS / IQ2_XS exist only with importance weights.
            g.bench_function(format!("{}/imatrix-all-threads", ty.name()), |b| {
                b.iter(|| {
                    cpu::quantize_gguf_with(ty, black_box(&x), cols, Some(&w), &mut out).unwrap()
                })
            });
            continue;
        }
        g.bench_function(format!("{}/reference", ty.name()), |b| {
            b.iter(|| quantize(ty, black_box(&x), cols, &mut out).unwrap())
        });
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        g.bench_function(format!("{}/cpu-one-thread", ty.name()), |b| {
            b.iter(|| {
                one.install(|| cpu::quantize_gguf(ty, black_box(&x), cols, &mut out).unwrap())
            })
        });
        g.bench_function(format!("{}/cpu-all-threads", ty.name()), |b| {
            b.iter(|| cpu::quantize_gguf(ty, black_box(&x), cols, &mut out).unwrap())
        });
        if kiln_kernels::ops::gguf::weighted(ty) {
            g.bench_function(format!("{}/imatrix-all-threads", ty.name()), |b| {
                b.iter(|| {
                    cpu::quantize_gguf_with(ty, black_box(&x), cols, Some(&w), &mut out).unwrap()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
