//! MLX's gradient checkpointing (`mlx.core.checkpoint`, mlx-c's `mlx_checkpoint`, which mlx-rs
//! does not wrap): a function of arrays whose intermediate arrays the backward pass of
//! `value_and_grad` recomputes from its inputs instead of keeping them.

use super::{as_err, failed};
use crate::error::KernelError;
use mlx_rs::Array;
use mlx_rs::error::Exception;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

/// Calls of checkpointed functions in this process (forward and backward passes together).
static CALLS: AtomicU64 = AtomicU64::new(0);

/// How many times MLX has run a [`checkpoint`]ed function in this process, in forward and
/// backward passes: a diagnostic (a test sees the recomputation happen).
pub fn checkpoint_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// A function [`checkpoint`] runs: MLX calls it in the forward pass and again, on the same
/// inputs, in the backward pass.
pub type ArrayFn = dyn Fn(&[Array]) -> Result<Vec<Array>, Exception>;

/// The arrays of an mlx-c vector, each a new reference.
///
/// # Safety
/// `v` must be a live vector.
unsafe fn arrays_of(v: mlx_sys::mlx_vector_array) -> Option<Vec<Array>> {
    // SAFETY: the caller guarantees `v` is live; each `get` writes a new reference into a
    // fresh handle that `Array::from_ptr` takes ownership of.
    unsafe {
        let n = mlx_sys::mlx_vector_array_size(v);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let mut a = mlx_sys::mlx_array_new();
            let got = mlx_sys::mlx_vector_array_get(&mut a, v, i);
            let a = Array::from_ptr(a);
            if got != 0 {
                return None;
            }
            out.push(a);
        }
        Some(out)
    }
}

/// A new mlx-c vector holding references to `arrays` (the caller frees it).
fn vector_of(arrays: &[Array]) -> mlx_sys::mlx_vector_array {
    let handles: Vec<mlx_sys::mlx_array> = arrays.iter().map(|a| a.as_ptr()).collect();
    // SAFETY: `handles` are live arrays (borrowed from `arrays`) for the call, which copies
    // them (taking references of its own).
    unsafe { mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len()) }
}

/// What mlx-c's closure carries: the function, and how often it has run.
struct Payload {
    f: Box<ArrayFn>,
    calls: std::cell::Cell<u64>,
}

/// `a` evaluated and copied out of the graph (f32; another dtype as it is): an array with the
/// same values and no inputs, so that the graph that made `a` can be freed.
fn detached(a: Array) -> Result<Array, Exception> {
    if a.dtype() != mlx_rs::Dtype::Float32 {
        return Ok(a);
    }
    let c = a.contiguous()?;
    c.eval()?;
    Ok(Array::from_slice(c.as_slice::<f32>(), a.shape()))
}

/// mlx-c's entry into the Rust function: the inputs out of the vector, the outputs into `res`.
/// Its first run is the forward pass (`mlx_closure_apply` in [`checkpoint`]), whose outputs are
/// [`detached`]: MLX's checkpoint sends no gradient through them (its backward pass runs the
/// function again, whose outputs keep their graph), and under `value_and_grad` an array the
/// traced function evaluates keeps its whole graph alive until the trace ends — the layer's
/// intermediates, which checkpointing is there to drop. A function that errs or panics
/// returns a failure status (MLX raises it as an error).
///
/// # Safety
/// `payload` is the `Box<Payload>` [`checkpoint`] leaked, alive until [`drop_payload`]; `res` a
/// live vector and `input` a live vector.
unsafe extern "C" fn call(
    res: *mut mlx_sys::mlx_vector_array,
    input: mlx_sys::mlx_vector_array,
    payload: *mut c_void,
) -> c_int {
    CALLS.fetch_add(1, Ordering::Relaxed);
    // SAFETY: see the function's contract.
    let p = unsafe { &*(payload as *const Payload) };
    let forward = p.calls.get() == 0;
    p.calls.set(p.calls.get() + 1);
    // SAFETY: `input` is live for the call.
    let Some(inputs) = (unsafe { arrays_of(input) }) else {
        return 1;
    };
    let run = || -> Result<Vec<Array>, Exception> {
        let out = (p.f)(&inputs)?;
        if forward {
            out.into_iter().map(detached).collect()
        } else {
            Ok(out)
        }
    };
    let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    let Ok(Ok(outputs)) = outputs else {
        return 1;
    };
    let v = vector_of(&outputs);
    // SAFETY: `res` is live (the caller's); `set` copies `v`'s references into it, and `v`,
    // created above, is freed after.
    unsafe {
        let status = mlx_sys::mlx_vector_array_set(res, v);
        mlx_sys::mlx_vector_array_free(v);
        status
    }
}

/// Frees the Rust function when MLX drops the last copy of the closure (the graph's, after
/// the backward pass).
///
/// # Safety
/// `payload` is the `Box<Payload>` [`checkpoint`] leaked, not used after this.
unsafe extern "C" fn drop_payload(payload: *mut c_void) {
    // SAFETY: see the function's contract.
    drop(unsafe { Box::from_raw(payload as *mut Payload) });
}

/// `f(inputs)` under MLX's gradient checkpointing (`mx.checkpoint`): the outputs are `f`'s, and
/// a `value_and_grad` through them keeps none of `f`'s intermediate arrays for its backward
/// pass — it runs `f` again on the same inputs there (in the forward pass the outputs are
/// evaluated: see [`call`]). Gradients flow to `inputs` only: pass
/// every array to differentiate as an input, never capture it in `f` (a captured array is a
/// constant). `f` must compute the same thing both times (draw any randomness before).
pub fn checkpoint(f: Box<ArrayFn>, inputs: &[Array]) -> Result<Vec<Array>, KernelError> {
    let op = "checkpoint";
    // Evaluating through mlx-rs once installs its (process-wide) error handler, so an MLX
    // failure below returns a status instead of ending the process.
    static HANDLER: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    HANDLER
        .get_or_init(|| Array::from_f32(0.0).eval().map_err(|e| e.to_string()))
        .clone()
        .map_err(as_err)?;
    let payload = Box::into_raw(Box::new(Payload {
        f,
        calls: std::cell::Cell::new(0),
    })) as *mut c_void;
    // SAFETY: `call` and `drop_payload` follow the payload's contract; mlx-c owns `payload`
    // from here (its closure copies share it and run `drop_payload` once, when the last goes).
    let closure =
        unsafe { mlx_sys::mlx_closure_new_func_payload(Some(call), payload, Some(drop_payload)) };
    // SAFETY: a fresh closure handle for the result.
    let mut checkpointed = unsafe { mlx_sys::mlx_closure_new() };
    // SAFETY: both handles are live; `mlx_checkpoint` copies `closure` into the result.
    let status = unsafe { mlx_sys::mlx_checkpoint(&mut checkpointed, closure) };
    // SAFETY: our handle on the plain closure is no longer needed (the result holds a copy).
    unsafe { mlx_sys::mlx_closure_free(closure) };
    if status != 0 {
        // SAFETY: created above, not used after.
        unsafe { mlx_sys::mlx_closure_free(checkpointed) };
        return Err(failed(op, "MLX refused checkpoint()".into()));
    }
    let args = vector_of(inputs);
    // SAFETY: a fresh vector for the results, freed below.
    let mut out = unsafe { mlx_sys::mlx_vector_array_new() };
    // SAFETY: every handle is live for the call.
    let status = unsafe { mlx_sys::mlx_closure_apply(&mut out, checkpointed, args) };
    // SAFETY: `out` holds the results until freed; the other handles were created above and are
    // not used after (the graph keeps its own copy of the checkpointed closure).
    let arrays = unsafe {
        let arrays = if status == 0 { arrays_of(out) } else { None };
        mlx_sys::mlx_vector_array_free(out);
        mlx_sys::mlx_vector_array_free(args);
        mlx_sys::mlx_closure_free(checkpointed);
        arrays
    };
    arrays.ok_or_else(|| failed(op, "the checkpointed function failed".into()))
}
