//! MLX as a kernel backend (feature `mlx`): MLX's own quantize operation
//! (`mlx_sys::mlx_quantize`, which takes the mode mlx-rs hard-codes to `affine`) on MLX's CPU
//! device or its Metal GPU. This is the Metal path of kiln's kernels ([`crate::metal`]); on
//! Linux the same calls run on MLX's CPU device, where they are tested bit for bit against the
//! readable reference [`crate::ops::mlx`].
//!
//! MLX rounds some of its modes differently from the ModelOpt formats of the same name
//! (docs/MLX.md "Quantization on MLX"): these functions produce MLX's layouts, never a
//! substitute for kiln's ModelOpt kernels.

use crate::element::Element;
use crate::error::KernelError;
use crate::ops::mlx::{Affine, FpMode, affine_words};
use half::{bf16, f16};
use mlx_rs::{Array, Dtype, Stream};

mod checkpoint;
pub use checkpoint::{ArrayFn, checkpoint, checkpoint_calls};

/// Where MLX runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlxDevice {
    /// MLX's CPU device (every platform).
    Cpu,
    /// MLX's Metal GPU (Apple silicon).
    Gpu,
}

/// MLX's quantization operations on one device.
pub struct MlxKernels {
    device: MlxDevice,
}

fn failed(op: &'static str, reason: String) -> KernelError {
    KernelError::DeviceUnavailable {
        device: "mlx",
        reason: format!("{op}: {reason}"),
    }
}

/// Whether MLX sees a Metal GPU.
pub fn metal_available() -> bool {
    let mut available = false;
    // SAFETY: `mlx_metal_is_available` writes one bool through the pointer, which is valid
    // for the call.
    let status = unsafe { mlx_sys::mlx_metal_is_available(&mut available) };
    status == 0 && available
}

/// The weight as an MLX array of its own dtype (MLX copies the data).
fn to_array<T: Element>(w: &[T], rows: usize, cols: usize) -> Result<Array, KernelError> {
    let shape = [
        i32::try_from(rows).map_err(|_| failed("mlx", format!("{rows} rows is too many")))?,
        i32::try_from(cols).map_err(|_| failed("mlx", format!("{cols} columns is too many")))?,
    ];
    Ok(match T::DTYPE {
        "F32" => Array::from_slice(bytemuck::cast_slice::<T, f32>(w), &shape),
        "BF16" => Array::from_slice(bytemuck::cast_slice::<T, bf16>(w), &shape),
        _ => Array::from_slice(bytemuck::cast_slice::<T, f16>(w), &shape),
    })
}

/// An MLX array's elements as `T` (its dtype must be `T`'s).
fn elements<T: Element>(a: &Array) -> Result<Vec<T>, KernelError> {
    if a.dtype() != dtype_of::<T>() {
        return Err(failed(
            "mlx",
            format!("expected {}, got {:?}", T::DTYPE, a.dtype()),
        ));
    }
    let bytes: &[u8] = match a.dtype() {
        Dtype::Float32 => bytemuck::cast_slice(a.try_as_slice::<f32>().map_err(as_err)?),
        Dtype::Bfloat16 => bytemuck::cast_slice(a.try_as_slice::<bf16>().map_err(as_err)?),
        Dtype::Float16 => bytemuck::cast_slice(a.try_as_slice::<f16>().map_err(as_err)?),
        other => return Err(failed("mlx", format!("unexpected dtype {other:?}"))),
    };
    Ok(bytemuck::pod_collect_to_vec(bytes))
}

fn dtype_of<T: Element>() -> Dtype {
    match T::DTYPE {
        "F32" => Dtype::Float32,
        "BF16" => Dtype::Bfloat16,
        _ => Dtype::Float16,
    }
}

fn as_err(e: impl std::fmt::Display) -> KernelError {
    failed("mlx", e.to_string())
}

impl MlxKernels {
    /// MLX on its CPU device.
    pub fn cpu() -> Result<Self, KernelError> {
        Ok(MlxKernels {
            device: MlxDevice::Cpu,
        })
    }

    /// MLX on its Metal GPU; an error where MLX sees none.
    pub fn gpu() -> Result<Self, KernelError> {
        if metal_available() {
            Ok(MlxKernels {
                device: MlxDevice::Gpu,
            })
        } else {
            Err(KernelError::DeviceUnavailable {
                device: "metal",
                reason: "MLX sees no Metal GPU on this machine (MLX's CPU device runs the same \
                         operations: MlxKernels::cpu)"
                    .into(),
            })
        }
    }

    /// The device these kernels run on.
    pub fn device(&self) -> MlxDevice {
        self.device
    }

    fn stream(&self) -> Stream {
        match self.device {
            MlxDevice::Cpu => Stream::cpu(),
            MlxDevice::Gpu => Stream::gpu(),
        }
    }

    /// `mlx.core.quantize(w, group_size, bits, mode, global_scale)` on rows of `cols`.
    fn quantize(
        &self,
        op: &'static str,
        w: Array,
        group: usize,
        bits: usize,
        mode: &std::ffi::CStr,
        global_amax: Option<f32>,
    ) -> Result<Vec<Array>, KernelError> {
        // Evaluating through mlx-rs first also installs its error handler, so an MLX failure
        // below returns a status instead of ending the process.
        w.eval().map_err(as_err)?;
        let global = match global_amax {
            Some(a) => Array::from_f32(a),
            // SAFETY: an empty array handle, what mlx-c takes for "no global scale".
            None => unsafe { Array::from_ptr(mlx_sys::mlx_array_new()) },
        };
        let opt = |v: usize| mlx_sys::mlx_optional_int {
            value: v as i32,
            has_value: true,
        };
        let stream = self.stream();
        // SAFETY: a fresh vector, freed below after its arrays are copied out.
        let mut out = unsafe { mlx_sys::mlx_vector_array_new() };
        // SAFETY: every handle is live for the call (`w`, `global`, `stream` are owned here);
        // `mode` is a NUL-terminated string; `out` is a valid vector for the results.
        let status = unsafe {
            mlx_sys::mlx_quantize(
                &mut out,
                w.as_ptr(),
                opt(group),
                opt(bits),
                mode.as_ptr(),
                global.as_ptr(),
                stream.as_ptr(),
            )
        };
        let mut arrays = Vec::new();
        if status == 0 {
            // SAFETY: `out` holds the results; each `get` writes a new reference into a fresh
            // handle that `Array::from_ptr` takes ownership of.
            let n = unsafe { mlx_sys::mlx_vector_array_size(out) };
            for i in 0..n {
                let mut a = unsafe { mlx_sys::mlx_array_new() };
                let got = unsafe { mlx_sys::mlx_vector_array_get(&mut a, out, i) };
                let a = unsafe { Array::from_ptr(a) };
                if got != 0 {
                    break;
                }
                arrays.push(a);
            }
        }
        // SAFETY: `out` was created above and is not used after this.
        unsafe { mlx_sys::mlx_vector_array_free(out) };
        if status != 0 {
            return Err(failed(op, format!("MLX refused quantize(mode={mode:?})")));
        }
        for a in &arrays {
            a.eval().map_err(as_err)?;
        }
        Ok(arrays)
    }

    /// One of MLX's FP modes (`mxfp4`, `mxfp8`, `nvfp4` with an optional global amax) over
    /// rows of `cols`: the packed codes (bytes, element 0 in the low bits) and one scale byte
    /// per group, as [`crate::ops::mlx::quantize_fp`] lays them out.
    pub fn quantize_fp<T: Element>(
        &self,
        mode: FpMode,
        w: &[T],
        cols: usize,
        global_amax: Option<f32>,
    ) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        let op = "quantize_fp (mlx)";
        nonempty_groups(op, w.len(), cols, mode.group())?;
        let name = match mode {
            FpMode::Mxfp4 => c"mxfp4",
            FpMode::Mxfp8 => c"mxfp8",
            FpMode::Nvfp4 => c"nvfp4",
        };
        let global = if mode == FpMode::Nvfp4 {
            global_amax
        } else {
            None
        };
        let a = to_array(w, w.len() / cols, cols)?;
        let out = self.quantize(op, a, mode.group(), mode.bits(), name, global)?;
        let [q, s] = &out[..] else {
            return Err(failed(
                op,
                format!("MLX returned {} arrays, expected 2", out.len()),
            ));
        };
        let words = q.try_as_slice::<u32>().map_err(as_err)?;
        let packed: Vec<u8> = bytemuck::cast_slice(words).to_vec();
        let scales = s.try_as_slice::<u8>().map_err(as_err)?.to_vec();
        if packed.len() != mode.packed_len(w.len()) || scales.len() != w.len() / mode.group() {
            return Err(failed(
                op,
                "MLX returned outputs of unexpected sizes".into(),
            ));
        }
        Ok((packed, scales))
    }

    /// MLX's affine quantization (`bits` 2/4/8, `group` 32/64/128) over rows of `cols`:
    /// packed `uint32` words, and a scale and bias per group in the weight's dtype.
    pub fn quantize_affine<T: Element>(
        &self,
        w: &[T],
        cols: usize,
        group: usize,
        bits: usize,
    ) -> Result<Affine<T>, KernelError> {
        let op = "quantize_affine (mlx)";
        if !matches!(bits, 2 | 4 | 8) || !matches!(group, 32 | 64 | 128) {
            return Err(KernelError::Parameter {
                op,
                what: format!("bits {bits} with group size {group} (2, 4 or 8; 32, 64 or 128)"),
            });
        }
        nonempty_groups(op, w.len(), cols, group)?;
        let a = to_array(w, w.len() / cols, cols)?;
        let out = self.quantize(op, a, group, bits, c"affine", None)?;
        let [q, s, b] = &out[..] else {
            return Err(failed(
                op,
                format!("MLX returned {} arrays, expected 3", out.len()),
            ));
        };
        let packed = q.try_as_slice::<u32>().map_err(as_err)?.to_vec();
        if packed.len() != affine_words(w.len(), bits) {
            return Err(failed(
                op,
                "MLX returned outputs of unexpected sizes".into(),
            ));
        }
        Ok(Affine {
            packed,
            scales: elements(s)?,
            biases: elements(b)?,
        })
    }
}

/// Whole groups along every row, and at least one (MLX refuses an empty array).
fn nonempty_groups(
    op: &'static str,
    n: usize,
    cols: usize,
    group: usize,
) -> Result<(), KernelError> {
    match crate::layout::row_blocks(op, n, cols, group)? {
        0 => Err(KernelError::BlockMismatch {
            op,
            cols,
            block: group,
        }),
        _ => Ok(()),
    }
}
