//! A plugin crate: exporters, a trainer and an architecture registered from outside kiln,
//! exactly as a user's crate would. kiln's integration tests link it with
//! `use kiln_test_plugin as _;` and pin the ordering, matching and routing rules on it.

use kiln::{
    Architecture, ArchitectureError, ExportContext, ExportError, Linear, ModuleExporter, ModuleRef,
    ModuleTree, TensorInfo, TrainConfig, TrainError, TrainObserver, TrainReport, Trainer,
    architecture, exporter, trainer,
};

/// Takes every `Linear` ahead of everything else.
#[exporter(keys = [Linear], prepend)]
#[derive(Debug)]
pub struct PluginLinear;

impl ModuleExporter for PluginLinear {
    fn export(
        &self,
        name: &str,
        _module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        ctx.note(name, "PluginLinear");
        Ok(())
    }
}

/// Takes MoE routers: a module named `gate` whose parent has `experts` (predicate only).
#[exporter(predicate = is_router)]
#[derive(Debug, Default)]
pub struct PluginRouter {
    _state: (),
}

/// Whether `m` is the router of an MoE block.
pub fn is_router(m: &ModuleRef<'_>) -> bool {
    m.local_name() == "gate" && m.parent().is_some_and(|p| p.child("experts").is_some())
}

impl ModuleExporter for PluginRouter {}

/// Takes the experts container of GPT-OSS blocks and prepares their inputs — ahead of the
/// built-in `BmmExperts`, which is what `prepend` is for.
#[exporter(keys = ["GptOssExperts"], prepend)]
#[derive(Debug)]
pub struct PluginExperts;

impl ModuleExporter for PluginExperts {
    fn prepare_moe_inputs(
        &self,
        name: &str,
        _block: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        ctx.note(name, "PluginExperts::prepare_moe_inputs");
        Ok(())
    }
}

/// Takes anything that has tensors and nothing else took (a broad catch-all).
#[exporter(predicate = has_tensors, fallback)]
#[derive(Debug)]
pub struct PluginCatchAll;

/// Whether `m` owns a tensor.
pub fn has_tensors(m: &ModuleRef<'_>) -> bool {
    !m.tensors().is_empty()
}

impl ModuleExporter for PluginCatchAll {}

/// A trainer for a plugin's own task that counts steps (a stand-in for a real one).
#[trainer(task = "count", backend = "candle")]
#[derive(Debug)]
pub struct PluginSft {
    steps: u64,
}

impl Trainer for PluginSft {
    fn new(config: &TrainConfig) -> Result<Self, TrainError> {
        let steps = config.hyper.max_steps.ok_or_else(|| TrainError::Config {
            field: "hyper.max_steps".into(),
            message: "PluginSft needs max_steps".into(),
        })?;
        Ok(PluginSft { steps })
    }

    fn train(&mut self, observer: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
        let mut done = 0;
        for step in 1..=self.steps {
            if observer.should_stop() {
                break;
            }
            observer.on_step(&kiln::train::StepMetrics {
                step,
                loss: 1.0 / step as f64,
                ..Default::default()
            });
            done = step;
        }
        let mut report = TrainReport::new("count", "candle");
        report.steps = done;
        report.final_loss = (done > 0).then(|| 1.0 / done as f64);
        report.stopped_early = done < self.steps;
        Ok(report)
    }
}

/// A made-up model family.
#[architecture(names = ["PluginForCausalLM"])]
#[derive(Debug)]
pub struct PluginArch;

impl Architecture for PluginArch {
    fn module_tree(
        &self,
        _config: &serde_json::Value,
        tensors: &[TensorInfo],
    ) -> Result<ModuleTree, ArchitectureError> {
        let mut tree = ModuleTree::default();
        for t in tensors {
            let (module, local) = t.name.rsplit_once('.').unwrap_or(("", &t.name));
            let info = TensorInfo {
                name: local.to_string(),
                ..t.clone()
            };
            tree.add(
                module,
                kiln::ClassChain::new([kiln::Class::of::<Linear>()]),
                vec![info],
            )?;
        }
        Ok(tree)
    }
}

/// An output writer registered from outside kiln (`--output-format plugin-manifest`): lists
/// every tensor it is handed, with its dtype and shape, in `manifest.txt`.
#[kiln::writer(name = "plugin-manifest")]
#[derive(Debug, Default)]
pub struct PluginManifest {
    lines: Vec<String>,
}

impl kiln::export::writer::OutputWriter for PluginManifest {
    fn linear(
        &self,
        w: &kiln::export::writer::LinearWeight<'_>,
    ) -> Result<kiln::export::writer::Written, ExportError> {
        self.tensor(
            &format!("{}.weight", w.module),
            w.values.dtype(),
            &[w.rows, w.cols],
            w.values.bytes().to_vec(),
        )
    }

    fn tensor(
        &self,
        name: &str,
        dtype: kiln::export::writer::Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<kiln::export::writer::Written, ExportError> {
        Ok(kiln::export::writer::Written::copied(
            name, dtype, shape, data,
        ))
    }

    fn write(&mut self, t: kiln::export::writer::Encoded) -> Result<(), ExportError> {
        self.lines.push(format!(
            "{} {:?} {:?} {}",
            t.name,
            t.ty,
            t.shape,
            t.data.len()
        ));
        Ok(())
    }

    fn finish(
        &mut self,
        end: &kiln::export::writer::WriterEnd<'_>,
    ) -> Result<Vec<String>, ExportError> {
        std::fs::write(end.out.join("manifest.txt"), self.lines.join("\n")).map_err(|e| {
            ExportError::Writer {
                writer: "plugin-manifest".into(),
                what: e.to_string(),
            }
        })?;
        Ok(vec!["manifest.txt".into()])
    }
}

impl kiln::export::writer::WriterType for PluginManifest {
    fn formats() -> Vec<(&'static str, String)> {
        vec![("list", "every tensor's name, dtype, shape and size".into())]
    }

    fn new(_format: &str) -> Result<Self, ExportError> {
        Ok(PluginManifest::default())
    }
}
