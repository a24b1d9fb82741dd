//! Gradient checkpointing (TRL's `gradient_checkpointing`, transformers'
//! `gradient_checkpointing_enable()`): each decoder layer's forward keeps only its input for the
//! backward pass; the backward pass runs the layer again from that input and takes its
//! gradients from the recomputed graph.
//!
//! candle has no checkpoint of its own, so the layer is wrapped in a custom op on its input
//! ([`layer`]): the forward computes the layer, detaches the result (which frees every
//! intermediate of the layer) and hands a copy of it to the op; the op's backward recomputes
//! the layer on a fresh variable holding the saved input, back-propagates the incoming
//! gradient through it and returns the input's gradient. The gradients of the layer's
//! trainable parameters (LoRA's `A` and `B`, or the layer's weights under full fine-tuning)
//! cannot leave a candle op's backward, so they go into the model's [`GradSink`], from which the
//! training step takes them after `loss.backward()` ([`GradSink::take`]).
//!
//! The recomputation is the same arithmetic in the same order on the same input, and LoRA's
//! dropout draws the same masks (the layer's stream position is saved with it), so the
//! forward is bit for bit the un-checkpointed one; the gradients agree to float rounding (the
//! order in which candle sums a tensor's gradient contributions differs). Tested against the
//! un-checkpointed pass (this file's tests) and by TRL parity (`tests/it/train.rs`, where it is
//! on, as TRL's default is).
//!
//! Under full fine-tuning without checkpointing the same op serves the other end of the trade
//! ([`LayerBackward::Kept`]): the op keeps the layer's graph (every intermediate, as candle's
//! one graph would) and its backward pass goes through that graph and then drops it. candle's
//! `backward` holds every node of a graph until it returns, so in one graph the activations of
//! every layer live until the last gradient is computed, beside all the parameters' gradients;
//! with the layers' graphs in their ops, each layer's activations are freed as soon as the
//! backward pass has left the layer, as PyTorch's autograd frees them. The arithmetic is the
//! one graph's, in the same order: values and gradients are bit for bit the same.

use super::ModelError;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Shape, Storage, Tensor, TensorId, Var,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Where a layer op's backward pass finds the layer's graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerBackward {
    /// Gradient checkpointing: the forward keeps the layer's input only, the backward pass runs
    /// the layer again from it.
    #[default]
    Recompute,
    /// The forward keeps the layer's graph; the backward pass goes through it and drops it, so
    /// each layer's activations are freed once the backward pass has left the layer.
    Kept,
}

/// Where a layer op's backward pass leaves the gradients of the parameters the layer trains
/// (gradient checkpointing, or layers whose graphs are freed during the backward pass): one per
/// model being trained, shared by its copies, read by the training step.
#[derive(Debug, Default)]
pub struct GradSink {
    /// The trainable parameters whose gradients are kept (every other one is dropped).
    wanted: HashSet<TensorId>,
    grads: Mutex<HashMap<TensorId, Tensor>>,
    mode: LayerBackward,
    /// Layers recomputed so far (what the tests check checkpointing by).
    recomputed: AtomicUsize,
    /// Layers' graphs held by their ops now (what the tests check the freeing by).
    held: AtomicUsize,
}

impl GradSink {
    /// A sink for the gradients of `trainable`, under gradient checkpointing.
    pub fn new<'a>(trainable: impl IntoIterator<Item = &'a Var>) -> Self {
        Self::with_mode(trainable, LayerBackward::Recompute)
    }

    /// A sink for the gradients of `trainable`, its layers' backward passes as `mode` says.
    pub fn with_mode<'a>(
        trainable: impl IntoIterator<Item = &'a Var>,
        mode: LayerBackward,
    ) -> Self {
        GradSink {
            wanted: trainable.into_iter().map(|v| v.as_tensor().id()).collect(),
            mode,
            ..GradSink::default()
        }
    }

    /// How the layers' backward passes get their graphs.
    pub fn mode(&self) -> LayerBackward {
        self.mode
    }

    /// How many layers the backward passes have recomputed so far.
    pub fn recomputed(&self) -> usize {
        self.recomputed.load(Ordering::Relaxed)
    }

    /// How many layers' graphs ([`LayerBackward::Kept`]) are held by their ops now: each
    /// forward pass adds its layers, the backward pass frees them one by one.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Whether `var`'s gradient is wanted (it is being trained).
    pub fn wants(&self, var: &Var) -> bool {
        self.wanted.contains(&var.as_tensor().id())
    }

    fn add(&self, id: TensorId, grad: &Tensor) -> candle_core::Result<()> {
        let mut grads = self.grads.lock().unwrap_or_else(|e| e.into_inner());
        let sum = match grads.remove(&id) {
            Some(old) => (old + grad)?,
            None => grad.clone(),
        };
        grads.insert(id, sum);
        Ok(())
    }

    /// Takes the gradient of `var` collected since the last take (summed over every
    /// checkpointed layer that used it), leaving none behind.
    pub fn take(&self, var: &Var) -> Option<Tensor> {
        self.grads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&var.as_tensor().id())
    }

    /// Drops whatever was collected (a step that failed half-way).
    pub fn clear(&self) {
        self.grads.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// A layer's forward from its input, run again in the backward pass.
pub type Recompute = Box<dyn Fn(&Tensor) -> Result<Tensor, ModelError> + Send + Sync>;

/// A layer's graph kept by its op: the input variable and the output it was computed into.
/// Counted in its sink's [`GradSink::held`] while it lives.
struct KeptGraph {
    x: Tensor,
    y: Tensor,
    sink: Arc<GradSink>,
}

impl KeptGraph {
    fn new(x: Tensor, y: Tensor, sink: &Arc<GradSink>) -> Self {
        sink.held.fetch_add(1, Ordering::Relaxed);
        KeptGraph {
            x,
            y,
            sink: sink.clone(),
        }
    }
}

impl Drop for KeptGraph {
    fn drop(&mut self) {
        self.sink.held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where the op's backward pass finds the layer's graph.
enum Graph {
    Recompute(Recompute),
    /// Taken (and dropped) by the backward pass.
    Kept(Mutex<Option<KeptGraph>>),
}

struct Checkpointed {
    /// The layer's output, detached; taken by the op's forward.
    out: Mutex<Option<Tensor>>,
    graph: Graph,
    /// Whether the layer's input carries a gradient of its own (else only the parameters'
    /// gradients are wanted, and the op's input is a stand-in variable).
    input_tracked: bool,
    sink: Arc<GradSink>,
}

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("decoder layer op: {e}"))
}

impl Checkpointed {
    /// The detached output's storage, once (the op's forward).
    fn output(&self) -> candle_core::Result<Tensor> {
        let out = self
            .out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| op_err("the layer's output was taken twice"))?;
        // A contiguous tensor at offset 0: what a custom op returns (a layer's output is a
        // fresh tensor, so this copies nothing).
        if out.is_contiguous() && out.layout().start_offset() == 0 {
            Ok(out)
        } else {
            out.copy()
        }
    }

    /// The op's result: the layer's output, on the device `pick` takes.
    fn stored<S: BackendStorage>(
        &self,
        pick: impl Fn(&Storage) -> Option<&S>,
    ) -> candle_core::Result<(S, Shape)> {
        let out = self.output()?;
        let (s, l) = out.storage_and_layout();
        let s = pick(&s).ok_or_else(|| op_err("the layer ran on another device than its input"))?;
        Ok((s.try_clone(l)?, l.shape().clone()))
    }
}

impl CustomOp1 for Checkpointed {
    fn name(&self) -> &'static str {
        "checkpointed-layer"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.stored(|s| match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.stored(|s| match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        self.stored(|s| match s {
            Storage::Metal(c) => Some(c),
            _ => None,
        })
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (x, y, kept) = match &self.graph {
            Graph::Recompute(recompute) => {
                // The layer again, on a variable holding the saved input (a plain tensor when
                // only the parameters' gradients are wanted).
                let x = if self.input_tracked {
                    Var::from_tensor(&arg.detach())?.as_tensor().clone()
                } else {
                    arg.detach()
                };
                let y = recompute(&x).map_err(op_err)?;
                self.sink.recomputed.fetch_add(1, Ordering::Relaxed);
                (x, y, None)
            }
            Graph::Kept(kept) => {
                let kept = kept
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .ok_or_else(|| {
                        op_err("the layer's graph was freed by an earlier backward pass")
                    })?;
                (kept.x.clone(), kept.y.clone(), Some(kept))
            }
        };
        // d/dy Σ y · g = g exactly: the incoming gradient, back-propagated through the layer.
        let store = (y * grad.detach())?.sum_all()?.backward()?;
        for id in store.get_ids() {
            if self.sink.wanted.contains(id)
                && let Some(g) = store.get_id(*id)
            {
                self.sink.add(*id, g)?;
            }
        }
        let dx = if self.input_tracked {
            store.get(&x).cloned()
        } else {
            None
        };
        // The layer's graph and every gradient but the input's go here.
        drop((store, x, kept));
        Ok(dx)
    }
}

/// `layer(h)` with its activations recomputed in the backward pass instead of kept: the value
/// is `forward(h)`'s; the gradient reaching `h` is the layer's input gradient, and the layer's
/// parameter gradients go to `sink`. `recompute` must compute what `forward` did (LoRA's
/// dropout masks drawn from the stream position `forward` started at).
pub fn layer(
    h: &Tensor,
    forward: impl FnOnce(&Tensor) -> Result<Tensor, ModelError>,
    recompute: Recompute,
    sink: &Arc<GradSink>,
) -> Result<Tensor, ModelError> {
    let input_tracked = h.track_op();
    // Detached: the layer's intermediates are freed with its output's graph, here.
    let out = forward(&h.detach())?.detach();
    let op = Checkpointed {
        out: Mutex::new(Some(out)),
        graph: Graph::Recompute(recompute),
        input_tracked,
        sink: sink.clone(),
    };
    apply(h, op)
}

/// `layer(h)` with the layer's graph kept by an op of the outer graph until the backward pass
/// goes through it ([`LayerBackward::Kept`]): the value is `forward(h)`'s; the gradient reaching
/// `h` is the layer's input gradient, the layer's parameter gradients go to `sink`, and the
/// layer's activations are freed as soon as its backward pass has run.
pub fn kept_layer(
    h: &Tensor,
    forward: impl FnOnce(&Tensor) -> Result<Tensor, ModelError>,
    sink: &Arc<GradSink>,
) -> Result<Tensor, ModelError> {
    let input_tracked = h.track_op();
    // The layer's own graph starts at a variable holding the input (a plain tensor when only
    // the parameters' gradients are wanted).
    let x = if input_tracked {
        Var::from_tensor(&h.detach())?.as_tensor().clone()
    } else {
        h.detach()
    };
    let y = forward(&x)?;
    let op = Checkpointed {
        out: Mutex::new(Some(y.detach())),
        graph: Graph::Kept(Mutex::new(Some(KeptGraph::new(x, y, sink)))),
        input_tracked,
        sink: sink.clone(),
    };
    apply(h, op)
}

fn apply(h: &Tensor, op: Checkpointed) -> Result<Tensor, ModelError> {
    // An input without a graph (frozen embeddings under LoRA) would hide the op from candle's
    // backward pass: the op then hangs off a stand-in variable, whose gradient is not computed.
    let arg = if op.input_tracked {
        h.clone()
    } else {
        Var::from_tensor(h)?.as_tensor().clone()
    };
    Ok(arg.apply_op1(op)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "element {i}: {x} vs {y}"
            );
        }
    }

    /// A two-parameter "layer", h + tanh(h · W) · s: its parameters and its forward.
    fn toy_layer() -> (
        Var,
        Var,
        impl Fn(&Tensor) -> Result<Tensor, ModelError> + Clone + Send + Sync + 'static,
    ) {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.3, (8, 8), &dev).unwrap()).unwrap();
        let s = Var::from_tensor(&Tensor::randn(0f32, 1.0, 8, &dev).unwrap()).unwrap();
        let f = {
            let (w, s) = (w.clone(), s.clone());
            move |h: &Tensor| -> Result<Tensor, ModelError> {
                let y = h.broadcast_matmul(w.as_tensor())?.tanh()?;
                Ok((h + y.broadcast_mul(s.as_tensor())?)?)
            }
        };
        (w, s, f)
    }

    /// The layer's input, a variable when `tracked` (returned too), else a plain tensor.
    fn toy_input(tracked: bool) -> (Tensor, Var) {
        let x0 = Tensor::randn(0f32, 1.0, (2, 3, 8), &Device::Cpu).unwrap();
        let xv = Var::from_tensor(&x0).unwrap();
        let x = if tracked { xv.as_tensor().clone() } else { x0 };
        (x, xv)
    }

    /// Two toy layers, with the input tracked or not.
    #[test]
    fn checkpointed_layers_give_the_plain_values_and_gradients() {
        let (w, s, f) = toy_layer();
        for tracked in [false, true] {
            let (x, xv) = toy_input(tracked);
            // Plain.
            let plain = f(&f(&x).unwrap()).unwrap();
            let lp = plain.sqr().unwrap().sum_all().unwrap();
            let gp = lp.backward().unwrap();
            // Checkpointed.
            let sink = Arc::new(GradSink::new([&w, &s]));
            let h1 = layer(&x, &f, Box::new(f.clone()), &sink).unwrap();
            let h2 = layer(&h1, &f, Box::new(f.clone()), &sink).unwrap();
            close(&h2, &plain, 0.0);
            assert_eq!(
                sink.recomputed(),
                0,
                "nothing recomputed before the backward pass"
            );
            let lc = h2.sqr().unwrap().sum_all().unwrap();
            let gc = lc.backward().unwrap();
            assert_eq!(sink.recomputed(), 2, "each layer recomputed once");
            for v in [&w, &s] {
                assert!(
                    gc.get(v.as_tensor()).is_none(),
                    "layer params stay in the op"
                );
                close(&sink.take(v).unwrap(), gp.get(v.as_tensor()).unwrap(), 1e-5);
                assert!(sink.take(v).is_none(), "taken once");
            }
            if tracked {
                close(
                    gc.get(xv.as_tensor()).unwrap(),
                    gp.get(xv.as_tensor()).unwrap(),
                    1e-5,
                );
            }
        }
    }

    /// A layer's graph kept by its op gives the one graph's values and gradients, bit for bit,
    /// and each graph is freed by the backward pass through it.
    #[test]
    fn kept_layer_graphs_give_the_one_graphs_bits_and_are_freed_by_the_backward_pass() {
        let (w, s, f) = toy_layer();
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        for tracked in [false, true] {
            let (x, xv) = toy_input(tracked);
            let plain = f(&f(&f(&x).unwrap()).unwrap()).unwrap();
            let gp = plain.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let sink = Arc::new(GradSink::with_mode([&w, &s], LayerBackward::Kept));
            let mut h = x.clone();
            for _ in 0..3 {
                h = kept_layer(&h, &f, &sink).unwrap();
            }
            assert_eq!(bits(&h), bits(&plain));
            assert_eq!(
                sink.held(),
                3,
                "three layers' graphs held until the backward pass"
            );
            let loss = h.sqr().unwrap().sum_all().unwrap();
            let gk = loss.backward().unwrap();
            assert_eq!(
                sink.held(),
                0,
                "every layer's graph freed by the backward pass"
            );
            assert_eq!(sink.recomputed(), 0, "nothing recomputed");
            for v in [&w, &s] {
                assert!(
                    gk.get(v.as_tensor()).is_none(),
                    "layer params stay in the op"
                );
                let g = sink.take(v).unwrap();
                assert_eq!(bits(&g), bits(gp.get(v.as_tensor()).unwrap()));
            }
            if tracked {
                let (a, b) = (gk.get(xv.as_tensor()), gp.get(xv.as_tensor()));
                assert_eq!(bits(a.unwrap()), bits(b.unwrap()));
            }
            // A second backward pass over the same graph finds the layers' graphs gone.
            let err = loss.backward().unwrap_err().to_string();
            assert!(err.contains("freed by an earlier backward pass"), "{err}");
            // A forward pass whose output is dropped without a backward pass frees its graphs.
            let h = kept_layer(&x, &f, &sink).unwrap();
            assert_eq!(sink.held(), 1);
            drop(h);
            assert_eq!(sink.held(), 0);
        }
    }

    #[test]
    fn an_unwanted_parameter_is_dropped_and_clear_empties() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::ones((4, 4), DType::F32, &dev).unwrap()).unwrap();
        let f = {
            let w = w.clone();
            move |h: &Tensor| -> Result<Tensor, ModelError> {
                Ok(h.broadcast_matmul(w.as_tensor())?)
            }
        };
        let x = Tensor::ones((1, 4), DType::F32, &dev).unwrap();
        let step = |sink: &Arc<GradSink>| {
            let y = layer(&x, &f, Box::new(f.clone()), sink).unwrap();
            y.sum_all().unwrap().backward().unwrap();
        };
        // Not wanted: recomputed, but its gradient is not kept.
        let unwanted = Arc::new(GradSink::new(std::iter::empty()));
        step(&unwanted);
        assert_eq!(unwanted.recomputed(), 1);
        assert!(unwanted.take(&w).is_none());
        // Wanted: kept (d Σ x·W / dW = ones), summed over two passes, then cleared.
        let sink = Arc::new(GradSink::new([&w]));
        step(&sink);
        step(&sink);
        let g: Vec<f32> = sink
            .take(&w)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(g, vec![2.0; 16], "two passes' gradients summed");
        step(&sink);
        sink.clear();
        assert!(sink.take(&w).is_none());
    }
}
