//! CUDA kernels (feature `cuda`): NVRTC compiles `kernels.cu` at run time for the device's
//! architecture; cudarc loads the driver and NVRTC dynamically, so the crate builds without a
//! CUDA toolkit. Missing libraries and devices are named errors, never a panic (cudarc panics
//! on first use of a missing library, so presence is checked first).

use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::layout;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

/// The kernel source compiled by NVRTC.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel entry point, for each element suffix.
pub const ENTRY_POINTS: &[&str] = &[
    "amax",
    "fp8_round",
    "fp8_f32div",
    "nvfp4",
    "mxfp8",
    "mxfp4",
    "int4",
    "int4_v8",
];

fn unavailable(reason: impl Into<String>) -> KernelError {
    KernelError::DeviceUnavailable {
        device: "cuda",
        reason: reason.into(),
    }
}

/// Whether NVRTC can be loaded (`libnvrtc.so`; the PyPI wheel `nvidia-cuda-nvrtc-cu12` ships
/// one — put its folder on `LD_LIBRARY_PATH`).
pub fn nvrtc_available() -> Result<(), KernelError> {
    #[cfg(not(feature = "cuda-linked"))]
    // SAFETY: only probes whether the shared library can be opened.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    // Linked at build time: the loader found it, or the process would not have started.
    #[cfg(feature = "cuda-linked")]
    let present = true;
    if present {
        Ok(())
    } else {
        Err(unavailable(
            "libnvrtc was not found (install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12` and add its lib folder to LD_LIBRARY_PATH)",
        ))
    }
}

/// Whether the CUDA driver can be loaded.
pub fn driver_available() -> Result<(), KernelError> {
    #[cfg(not(feature = "cuda-linked"))]
    // SAFETY: only probes whether the shared library can be opened.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    // Linked at build time, as above.
    #[cfg(feature = "cuda-linked")]
    let present = true;
    if present {
        Ok(())
    } else {
        Err(unavailable(
            "libcuda was not found: no NVIDIA driver on this machine",
        ))
    }
}

/// What NVRTC hands back.
#[derive(Clone, Copy)]
enum Output {
    Ptx,
    Cubin,
}

fn compile(arch: &str, output: Output) -> Result<Vec<u8>, KernelError> {
    use cudarc::nvrtc::{result, sys};
    nvrtc_available()?;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        unavailable(format!("NVRTC failed to {what} kernels.cu for {arch}: {e}"))
    };
    let src = std::ffi::CString::new(SOURCE).map_err(|e| fail("read", &e))?;
    let prog =
        result::create_program(&src, Some(c"kiln_kernels.cu")).map_err(|e| fail("load", &e))?;
    // IEEE division, no flush to zero, no FMA contraction: the CPU reference's arithmetic.
    let options = [
        format!("--gpu-architecture={arch}"),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--fmad=false".into(),
    ];
    // SAFETY: `prog` was created above, is used only here and destroyed once, below; `src`
    // outlives it; the buffers are sized by NVRTC's own size queries.
    let out = unsafe {
        match result::compile_program(prog, &options) {
            Err(e) => {
                let log = result::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log.iter().map(|&c| c as u8).collect();
                Err(fail(
                    "compile",
                    &format!("{e}\n{}", String::from_utf8_lossy(&log)),
                ))
            }
            Ok(()) => match output {
                Output::Ptx => result::get_ptx(prog)
                    .map(|p| p.iter().map(|&c| c as u8).collect())
                    .map_err(|e| fail("emit PTX from", &e)),
                Output::Cubin => {
                    let mut size = 0usize;
                    let mut bytes = Vec::new();
                    sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .and_then(|()| {
                            bytes = vec![0u8; size];
                            sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast()).result()
                        })
                        .map(|()| bytes)
                        .map_err(|e| fail("emit machine code from", &e))
                }
            },
        }
    };
    // SAFETY: created above and not destroyed before.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// Compiles every kernel to PTX for `arch` (`sm_90a`, …). Needs NVRTC only, no GPU.
pub fn compile_ptx(arch: &str) -> Result<Ptx, KernelError> {
    let mut text = compile(arch, Output::Ptx)?;
    while text.last() == Some(&0) {
        text.pop();
    }
    Ok(Ptx::from_src(String::from_utf8_lossy(&text).into_owned()))
}

/// Compiles every kernel to machine code (CUBIN) for a real `arch` (`sm_90a`, …). NVRTC runs
/// ptxas for this, so an error in the inline PTX surfaces here, without a GPU, rather than
/// when a GPU loads the module.
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>, KernelError> {
    compile(arch, Output::Cubin)
}

/// Elements of type `T` in GPU memory (allocated by [`CudaKernels`], 256-byte aligned, which
/// the kernels' vector loads rely on).
pub struct DeviceSlice<T> {
    bytes: CudaSlice<u8>,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: bytemuck::Pod> DeviceSlice<T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

/// The loaded kernels on one GPU.
///
/// Two levels: `*_on_device` methods take [`DeviceSlice`]s and only queue kernels on the
/// stream (what a pipeline that keeps tensors on the GPU, and the benchmark, use); the methods
/// on host slices upload, run the same kernel and copy the result back.
pub struct CudaKernels {
    stream: Arc<CudaStream>,
    /// Every entry point, looked up once (a lookup per launch would cost microseconds).
    functions: HashMap<String, CudaFunction>,
}

fn driver(e: impl std::fmt::Display) -> KernelError {
    unavailable(format!("CUDA driver error: {e}"))
}

fn device_len(
    op: &'static str,
    what: &'static str,
    got: usize,
    want: usize,
) -> Result<(), KernelError> {
    check_len(op, what, got, want, &[want])
}

impl CudaKernels {
    /// Opens GPU `ordinal`, compiles the kernels for its architecture and loads them.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        driver_available()?;
        nvrtc_available()?;
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        // Machine code for exactly this GPU: no JIT by the driver at load time.
        let cubin = compile_cubin(&format!("sm_{major}{minor}"))?;
        let module: Arc<CudaModule> = ctx.load_module(Ptx::from_binary(cubin)).map_err(driver)?;
        let mut functions = HashMap::new();
        for entry in ENTRY_POINTS {
            for suffix in ["bf16", "f16", "f32"] {
                let name = format!("{entry}_{suffix}");
                let f = module.load_function(&name).map_err(driver)?;
                functions.insert(name, f);
            }
        }
        Ok(CudaKernels {
            stream: ctx.default_stream(),
            functions,
        })
    }

    /// The GPU's name, as the driver reports it.
    pub fn device_name(&self) -> Result<String, KernelError> {
        self.stream.context().name().map_err(driver)
    }

    fn function<T: Element>(&self, name: &str) -> Result<CudaFunction, KernelError> {
        let key = format!("{name}_{}", T::KERNEL_SUFFIX);
        self.functions
            .get(&key)
            .cloned()
            .ok_or_else(|| unavailable(format!("no kernel `{key}` in kernels.cu")))
    }

    /// Copies `x` to the GPU.
    pub fn upload<T: bytemuck::Pod>(&self, x: &[T]) -> Result<DeviceSlice<T>, KernelError> {
        let bytes: &[u8] = bytemuck::cast_slice(x);
        let buf = if bytes.is_empty() {
            self.stream.alloc_zeros::<u8>(1)
        } else {
            self.stream.clone_htod(bytes)
        }
        .map_err(driver)?;
        Ok(DeviceSlice {
            bytes: buf,
            len: x.len(),
            _element: PhantomData,
        })
    }

    /// `len` zeroed elements on the GPU.
    pub fn zeros<T: bytemuck::Pod>(&self, len: usize) -> Result<DeviceSlice<T>, KernelError> {
        let n = (len * std::mem::size_of::<T>()).max(1);
        Ok(DeviceSlice {
            bytes: self.stream.alloc_zeros::<u8>(n).map_err(driver)?,
            len,
            _element: PhantomData,
        })
    }

    /// Copies `x` back into `out` (same length), waiting for queued work.
    pub fn download_into<T: bytemuck::Pod>(
        &self,
        x: &DeviceSlice<T>,
        out: &mut [T],
    ) -> Result<(), KernelError> {
        device_len("download", "output", out.len(), x.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let view = self.stream_view(x);
        self.stream
            .memcpy_dtoh(&view, bytemuck::cast_slice_mut::<T, u8>(out))
            .map_err(driver)?;
        self.synchronize()
    }

    /// Copies `x` back to the host.
    pub fn download<T: bytemuck::Pod>(&self, x: &DeviceSlice<T>) -> Result<Vec<T>, KernelError> {
        let mut out = vec![T::zeroed(); x.len()];
        self.download_into(x, &mut out)?;
        Ok(out)
    }

    fn stream_view<'a, T: bytemuck::Pod>(
        &self,
        x: &'a DeviceSlice<T>,
    ) -> cudarc::driver::CudaView<'a, u8> {
        x.bytes.slice(..x.byte_len())
    }

    /// A device-to-device copy of `src` into `dst` (same length): the memory ceiling the
    /// benchmark compares the kernels with.
    pub fn copy_on_device<T: bytemuck::Pod>(
        &self,
        src: &DeviceSlice<T>,
        dst: &mut DeviceSlice<T>,
    ) -> Result<(), KernelError> {
        device_len("copy", "destination", dst.len(), src.len())?;
        let n = src.byte_len();
        let view = src.bytes.slice(..n);
        let mut out = dst.bytes.slice_mut(..n);
        self.stream.memcpy_dtod(&view, &mut out).map_err(driver)
    }

    fn grid(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `ops::amax::amax` of `x` into `out[0]` (bits of |max|; a NaN input gives a NaN). Queued
    /// only: read it with [`CudaKernels::download`], or use [`CudaKernels::amax`].
    pub fn amax_on_device<T: Element>(
        &self,
        x: &DeviceSlice<T>,
        out: &mut DeviceSlice<f32>,
    ) -> Result<(), KernelError> {
        device_len("amax", "output", out.len(), 1)?;
        self.stream.memset_zeros(&mut out.bytes).map_err(driver)?;
        if x.is_empty() {
            return Ok(());
        }
        let blocks = x.len().div_ceil(8 * 256).clamp(1, 4096);
        let f = self.function::<T>("amax")?;
        let n = x.len() as u64;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads `n` elements of `x` (grid-stride, bounds-checked) and does
        // one atomicMax per block on `out[0]`.
        unsafe {
            self.stream
                .launch_builder(&f)
                .arg(&x.bytes)
                .arg(&n)
                .arg(&mut out.bytes)
                .launch(cfg)
        }
        .map_err(driver)?;
        Ok(())
    }

    /// `ops::amax::amax` on the GPU.
    pub fn amax<T: Element>(&self, x: &[T]) -> Result<f32, KernelError> {
        let input = self.upload(x)?;
        let mut out = self.zeros::<f32>(1)?;
        self.amax_on_device(&input, &mut out)?;
        let a = self.download(&out)?[0];
        Ok(if a.is_nan() { f32::NAN } else { a })
    }

    fn fp8_on_device<T: Element>(
        &self,
        name: &str,
        w: &DeviceSlice<T>,
        scale: f32,
        out: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        device_len("quantize_fp8", "output", out.len(), w.len())?;
        if w.is_empty() {
            return Ok(());
        }
        let f = self.function::<T>(name)?;
        let n = w.len() as u64;
        // SAFETY: one thread per 8 elements plus one for the tail; the kernel bounds-checks
        // `n`; `out` holds `n` bytes.
        unsafe {
            self.stream
                .launch_builder(&f)
                .arg(&w.bytes)
                .arg(&mut out.bytes)
                .arg(&n)
                .arg(&scale)
                .launch(Self::grid(w.len() / 8 + 1))
        }
        .map_err(driver)?;
        Ok(())
    }

    /// `ops::fp8::quantize_fp8_per_tensor` (quotient rounded to the weight's dtype), queued.
    pub fn quantize_fp8_per_tensor_on_device<T: Element>(
        &self,
        w: &DeviceSlice<T>,
        scale: f32,
        out: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        self.fp8_on_device("fp8_round", w, scale, out)
    }

    /// FP8 of `w / scale` divided in f32 (one expert of `quantize_fp8_stacked`, one row of
    /// `quantize_fp8_per_channel`), queued.
    pub fn quantize_fp8_f32div_on_device<T: Element>(
        &self,
        w: &DeviceSlice<T>,
        scale: f32,
        out: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        self.fp8_on_device("fp8_f32div", w, scale, out)
    }

    fn blocks_on_device<T: Element>(
        &self,
        name: &str,
        w: &DeviceSlice<T>,
        block: usize,
        out: &mut DeviceSlice<u8>,
        scales: &mut DeviceSlice<u8>,
        ws2: Option<f32>,
    ) -> Result<(), KernelError> {
        let nb = w.len() / block;
        if nb == 0 {
            return Ok(());
        }
        let f = self.function::<T>(name)?;
        let nb64 = nb as u64;
        let mut launch = self.stream.launch_builder(&f);
        launch
            .arg(&w.bytes)
            .arg(&mut out.bytes)
            .arg(&mut scales.bytes)
            .arg(&nb64);
        if let Some(ws2) = &ws2 {
            launch.arg(ws2);
        }
        // SAFETY: one thread per block; the kernel bounds-checks `nb`; the caller checked the
        // buffers' lengths against the layout.
        unsafe { launch.launch(Self::grid(nb)) }.map_err(driver)?;
        Ok(())
    }

    /// `ops::nvfp4::quantize_nvfp4`, queued.
    pub fn quantize_nvfp4_on_device<T: Element>(
        &self,
        w: &DeviceSlice<T>,
        shape: &[usize],
        ws2: f32,
        packed: &mut DeviceSlice<u8>,
        scales: &mut DeviceSlice<u8>,
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
        self.blocks_on_device("nvfp4", w, 16, packed, scales, Some(ws2))
    }

    /// `ops::mx::quantize_mxfp8`, queued.
    pub fn quantize_mxfp8_on_device<T: Element>(
        &self,
        w: &DeviceSlice<T>,
        cols: usize,
        q: &mut DeviceSlice<u8>,
        scales: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        layout::mx_blocks("quantize_mxfp8", w.len(), cols, q.len(), 32, scales.len())?;
        self.blocks_on_device("mxfp8", w, 32, q, scales, None)
    }

    /// `ops::mx::quantize_mxfp4`, queued.
    pub fn quantize_mxfp4_on_device<T: Element>(
        &self,
        w: &DeviceSlice<T>,
        cols: usize,
        packed: &mut DeviceSlice<u8>,
        scales: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        layout::mx_blocks(
            "quantize_mxfp4",
            w.len(),
            cols,
            packed.len(),
            16,
            scales.len(),
        )?;
        self.blocks_on_device("mxfp4", w, 32, packed, scales, None)
    }

    /// `ops::int::quantize_int4_groups`, queued.
    #[allow(clippy::too_many_arguments)]
    pub fn quantize_int4_groups_on_device<T: Element>(
        &self,
        w: &DeviceSlice<T>,
        rows: usize,
        cols: usize,
        group: usize,
        scales: &DeviceSlice<f32>,
        out: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        layout::int4_groups(
            "quantize_int4_groups",
            rows,
            cols,
            group,
            w.len(),
            scales.len(),
            out.len(),
        )?;
        if out.is_empty() {
            return Ok(());
        }
        let vector = cols.is_multiple_of(8);
        let f = self.function::<T>(if vector { "int4_v8" } else { "int4" })?;
        let threads = if vector { out.len() / 8 } else { out.len() };
        let (r, c, g) = (rows as u64, cols as u64, group as u64);
        // SAFETY: one thread per output byte (or per 8 when cols % 8 == 0); the kernel
        // bounds-checks rows/2 · cols; buffers checked against the layout above.
        unsafe {
            self.stream
                .launch_builder(&f)
                .arg(&w.bytes)
                .arg(&mut out.bytes)
                .arg(&scales.bytes)
                .arg(&r)
                .arg(&c)
                .arg(&g)
                .launch(Self::grid(threads))
        }
        .map_err(driver)?;
        Ok(())
    }

    // The host-slice methods: upload, run the queued method (which checks every length
    // against the layout, so a bad shape is the same named error), copy back.

    /// `ops::fp8::quantize_fp8_per_tensor` on the GPU.
    pub fn quantize_fp8_per_tensor<T: Element>(
        &self,
        w: &[T],
        scale: f32,
        out: &mut [u8],
    ) -> Result<(), KernelError> {
        let mut q = self.zeros::<u8>(out.len())?;
        self.quantize_fp8_per_tensor_on_device(&self.upload(w)?, scale, &mut q)?;
        self.download_into(&q, out)
    }

    /// FP8 of `w / scale` divided in f32 on the GPU.
    pub fn quantize_fp8_f32div<T: Element>(
        &self,
        w: &[T],
        scale: f32,
        out: &mut [u8],
    ) -> Result<(), KernelError> {
        let mut q = self.zeros::<u8>(out.len())?;
        self.quantize_fp8_f32div_on_device(&self.upload(w)?, scale, &mut q)?;
        self.download_into(&q, out)
    }

    /// Runs a two-output quantizer on device copies of `w`, `a` and `b`, then copies `a` and
    /// `b` back.
    fn two_outputs<T: Element>(
        &self,
        w: &[T],
        a: &mut [u8],
        b: &mut [u8],
        op: impl FnOnce(
            &DeviceSlice<T>,
            &mut DeviceSlice<u8>,
            &mut DeviceSlice<u8>,
        ) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        let (mut da, mut db) = (self.zeros(a.len())?, self.zeros(b.len())?);
        op(&self.upload(w)?, &mut da, &mut db)?;
        self.download_into(&da, a)?;
        self.download_into(&db, b)
    }

    /// `ops::nvfp4::quantize_nvfp4` on the GPU.
    pub fn quantize_nvfp4<T: Element>(
        &self,
        w: &[T],
        shape: &[usize],
        ws2: f32,
        packed: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), KernelError> {
        self.two_outputs(w, packed, scales, |w, p, s| {
            self.quantize_nvfp4_on_device(w, shape, ws2, p, s)
        })
    }

    /// `ops::mx::quantize_mxfp8` on the GPU.
    pub fn quantize_mxfp8<T: Element>(
        &self,
        w: &[T],
        cols: usize,
        q: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), KernelError> {
        self.two_outputs(w, q, scales, |w, q, s| {
            self.quantize_mxfp8_on_device(w, cols, q, s)
        })
    }

    /// `ops::mx::quantize_mxfp4` on the GPU.
    pub fn quantize_mxfp4<T: Element>(
        &self,
        w: &[T],
        cols: usize,
        packed: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), KernelError> {
        self.two_outputs(w, packed, scales, |w, p, s| {
            self.quantize_mxfp4_on_device(w, cols, p, s)
        })
    }

    /// `ops::int::quantize_int4_groups` on the GPU.
    pub fn quantize_int4_groups<T: Element>(
        &self,
        w: &[T],
        rows: usize,
        cols: usize,
        group: usize,
        scales: &[f32],
        out: &mut [u8],
    ) -> Result<(), KernelError> {
        let mut o = self.zeros(out.len())?;
        let (dw, ds) = (self.upload(w)?, self.upload(scales)?);
        self.quantize_int4_groups_on_device(&dw, rows, cols, group, &ds, &mut o)?;
        self.download_into(&o, out)
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(driver)
    }
}
