//! CUDA kernels (feature `cuda`): NVRTC compiles `kernels.cu` at run time for the device's
//! architecture; cudarc loads the driver and NVRTC dynamically, so the crate builds without a
//! CUDA toolkit. Missing libraries and devices are named errors, never a panic (cudarc panics
//! on first use of a missing library, so presence is checked first).

use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::layout;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::sync::{Arc, OnceLock};

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
    // SAFETY: only probes whether the shared library can be opened.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(unavailable(
            "libnvrtc was not found (install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12` and add its lib folder to LD_LIBRARY_PATH)",
        ))
    }
}

/// Whether the CUDA driver can be loaded.
pub fn driver_available() -> Result<(), KernelError> {
    // SAFETY: only probes whether the shared library can be opened.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(unavailable(
            "libcuda was not found: no NVIDIA driver on this machine",
        ))
    }
}

/// Compiles every kernel to PTX for `arch` (`sm_90a`, …). Needs NVRTC only, no GPU.
pub fn compile_ptx(arch: &'static str) -> Result<Ptx, KernelError> {
    nvrtc_available()?;
    let opts = CompileOptions {
        arch: Some(arch),
        ftz: Some(false),
        prec_div: Some(true),
        fmad: Some(false),
        name: Some("kiln_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| unavailable(format!("NVRTC failed to compile kernels.cu: {e}")))
}

/// The loaded kernels on one GPU.
pub struct CudaKernels {
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

fn driver(e: impl std::fmt::Display) -> KernelError {
    unavailable(format!("CUDA driver error: {e}"))
}

impl CudaKernels {
    /// Opens GPU `ordinal`, compiles the kernels for its architecture and loads them.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        driver_available()?;
        nvrtc_available()?;
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        static ARCH: OnceLock<String> = OnceLock::new();
        let arch = ARCH.get_or_init(|| format!("sm_{major}{minor}"));
        let ptx = compile_ptx(arch.as_str())?;
        let module = ctx.load_module(ptx).map_err(driver)?;
        Ok(CudaKernels {
            stream: ctx.default_stream(),
            module,
        })
    }

    fn function<T: Element>(&self, name: &str) -> Result<CudaFunction, KernelError> {
        self.module
            .load_function(&format!("{name}_{}", T::KERNEL_SUFFIX))
            .map_err(driver)
    }

    fn upload<T: Element>(&self, x: &[T]) -> Result<cudarc::driver::CudaSlice<u8>, KernelError> {
        self.stream
            .clone_htod(bytemuck::cast_slice::<T, u8>(x))
            .map_err(driver)
    }

    fn grid(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `ops::amax::amax` on the GPU.
    pub fn amax<T: Element>(&self, x: &[T]) -> Result<f32, KernelError> {
        let blocks = x.len().div_ceil(256).clamp(1, 1024);
        let input = self.upload(x)?;
        let mut partial = self.stream.alloc_zeros::<f32>(blocks).map_err(driver)?;
        let f = self.function::<T>("amax")?;
        let n = x.len() as u64;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads `n` elements of `input` and writes `blocks` floats.
        unsafe {
            self.stream
                .launch_builder(&f)
                .arg(&input)
                .arg(&n)
                .arg(&mut partial)
                .launch(cfg)
        }
        .map_err(driver)?;
        let partial = self.stream.clone_dtoh(&partial).map_err(driver)?;
        Ok(partial.into_iter().fold(0.0, |a, b| {
            if a.is_nan() || b.is_nan() {
                f32::NAN
            } else {
                a.max(b)
            }
        }))
    }

    fn fp8<T: Element>(
        &self,
        name: &str,
        w: &[T],
        scale: f32,
        out: &mut [u8],
    ) -> Result<(), KernelError> {
        check_len("quantize_fp8", "output", out.len(), w.len(), &[w.len()])?;
        let input = self.upload(w)?;
        let mut q = self.stream.alloc_zeros::<u8>(w.len()).map_err(driver)?;
        let f = self.function::<T>(name)?;
        let n = w.len() as u64;
        // SAFETY: one thread per element; the kernel bounds-checks `n`.
        unsafe {
            self.stream
                .launch_builder(&f)
                .arg(&input)
                .arg(&mut q)
                .arg(&n)
                .arg(&scale)
                .launch(Self::grid(w.len()))
        }
        .map_err(driver)?;
        self.stream.memcpy_dtoh(&q, out).map_err(driver)
    }

    /// `ops::fp8::quantize_fp8_per_tensor` on the GPU.
    pub fn quantize_fp8_per_tensor<T: Element>(
        &self,
        w: &[T],
        scale: f32,
        out: &mut [u8],
    ) -> Result<(), KernelError> {
        self.fp8("fp8_round", w, scale, out)
    }

    /// FP8 of `w / scale` divided in f32 (one expert of `quantize_fp8_stacked`, one row of
    /// `quantize_fp8_per_channel`).
    pub fn quantize_fp8_f32div<T: Element>(
        &self,
        w: &[T],
        scale: f32,
        out: &mut [u8],
    ) -> Result<(), KernelError> {
        self.fp8("fp8_f32div", w, scale, out)
    }

    fn blocks<T: Element>(
        &self,
        name: &str,
        w: &[T],
        block: usize,
        out: &mut [u8],
        scales: &mut [u8],
        ws2: Option<f32>,
    ) -> Result<(), KernelError> {
        let nb = w.len() / block;
        let input = self.upload(w)?;
        let mut o = self.stream.alloc_zeros::<u8>(out.len()).map_err(driver)?;
        let mut s = self.stream.alloc_zeros::<u8>(nb).map_err(driver)?;
        let f = self.function::<T>(name)?;
        let nb64 = nb as u64;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&input).arg(&mut o).arg(&mut s).arg(&nb64);
        if let Some(ws2) = &ws2 {
            launch.arg(ws2);
        }
        // SAFETY: one thread per block; the kernel bounds-checks `nb`, buffers sized above.
        unsafe { launch.launch(Self::grid(nb)) }.map_err(driver)?;
        self.stream.memcpy_dtoh(&o, out).map_err(driver)?;
        self.stream.memcpy_dtoh(&s, scales).map_err(driver)
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
        layout::blocks(
            "quantize_nvfp4",
            shape,
            16,
            w.len(),
            packed.len(),
            8,
            scales.len(),
        )?;
        self.blocks("nvfp4", w, 16, packed, scales, Some(ws2))
    }

    /// `ops::mx::quantize_mxfp8` on the GPU.
    pub fn quantize_mxfp8<T: Element>(
        &self,
        w: &[T],
        cols: usize,
        q: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), KernelError> {
        layout::mx_blocks("quantize_mxfp8", w.len(), cols, q.len(), 32, scales.len())?;
        self.blocks("mxfp8", w, 32, q, scales, None)
    }

    /// `ops::mx::quantize_mxfp4` on the GPU.
    pub fn quantize_mxfp4<T: Element>(
        &self,
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
        self.blocks("mxfp4", w, 32, packed, scales, None)
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
        layout::int4_groups(
            "quantize_int4_groups",
            rows,
            cols,
            group,
            w.len(),
            scales.len(),
            out.len(),
        )?;
        let input = self.upload(w)?;
        let s = self.stream.clone_htod(scales).map_err(driver)?;
        let mut o = self.stream.alloc_zeros::<u8>(out.len()).map_err(driver)?;
        let f = self.function::<T>("int4")?;
        let (r, c, g) = (rows as u64, cols as u64, group as u64);
        // SAFETY: one thread per output byte; the kernel bounds-checks rows/2 · cols.
        unsafe {
            self.stream
                .launch_builder(&f)
                .arg(&input)
                .arg(&mut o)
                .arg(&s)
                .arg(&r)
                .arg(&c)
                .arg(&g)
                .launch(Self::grid(out.len()))
        }
        .map_err(driver)?;
        self.stream.memcpy_dtoh(&o, out).map_err(driver)
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(driver)
    }
}
