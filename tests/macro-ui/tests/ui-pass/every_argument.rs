//! Every argument of every attribute, used as documented, compiles.

use kiln::{
    Architecture, ArchitectureError, Linear, ModuleExporter, ModuleRef, ModuleTree, TensorInfo, TrainConfig,
    TrainError, TrainObserver, TrainReport, Trainer, architecture, exporter, trainer,
};

fn is_gate(m: &ModuleRef<'_>) -> bool {
    m.local_name() == "gate"
}

#[exporter(keys = [Linear, "QuantLinear", kiln::Embedding], predicate = is_gate, prepend, priority = -7, crate = ::kiln)]
struct Everything;
impl ModuleExporter for Everything {}

#[exporter(keys = ["Other"], fallback, replaces = Everything)]
#[derive(Default)]
struct WithDefault {
    _state: Vec<u8>,
}
impl ModuleExporter for WithDefault {}

#[trainer(task = "sft_v2", backend = "candle", priority = 3, crate = kiln)]
struct Sft;
impl Trainer for Sft {
    fn new(_: &TrainConfig) -> Result<Self, TrainError> {
        Ok(Sft)
    }
    fn train(&mut self, _: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
        unimplemented!()
    }
}

#[architecture(names = ["AForCausalLM", "BForCausalLM"], priority = 1)]
struct Family;
#[architecture(fallback, replaces = Family)]
struct Generic;
impl Architecture for Family {
    fn module_tree(&self, _: &serde_json::Value, _: &[TensorInfo]) -> Result<ModuleTree, ArchitectureError> {
        Ok(ModuleTree::default())
    }
}
impl Architecture for Generic {
    fn module_tree(&self, _: &serde_json::Value, _: &[TensorInfo]) -> Result<ModuleTree, ArchitectureError> {
        Ok(ModuleTree::default())
    }
}

fn main() {}
