//! GPU kernel throughput (feature `cuda`): amax and every quantizer on bf16 matrices that stay
//! on the GPU, in bytes read + written per second, beside a device-to-device copy of the
//! input measured in the same run (the memory ceiling; an H200's HBM3e is ~4.8 TB/s on paper).
//!
//! `cargo bench -p kiln-kernels --features cuda --bench cuda` (`KILN_BENCH_SIZES=8192` to run
//! one size). Without a GPU or CUDA libraries it prints why and measures nothing.

mod common;

use common::{sizes, weights};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use kiln_kernels::cuda::{CudaKernels, DeviceSlice};
use kiln_kernels::ops::{amax, int, nvfp4};
use std::time::{Duration, Instant};

/// Times `iters` queued launches of `op`, waiting once at the end: launch latency overlaps
/// the previous kernel, as in a real pipeline.
fn timed(gpu: &CudaKernels, iters: u64, mut op: impl FnMut()) -> Duration {
    gpu.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        op();
    }
    gpu.synchronize().unwrap();
    t.elapsed()
}

fn bench(c: &mut Criterion) {
    let gpu = match CudaKernels::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("cuda benchmarks skipped: {e}");
            return;
        }
    };
    println!("GPU: {}", gpu.device_name().unwrap_or_default());
    for side in sizes(&[4096, 8192, 16384]) {
        let (rows, cols) = (side, side);
        let n = rows * cols;
        let host = weights(n);
        let a = amax::amax(&host);
        let w = gpu.upload(&host).unwrap();
        let mut copy: DeviceSlice<bf16> = gpu.zeros(n).unwrap();
        let mut amax_out = gpu.zeros::<f32>(1).unwrap();
        let mut q8 = gpu.zeros::<u8>(n).unwrap();
        let mut q4 = gpu.zeros::<u8>(n / 2).unwrap();
        let mut s16 = gpu.zeros::<u8>(n / 16).unwrap();
        let mut s32 = gpu.zeros::<u8>(n / 32).unwrap();
        let int4_scales = gpu.upload(&vec![int::int4_scale(a); n / 128]).unwrap();
        let ws2 = nvfp4::nvfp4_global_scale(a);
        let s = kiln_kernels::ops::fp8::fp8_scale(a);
        let bytes_in = (n * 2) as u64;

        let mut g = c.benchmark_group(format!("cuda_{side}x{side}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1200));
        let mut run = |name: &str, out_bytes: u64, op: &mut dyn FnMut()| {
            g.throughput(Throughput::Bytes(bytes_in + out_bytes));
            g.bench_function(BenchmarkId::new(name, "bf16"), |b| {
                b.iter_custom(|iters| timed(&gpu, iters, &mut *op))
            });
        };
        run("copy", bytes_in, &mut || {
            gpu.copy_on_device(&w, &mut copy).unwrap()
        });
        run("amax", 0, &mut || {
            gpu.amax_on_device(&w, &mut amax_out).unwrap()
        });
        run("fp8_per_tensor", n as u64, &mut || {
            gpu.quantize_fp8_per_tensor_on_device(&w, s, &mut q8)
                .unwrap()
        });
        run("fp8_f32div", n as u64, &mut || {
            gpu.quantize_fp8_f32div_on_device(&w, s, &mut q8).unwrap()
        });
        run("nvfp4", (n / 2 + n / 16) as u64, &mut || {
            gpu.quantize_nvfp4_on_device(&w, &[rows, cols], ws2, &mut q4, &mut s16)
                .unwrap()
        });
        run("mxfp8", (n + n / 32) as u64, &mut || {
            gpu.quantize_mxfp8_on_device(&w, cols, &mut q8, &mut s32)
                .unwrap()
        });
        run("mxfp4", (n / 2 + n / 32) as u64, &mut || {
            gpu.quantize_mxfp4_on_device(&w, cols, &mut q4, &mut s32)
                .unwrap()
        });
        run("int4_g128", (n / 2 + n / 128 * 4) as u64, &mut || {
            gpu.quantize_int4_groups_on_device(&w, rows, cols, 128, &int4_scales, &mut q4)
                .unwrap()
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
