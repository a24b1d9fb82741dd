//! CUDA kernels (feature `cuda`). Both tests need something this machine may lack, so they are
//! `#[ignore]`d by default — reported as ignored, never as passing:
//! - `nvrtc_compiles_every_kernel_to_ptx` needs NVRTC only (CI installs PyPI's
//!   `nvidia-cuda-nvrtc-cu12` and runs it with `--ignored`);
//! - `gpu_kernels_equal_the_cpu_reference` needs an NVIDIA GPU.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::cuda::{self, CudaKernels};
use kiln_kernels::ops::{amax, fp8, int, mx, nvfp4};

#[test]
#[ignore = "needs NVRTC (libnvrtc on LD_LIBRARY_PATH): cargo test --features cuda -- --ignored nvrtc"]
fn nvrtc_compiles_every_kernel_to_ptx() {
    for arch in ["sm_80", "sm_90a"] {
        let ptx = cuda::compile_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let text = ptx.to_src();
        for entry in cuda::ENTRY_POINTS {
            for suffix in ["bf16", "f16", "f32"] {
                let name = format!(".entry {entry}_{suffix}(");
                assert!(text.contains(&name), "{arch}: PTX lacks {name}");
            }
        }
        // The quantizers read 16 bytes per load and write 8 or 16 per store: memory speed
        // depends on it, and a misaligned cast would silently fall back to byte accesses.
        if arch == "sm_90a" {
            assert!(
                text.contains("cvt.rn.satfinite.e4m3x2.f32"),
                "{arch}: no hardware FP8"
            );
        }
        for op in ["ld.global.v4.u32", "st.global.u64", "st.global.v4.u32"] {
            assert!(text.contains(op), "{arch}: PTX has no {op}");
        }
        // Machine code too: NVRTC runs ptxas, which checks the inline PTX (the hardware FP8
        // conversion on sm_89+) that PTX text alone leaves to the driver.
        let cubin = cuda::compile_cubin(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{arch}: CUBIN is not an ELF image"
        );
    }
}

/// Adversarial and ordinary values: ±0, ±Inf, NaN (only where `nan`), subnormals of the
/// element type, exact E2M1/E4M3 ties, a huge outlier, and whole zero rows (zero blocks).
fn values(n: usize, cols: usize, nan: bool, subnormal: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if (i / cols) % 7 == 3 {
                return 0.0;
            }
            match i % 97 {
                0 => 6.0,
                1 => -0.25,
                2 => 464.0,
                3 if nan && i % 3 == 0 => f32::NAN,
                4 => subnormal,
                5 => -subnormal,
                6 if i % 5 == 0 => f32::INFINITY,
                7 if i % 11 == 0 => -f32::INFINITY,
                8 => -0.0,
                9 if i % 13 == 0 => 3.0e4,
                10 => 2.5,
                11 => -0.75,
                _ => (((i * 7919) % 2003) as f32 / 97.0 - 10.0) * 0.03,
            }
        })
        .collect()
}

/// Every GPU kernel against the CPU reference, bit for bit, for one element type and shape.
fn check<T: Element + std::fmt::Debug>(
    gpu: &CudaKernels,
    make: fn(f32) -> T,
    subnormal: f32,
    rows: usize,
    cols: usize,
) {
    let n = rows * cols;
    let what = format!("{} {rows}x{cols}", std::any::type_name::<T>());
    let w: Vec<T> = values(n, cols, true, subnormal)
        .into_iter()
        .map(make)
        .collect();
    let finite: Vec<T> = values(n, cols, false, subnormal)
        .into_iter()
        .map(|x| make(if x.is_infinite() { 0.5 } else { x }))
        .collect();

    assert!(gpu.amax(&w).unwrap().is_nan(), "{what}: amax with NaN");
    assert_eq!(
        gpu.amax(&finite).unwrap().to_bits(),
        amax::amax(&finite).to_bits(),
        "{what}: amax"
    );

    // FP8 per tensor on the whole tensor and on a slice whose length leaves a tail.
    // With half the scale, the largest quotients pass 464: FP8 is non-saturating (NaN) there,
    // where the GPU's hardware conversion would saturate.
    let s0 = fp8::fp8_scale(amax::amax(&finite));
    for (len, s) in [(n, s0), (n - 5, s0), (n, s0 * 0.5)] {
        let x = &w[..len];
        let (mut want, mut got) = (vec![0u8; len], vec![0u8; len]);
        fp8::quantize_fp8_per_tensor(x, s, &mut want).unwrap();
        gpu.quantize_fp8_per_tensor(x, s, &mut got).unwrap();
        assert_eq!(want, got, "{what}: fp8 per tensor, {len} elements");
        fp8::quantize_fp8_stacked(x, &[1, 1, len], &[s], &mut want).unwrap();
        gpu.quantize_fp8_f32div(x, s, &mut got).unwrap();
        assert_eq!(want, got, "{what}: fp8 f32 division, {len} elements");
    }

    for input in [&w, &finite] {
        let ws2 = nvfp4::nvfp4_global_scale(amax::amax(input));
        let (mut pa, mut sa, mut pb, mut sb) = (
            vec![0u8; n / 2],
            vec![0u8; n / 16],
            vec![0u8; n / 2],
            vec![0u8; n / 16],
        );
        nvfp4::quantize_nvfp4(input, &[rows, cols], ws2, &mut pa, &mut sa).unwrap();
        gpu.quantize_nvfp4(input, &[rows, cols], ws2, &mut pb, &mut sb)
            .unwrap();
        assert_eq!((sa, pa), (sb, pb), "{what}: nvfp4");

        let (mut qa, mut sa, mut qb, mut sb) = (
            vec![0u8; n],
            vec![0u8; n / 32],
            vec![0u8; n],
            vec![0u8; n / 32],
        );
        mx::quantize_mxfp8(input, cols, &mut qa, &mut sa).unwrap();
        gpu.quantize_mxfp8(input, cols, &mut qb, &mut sb).unwrap();
        assert_eq!((&sa, &qa), (&sb, &qb), "{what}: mxfp8");
        let (mut pa, mut pb) = (vec![0u8; n / 2], vec![0u8; n / 2]);
        mx::quantize_mxfp4(input, cols, &mut pa, &mut sa).unwrap();
        gpu.quantize_mxfp4(input, cols, &mut pb, &mut sb).unwrap();
        assert_eq!((&sa, &pa), (&sb, &pb), "{what}: mxfp4");
    }

    // INT4 with G = 128 (the vector kernel) and with a column count that is not a multiple
    // of 8 (the per-byte kernel).
    for (c, g) in [(cols, 128), (cols - 4, 4)] {
        let r = rows;
        let x: Vec<T> = (0..r)
            .flat_map(|i| w[i * cols..i * cols + c].iter().copied())
            .collect();
        let scales: Vec<f32> = (0..r * c / g)
            .map(|i| 0.01 + (i % 5) as f32 * 0.02)
            .collect();
        let (mut pa, mut pb) = (vec![0u8; r * c / 2], vec![0u8; r * c / 2]);
        int::quantize_int4_groups(&x, r, c, g, &scales, &mut pa).unwrap();
        gpu.quantize_int4_groups(&x, r, c, g, &scales, &mut pb)
            .unwrap();
        assert_eq!(pa, pb, "{what}: int4, {c} columns, G = {g}");
    }
    println!("{what}: every kernel equals the CPU reference");
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p kiln-kernels --features cuda -- --ignored gpu"]
fn gpu_kernels_equal_the_cpu_reference() {
    let gpu = CudaKernels::new(0).expect("CUDA device 0");
    println!("GPU: {}", gpu.device_name().unwrap());
    for (rows, cols) in [(64, 512), (6, 4096), (130, 1152)] {
        check(&gpu, bf16::from_f32, 1e-39, rows, cols);
        check(&gpu, f16::from_f32, 3e-6, rows, cols);
        check(&gpu, |x| x, 1e-40, rows, cols);
    }
    // A tensor large enough that amax's blocks loop (grid-stride) and many blocks race on the
    // atomic maximum.
    let big: Vec<bf16> = (0..4096 * 4096)
        .map(|i: usize| {
            bf16::from_f32(((i.wrapping_mul(2654435761) % 10007) as f32 - 5003.0) * 1e-3)
        })
        .collect();
    assert_eq!(gpu.amax(&big).unwrap(), amax::amax(&big), "amax 4096x4096");
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p kiln-kernels --features cuda -- --ignored gpu"]
fn gpu_shape_errors_are_named() {
    let gpu = CudaKernels::new(0).expect("CUDA device 0");
    let w = vec![bf16::ZERO; 48];
    let (mut p, mut s) = (vec![0u8; 24], vec![0u8; 3]);
    let e = gpu
        .quantize_nvfp4(&w, &[2, 24], 1.0, &mut p, &mut s)
        .unwrap_err()
        .to_string();
    assert!(e.contains("quantize_nvfp4"), "{e}");
    let mut q = vec![0u8; 47];
    let e = gpu
        .quantize_fp8_per_tensor(&w, 1.0, &mut q)
        .unwrap_err()
        .to_string();
    assert!(e.contains("quantize_fp8"), "{e}");
}

#[test]
fn a_missing_gpu_or_library_is_a_named_error_not_a_panic() {
    // Runs everywhere: on a GPU machine this opens device 0; elsewhere it must say why not.
    match CudaKernels::new(0) {
        Ok(gpu) => gpu.synchronize().unwrap(),
        Err(e) => {
            let text = e.to_string();
            assert!(text.starts_with("cuda is not available: "), "{text}");
            println!("no CUDA here (expected off-GPU): {text}");
        }
    }
}
