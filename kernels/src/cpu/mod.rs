//! Fast CPU paths. The instruction set is chosen once at run time (AVX-512F, else AVX2+F16C,
//! on x86-64 CPUs that have them, else the portable scalar path);
//! large tensors are split into fixed-size chunks over rayon, so the output is the same bytes
//! whatever the thread count. Every function here equals its `ops` reference bit for bit
//! (tests/simd_equals_reference.rs).
//!
//! `KILN_CPU=scalar` forces the portable path, `KILN_CPU=avx2` the AVX2 kernels on an AVX-512
//! machine (tests and benchmarks compare them).

pub mod alloc;
pub mod autocast;
pub mod bf16_matmul;
pub mod bits;
pub mod gemm;
mod iquants;
mod kquants;
#[cfg(target_arch = "x86_64")]
mod legacy;
pub mod portable;
#[cfg(target_arch = "x86_64")]
pub mod x86;
#[cfg(target_arch = "x86_64")]
pub mod x86_512;

use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::layout;
use crate::ops;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Elements per parallel task: a multiple of every block size (16, 32, 128).
const CHUNK: usize = 1 << 16;

/// The instruction set the fast paths use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// x86-64 AVX-512F (with AVX2 and F16C): 16-lane kernels for every operation.
    Avx512,
    /// x86-64 AVX2 with F16C.
    Avx2,
    /// Plain Rust on any CPU.
    Portable,
}

/// The instruction set chosen for this process.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let forced = std::env::var("KILN_CPU").unwrap_or_default();
        if forced == "scalar" {
            return Isa::Portable;
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            if forced != "avx2" && is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            return Isa::Avx2;
        }
        Isa::Portable
    })
}

fn amax_one<T: Element>(x: &[T]) -> f32 {
    match isa() {
        // SAFETY: `isa()` returned Avx512 only after detecting AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86_512::amax(x) },
        // SAFETY: `isa()` returned Avx2 (or Avx512, which implies AVX2) only after detecting AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::amax(x) },
        _ => portable::amax(x),
    }
}

fn fp8_one<T: Element, const ROUND: bool>(w: &[T], scale: f32, out: &mut [u8]) {
    match isa() {
        // SAFETY: as above; `out` and `w` have equal lengths (checked by the callers).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86_512::fp8_scaled::<T, ROUND>(w, scale, out) },
        // SAFETY: as above; `out` and `w` have equal lengths (checked by the callers).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::fp8_scaled::<T, ROUND>(w, scale, out) },
        _ => portable::fp8_scaled::<T, ROUND>(w, scale, out),
    }
}

fn nvfp4_one<T: Element>(w: &[T], ws2: f32, packed: &mut [u8], scales: &mut [u8]) {
    match isa() {
        // SAFETY: as above; whole blocks, buffers sized by the callers.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86_512::nvfp4(w, ws2, packed, scales) },
        // SAFETY: as above; whole blocks, buffers sized by the callers.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::nvfp4(w, ws2, packed, scales) },
        _ => portable::nvfp4(w, ws2, packed, scales),
    }
}

fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// `ops::amax::amax`, in parallel.
pub fn amax<T: Element>(x: &[T]) -> f32 {
    x.par_chunks(CHUNK).map(amax_one).reduce(|| 0.0, nan_max)
}

/// `ops::amax::amax_rows`, in parallel over rows.
pub fn amax_rows<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    layout::row_reduction("amax_rows", rows, cols, x.len(), out.len())?;
    if cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    x.par_chunks(cols)
        .zip(out.par_iter_mut())
        .for_each(|(r, o)| *o = amax_one(r));
    Ok(())
}

/// `ops::amax::amax_blocks`, in parallel.
pub fn amax_blocks<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    block: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    layout::block_reduction("amax_blocks", rows, cols, block, x.len(), out.len())?;
    x.par_chunks(block)
        .zip(out.par_iter_mut())
        .with_min_len(CHUNK / block.max(1))
        .for_each(|(b, o)| *o = amax_one(b));
    Ok(())
}

/// `ops::amax::amax_tiles`, in parallel over bands of `tile` rows.
pub fn amax_tiles<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    tile: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if tile == 0 || cols == 0 || rows == 0 {
        // The reference names every bad shape and handles the empty ones.
        return crate::ops::amax::amax_tiles(x, rows, cols, tile, out);
    }
    let (tr, tc) = (rows.div_ceil(tile), cols.div_ceil(tile));
    crate::error::check_len("amax_tiles", "input", x.len(), rows * cols, &[rows, cols])?;
    crate::error::check_len("amax_tiles", "output", out.len(), tr * tc, &[tr, tc])?;
    x.par_chunks(tile * cols)
        .zip(out.par_chunks_mut(tc))
        .for_each(|(band, o)| {
            o.fill(0.0);
            for row in band.chunks(cols) {
                for (t, part) in row.chunks(tile).enumerate() {
                    o[t] = nan_max(o[t], amax_one(part));
                }
            }
        });
    Ok(())
}

/// `ops::fp8::quantize_fp8_per_tensor`, fast and parallel.
pub fn quantize_fp8_per_tensor<T: Element>(
    w: &[T],
    scale: f32,
    out: &mut [u8],
) -> Result<(), KernelError> {
    check_len(
        "quantize_fp8_per_tensor",
        "output",
        out.len(),
        w.len(),
        &[w.len()],
    )?;
    w.par_chunks(CHUNK)
        .zip(out.par_chunks_mut(CHUNK))
        .for_each(|(w, o)| fp8_one::<T, true>(w, scale, o));
    Ok(())
}

/// `ops::fp8::quantize_fp8_stacked`, fast and parallel.
pub fn quantize_fp8_stacked<T: Element>(
    w: &[T],
    shape: &[usize],
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let per = layout::stacked(
        "quantize_fp8_stacked",
        shape,
        w.len(),
        scales.len(),
        out.len(),
    )?
    .max(1);
    w.par_chunks(per)
        .zip(out.par_chunks_mut(per))
        .zip(scales.par_iter())
        .for_each(|((w, o), &s)| {
            w.par_chunks(CHUNK)
                .zip(o.par_chunks_mut(CHUNK))
                .for_each(|(w, o)| fp8_one::<T, false>(w, s, o))
        });
    Ok(())
}

/// `ops::fp8::quantize_fp8_per_channel`, fast and parallel over rows.
pub fn quantize_fp8_per_channel<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    layout::per_row(
        "quantize_fp8_per_channel",
        rows,
        cols,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    if cols > 0 {
        w.par_chunks(cols)
            .zip(out.par_chunks_mut(cols))
            .zip(scales.par_iter())
            .for_each(|((w, o), &s)| fp8_one::<T, false>(w, s, o));
    }
    Ok(())
}

/// `ops::fp8::quantize_fp8_tiles`, fast and parallel over rows.
pub fn quantize_fp8_tiles<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    tile: usize,
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let tc = layout::tiles(
        "quantize_fp8_tiles",
        rows,
        cols,
        tile,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    if cols > 0 {
        w.par_chunks(cols)
            .zip(out.par_chunks_mut(cols))
            .enumerate()
            .for_each(|(r, (w, o))| {
                for (t, (w, o)) in w.chunks(tile).zip(o.chunks_mut(tile)).enumerate() {
                    fp8_one::<T, false>(w, scales[(r / tile) * tc + t], o);
                }
            });
    }
    Ok(())
}

/// `ops::nvfp4::quantize_nvfp4`, fast and parallel.
pub fn quantize_nvfp4<T: Element>(
    w: &[T],
    shape: &[usize],
    ws2: f32,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    layout::blocks(
        "quantize_nvfp4",
        shape,
        16,
        w.len(),
        packed.len(),
        8,
        scales.len(),
    )?;
    w.par_chunks(CHUNK)
        .zip(packed.par_chunks_mut(CHUNK / 2))
        .zip(scales.par_chunks_mut(CHUNK / 16))
        .for_each(|((w, p), s)| nvfp4_one(w, ws2, p, s));
    Ok(())
}

/// `ops::mx::quantize_mxfp8`, fast and parallel.
pub fn quantize_mxfp8<T: Element>(
    w: &[T],
    cols: usize,
    q: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    layout::mx_blocks("quantize_mxfp8", w.len(), cols, q.len(), 32, scales.len())?;
    w.par_chunks(CHUNK)
        .zip(q.par_chunks_mut(CHUNK))
        .zip(scales.par_chunks_mut(CHUNK / 32))
        .for_each(|((w, q), s)| {
            match isa() {
                // SAFETY: features detected by `isa()`; whole blocks, buffers sized above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { x86_512::mxfp8(w, q, s) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { x86::mxfp8(w, q, s) },
                _ => portable::mxfp8(w, q, s),
            }
        });
    Ok(())
}

/// `ops::mx::quantize_mxfp4`, parallel over chunks of whole blocks (the reference per chunk).
pub fn quantize_mxfp4<T: Element>(
    w: &[T],
    cols: usize,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    layout::mx_blocks(
        "quantize_mxfp4",
        w.len(),
        cols,
        packed.len(),
        16,
        scales.len(),
    )?;
    w.par_chunks(CHUNK)
        .zip(packed.par_chunks_mut(CHUNK / 2))
        .zip(scales.par_chunks_mut(CHUNK / 32))
        .try_for_each(|((w, p), s)| match isa() {
            // SAFETY: features detected by `isa()`; whole blocks, buffers sized above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                unsafe { x86_512::mxfp4(w, p, s) };
                Ok(())
            }
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                unsafe { x86::mxfp4(w, p, s) };
                Ok(())
            }
            _ => ops::mx::quantize_mxfp4(w, 32, p, s),
        })
}

/// `ops::int::quantize_int8_per_channel`, parallel over rows.
pub fn quantize_int8_per_channel<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    scales: &[f32],
    out: &mut [i8],
) -> Result<(), KernelError> {
    layout::per_row(
        "quantize_int8_per_channel",
        rows,
        cols,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    if cols == 0 {
        return Ok(());
    }
    w.par_chunks(cols)
        .zip(out.par_chunks_mut(cols))
        .zip(scales.par_iter())
        .try_for_each(|((w, o), s)| match isa() {
            // SAFETY: features detected by `isa()`; equal lengths.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                unsafe { x86_512::int8_row(w, *s, o) };
                Ok(())
            }
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                unsafe { x86::int8_row(w, *s, o) };
                Ok(())
            }
            _ => ops::int::quantize_int8_per_channel(w, 1, cols, std::slice::from_ref(s), o),
        })
}

/// `ops::int::quantize_int4_groups`, parallel over row pairs.
pub fn quantize_int4_groups<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    group: usize,
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let groups = layout::int4_groups(
        "quantize_int4_groups",
        rows,
        cols,
        group,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    if cols == 0 {
        return Ok(());
    }
    w.par_chunks(2 * cols)
        .zip(out.par_chunks_mut(cols))
        .zip(scales.par_chunks(2 * groups))
        .try_for_each(|((w, o), s)| match isa() {
            // SAFETY: features detected by `isa()`; a row pair, its scales and output row.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                unsafe { x86_512::int4_row_pair(w, group, s, o) };
                Ok(())
            }
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                unsafe { x86::int4_row_pair(w, group, s, o) };
                Ok(())
            }
            _ => ops::int::quantize_int4_groups(w, 2, cols, group, s, o),
        })
}

/// llama.cpp's GGUF quantization with importance weights ([`ops::gguf::quantize_with`]): whole
/// rows spread over rayon's threads (the legacy types' weights depend on the whole row); the
/// legacy types (Q4_0 … Q5_1), the k-quants (Q2_K … Q6_K), IQ4_NL and IQ4_XS search eight
/// blocks or sub-blocks at once in vector lanes (`kquants`), the i-quants search eight lattice
/// neighbours and fit eight candidate scales at once (`iquants`). `None` is [`quantize_gguf`]. The bytes equal the single-threaded
/// reference's.
pub fn quantize_gguf_with(
    ty: ops::gguf::GgufType,
    x: &[f32],
    cols: usize,
    imatrix: Option<&[f32]>,
    out: &mut [u8],
) -> Result<(), KernelError> {
    let Some(qw) = imatrix.filter(|_| ops::gguf::weighted(ty)) else {
        return quantize_gguf(ty, x, cols, out);
    };
    ops::gguf::check_layout(ty, x.len(), cols, out.len())?;
    let rows = (CHUNK / 4 / cols.max(1)).max(1);
    use ops::gguf::GgufType as T;
    let lanes = matches!(
        ty,
        T::Q4_0
            | T::Q4_1
            | T::Q5_0
            | T::Q5_1
            | T::Q2K
            | T::Q3K
            | T::Q4K
            | T::Q5K
            | T::Q6K
            | T::Iq4Nl
            | T::Iq4Xs
            | T::Iq2Xxs
            | T::Iq2Xs
            | T::Iq2S
            | T::Iq3Xxs
            | T::Iq3S
    ) && qw.len() == cols;
    x.par_chunks(rows * cols)
        .zip(out.par_chunks_mut(rows * ty.bytes_for(cols)))
        .try_for_each(|(x, o)| {
            if !lanes {
                return ops::gguf::quantize_with(ty, x, cols, Some(qw), o);
            }
            match isa() {
                // SAFETY: `isa()` returned Avx512 or Avx2 only after detecting AVX2 and F16C.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx2 => unsafe { x86::quantize_gguf_with(ty, x, cols, qw, o) },
                _ => portable::quantize_gguf_with(ty, x, cols, qw, o),
            }
        })
}

/// llama.cpp's GGUF quantization of rows of `cols` ([`ops::gguf::quantize`]), blocks spread
/// over rayon's threads. The k-quants (Q2_K, Q4_K, Q5_K, Q6_K), IQ4_NL and IQ4_XS search eight
/// sub-blocks at once in vector lanes (`kquants`), each lane in the reference's operation
/// order; Q3_K speculates each sub-block's refinement pass in lanes; IQ2_S, IQ3_XXS and IQ3_S
/// search eight lattice neighbours and fit eight candidate scales at once (`iquants`); the other types run the reference's own code per block. Either
/// way the bytes equal the single-threaded reference's.
pub fn quantize_gguf(
    ty: ops::gguf::GgufType,
    x: &[f32],
    cols: usize,
    out: &mut [u8],
) -> Result<(), KernelError> {
    ops::gguf::check_layout(ty, x.len(), cols, out.len())?;
    let block = ty.block_elems();
    // About 64 KiB of input per task.
    let blocks = (CHUNK / 4 / block).max(1);
    x.par_chunks(blocks * block)
        .zip(out.par_chunks_mut(blocks * ty.block_bytes()))
        .try_for_each(|(x, o)| {
            match isa() {
                // SAFETY: `isa()` returned Avx512 or Avx2 only after detecting AVX2 and F16C
                // (the k-quant lanes are eight wide: AVX-512 runs the AVX2 search).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx2 => unsafe { x86::quantize_gguf(ty, x, o) },
                _ => portable::quantize_gguf(ty, x, o),
            }
        })
}
