//! The registry rules end to end: entries from this test crate and from the plugin crate,
//! registered with the real macros, collected at link time and sorted on first use.

use kiln::export::{self, ModuleOutcome};
use kiln::train::StepMetrics;
use kiln::{
    Class, ClassChain, Embedding, ExportContext, ExporterRegistry, Linear, ModuleExporter,
    ModuleRef, ModuleTree, RouteError, TensorInfo, TrainConfig, TrainError, TrainObserver,
    TrainReport, Trainer, TrainerRegistry, exporter, trainer,
};
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_test_plugin as _;

#[exporter(keys = [Linear], priority = 10)]
struct HighLinear;
impl ModuleExporter for HighLinear {}

#[exporter(keys = ["QuantLinear"], predicate = is_proj)]
struct QuantProj;
impl ModuleExporter for QuantProj {}

fn is_proj(m: &ModuleRef<'_>) -> bool {
    m.local_name().ends_with("_proj")
}

#[exporter(keys = ["Mlp"])]
struct OldMlp;
impl ModuleExporter for OldMlp {}

#[exporter(keys = ["Mlp"], replaces = OldMlp)]
struct NewMlp;
impl ModuleExporter for NewMlp {}

#[exporter(keys = [Embedding], crate = kiln)]
#[derive(Default)]
struct CrateArg {
    _n: u8,
}
impl ModuleExporter for CrateArg {}

#[exporter(predicate = is_norm, fallback, priority = 5)]
struct LocalNorm;
impl ModuleExporter for LocalNorm {}

fn is_norm(m: &ModuleRef<'_>) -> bool {
    m.class_name().ends_with("RMSNorm")
}

#[test]
fn global_exporter_order_is_tier_priority_path() {
    let r = ExporterRegistry::try_global().unwrap();
    let all: Vec<&str> = r.entries().iter().map(|e| e.meta.path.as_ref()).collect();
    // kiln's own built-ins are ordinary entries too; pin this test's and the plugin's order
    // around them without listing every built-in.
    let paths: Vec<&str> = all
        .iter()
        .copied()
        .filter(|p| !p.starts_with("kiln_runtime::"))
        .collect();
    assert_eq!(
        paths,
        [
            "kiln_test_plugin::PluginExperts", // prepend (ahead of the built-in BmmExperts)
            "kiln_test_plugin::PluginLinear",  // prepend
            "registry_rules::HighLinear",      // normal, priority 10
            "kiln_test_plugin::PluginRouter",  // normal, priority 0, by path
            "registry_rules::CrateArg",
            "registry_rules::NewMlp", // OldMlp is replaced
            "registry_rules::QuantProj",
            "registry_rules::LocalNorm",        // fallback, priority 5
            "kiln_test_plugin::PluginCatchAll", // fallback, priority 0
        ]
    );
    // Built-ins sort by path among the ordinary, priority-0 entries: after HighLinear, before
    // the plugin's.
    let pos = |p: &str| all.iter().position(|x| *x == p).unwrap();
    let quant_linear = pos("kiln_runtime::export::linear::QuantLinear");
    assert!(
        pos("registry_rules::HighLinear") < quant_linear
            && quant_linear < pos("kiln_test_plugin::PluginRouter")
            && pos("kiln_test_plugin::PluginExperts")
                < pos("kiln_runtime::export::experts::BmmExperts")
    );
    let high = &r.entries()[pos("registry_rules::HighLinear")];
    assert!(high.meta.location.file.ends_with("registry_rules.rs"));
    let attr = include_str!("registry_rules.rs")
        .lines()
        .position(|l| l.starts_with("struct HighLinear;"))
        .unwrap();
    assert_eq!(
        high.meta.location.line as usize, attr,
        "the line of the attribute, just above the struct"
    );
}

fn chain(classes: &[Class]) -> ClassChain {
    ClassChain::new(classes.iter().cloned())
}

fn weight() -> Vec<TensorInfo> {
    vec![TensorInfo {
        name: "weight".into(),
        shape: vec![4, 4],
        dtype: "BF16".into(),
    }]
}

fn demo_tree() -> ModuleTree {
    let mut t = ModuleTree::default();
    t.add("model", chain(&[Class::named("LlamaModel")]), vec![])
        .unwrap();
    t.add(
        "model.embed_tokens",
        chain(&[Class::of::<Embedding>()]),
        weight(),
    )
    .unwrap();
    t.add(
        "model.layers.0.self_attn.q_proj",
        chain(&[Class::named("QuantLinear")]),
        weight(),
    )
    .unwrap();
    t.add(
        "model.layers.0.self_attn.q_norm",
        chain(&[Class::named("Qwen3RMSNorm")]),
        weight(),
    )
    .unwrap();
    t.add(
        "model.layers.0.mlp",
        chain(&[Class::named("Qwen3MoeSparseMoeBlock")]),
        vec![],
    )
    .unwrap();
    t.add(
        "model.layers.0.mlp.gate",
        chain(&[Class::named("TopKRouter")]),
        weight(),
    )
    .unwrap();
    t.add(
        "model.layers.0.mlp.experts",
        chain(&[Class::named("GptOssExperts")]),
        weight(),
    )
    .unwrap();
    t.add(
        "model.layers.0.mlp.shared",
        chain(&[Class::named("Mlp")]),
        vec![],
    )
    .unwrap();
    t.add(
        "model.layers.0.rotary",
        chain(&[Class::named("Rotary")]),
        weight(),
    )
    .unwrap();
    t.add(
        "lm_head",
        chain(&[Class::named("QuantLinear"), Class::of::<Linear>()]),
        weight(),
    )
    .unwrap();
    t
}

fn exporter_of<'a>(report: &'a kiln::ExportReport, module: &str) -> Option<&'a str> {
    report
        .modules
        .iter()
        .find(|(m, _)| m == module)
        .and_then(|(_, o)| match o {
            ModuleOutcome::Exported { exporter, .. } => Some(exporter.as_str()),
            ModuleOutcome::Unchanged => None,
        })
}

#[test]
fn the_walk_prepares_moe_blocks_then_exports_each_module_with_its_first_match() {
    let r = ExporterRegistry::try_global().unwrap();
    let ctx = ExportContext::new();
    export::walk(&demo_tree(), r, &ctx).unwrap();
    let report = ctx.into_report();
    assert_eq!(
        report.moe_prepared,
        [(
            "model.layers.0.mlp".to_string(),
            "kiln_test_plugin::PluginExperts".to_string()
        )]
    );
    let expect = [
        ("", None),
        ("model", None),
        ("model.embed_tokens", Some("registry_rules::CrateArg")),
        (
            "model.layers.0.self_attn.q_proj",
            Some("registry_rules::QuantProj"),
        ),
        (
            "model.layers.0.self_attn.q_norm",
            Some("registry_rules::LocalNorm"),
        ),
        ("model.layers.0.mlp", None),
        (
            "model.layers.0.mlp.gate",
            Some("kiln_test_plugin::PluginRouter"),
        ),
        (
            "model.layers.0.mlp.experts",
            Some("kiln_test_plugin::PluginExperts"),
        ),
        ("model.layers.0.mlp.shared", Some("registry_rules::NewMlp")),
        (
            "model.layers.0.rotary",
            Some("kiln_test_plugin::PluginCatchAll"),
        ),
        ("lm_head", Some("kiln_test_plugin::PluginLinear")),
    ];
    for (module, exporter) in expect {
        assert_eq!(exporter_of(&report, module), exporter, "module `{module}`");
    }
    assert_eq!(
        report.modules.len(),
        demo_tree().len(),
        "every module is visited once"
    );
    // Hooks ran: the prepend exporter noted lm_head, the experts exporter its block.
    assert!(
        report
            .notes
            .contains(&("lm_head".into(), "PluginLinear".into()))
    );
    assert!(report.notes.contains(&(
        "model.layers.0.mlp".into(),
        "PluginExperts::prepare_moe_inputs".into()
    )));
    let by_reason = report
        .modules
        .iter()
        .find(|(m, _)| m == "model.layers.0.self_attn.q_proj")
        .unwrap();
    assert_eq!(
        by_reason.1,
        ModuleOutcome::Exported {
            exporter: "registry_rules::QuantProj".into(),
            reason: "key \"QuantLinear\" + predicate is_proj".into()
        }
    );
}

#[test]
fn an_moe_block_whose_experts_nobody_takes_is_an_error_naming_it() {
    let mut t = ModuleTree::default();
    t.add(
        "model.layers.3.mlp",
        chain(&[Class::named("MixtralSparseMoeBlock")]),
        vec![],
    )
    .unwrap();
    t.add(
        "model.layers.3.mlp.experts",
        chain(&[Class::named("ModuleList")]),
        vec![],
    )
    .unwrap();
    let err = export::walk(
        &t,
        ExporterRegistry::try_global().unwrap(),
        &ExportContext::new(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "MoE block `model.layers.3.mlp`: no exporter takes its experts container (class ModuleList); register one"
    );
}

// ---- trainers ----

static CONSTRUCTED: AtomicUsize = AtomicUsize::new(0);

macro_rules! test_trainers {
    ($($name:ident => $task:literal on $backend:literal),* $(,)?) => {$(
        #[trainer(task = $task, backend = $backend)]
        struct $name;
        impl Trainer for $name {
            fn new(_: &TrainConfig) -> Result<Self, TrainError> {
                CONSTRUCTED.fetch_add(1, Ordering::SeqCst);
                Ok($name)
            }
            fn train(&mut self, _: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
                Err(TrainError::Backend { backend: $backend.into(), message: "test trainer".into() })
            }
        }
    )*};
}

test_trainers! {
    CandlePrm => "prm" on "candle",
    MlxSft => "sft" on "mlx",
    MlxDpo => "dpo" on "mlx",
    MlxOrpo => "orpo" on "mlx",
    MlxSimpo => "simpo" on "mlx",
    MlxKto => "kto" on "mlx",
    MlxGrpo => "grpo" on "mlx",
}

fn cfg(task: &str, backend: &str) -> TrainConfig {
    TrainConfig::new(task, backend, "model", "out")
}

#[test]
fn routing_messages_are_exact() {
    assert_eq!(
        kiln::resolve_trainer(&cfg("prm", "mlx"))
            .unwrap_err()
            .to_string(),
        "backend 'mlx' does not support task 'prm'. Supported: dpo, grpo, kto, orpo, sft, simpo. \
         Use backend=candle for full task coverage."
    );
    let err = kiln::resolve_trainer(&cfg("sft", "burn")).unwrap_err();
    assert_eq!(
        err,
        RouteError::UnknownBackend {
            backend: "burn".into(),
            known: vec!["candle".into(), "mlx".into()]
        }
    );
    assert_eq!(
        err.to_string(),
        "unknown backend 'burn'. Known backends: candle, mlx."
    );
    assert_eq!(
        kiln::resolve_trainer(&cfg("sft", "candle"))
            .unwrap()
            .meta
            .path,
        "kiln_runtime::train::candle::sft::Trainer"
    );
    assert_eq!(
        kiln::resolve_trainer(&cfg("count", "candle"))
            .unwrap()
            .meta
            .path,
        "kiln_test_plugin::PluginSft"
    );
    assert_eq!(
        kiln::resolve_trainer(&cfg("grpo", "mlx"))
            .unwrap()
            .meta
            .path,
        "registry_rules::MlxGrpo"
    );
}

#[test]
fn trainers_are_constructed_only_after_resolution() {
    let registry = TrainerRegistry::try_global().unwrap();
    assert_eq!(registry.entries().len(), 21);
    let entry = kiln::resolve_trainer(&cfg("prm", "candle")).unwrap();
    let before = CONSTRUCTED.load(Ordering::SeqCst);
    let mut trainer = entry.construct(&cfg("prm", "candle")).unwrap();
    assert_eq!(CONSTRUCTED.load(Ordering::SeqCst), before + 1);
    let err = trainer.train(&mut kiln::train::NoopObserver).unwrap_err();
    assert_eq!(err.to_string(), "backend 'candle': test trainer");
}

/// Stops after two steps and records what it saw.
#[derive(Default)]
struct StopAfterTwo {
    steps: Vec<u64>,
}

impl TrainObserver for StopAfterTwo {
    fn on_step(&mut self, m: &StepMetrics) {
        self.steps.push(m.step);
    }
    fn should_stop(&mut self) -> bool {
        self.steps.len() >= 2
    }
}

#[test]
fn a_plugin_trainer_runs_with_progress_callbacks_and_can_be_stopped() {
    let mut config = cfg("count", "candle");
    let entry = kiln::resolve_trainer(&config).unwrap();
    let err = entry
        .construct(&config)
        .err()
        .expect("max_steps is required by PluginSft");
    assert_eq!(
        err.to_string(),
        "config field `hyper.max_steps`: PluginSft needs max_steps"
    );
    config.hyper.max_steps = Some(5);
    let mut observer = StopAfterTwo::default();
    let report = entry
        .construct(&config)
        .unwrap()
        .train(&mut observer)
        .unwrap();
    assert_eq!(observer.steps, [1, 2]);
    assert_eq!((report.steps, report.stopped_early), (2, true));
}

#[test]
fn train_config_reads_json_with_defaults_and_typed_task_options() {
    let config: TrainConfig = serde_json::from_str(
        r#"{"task":"dpo","model":"m","output":"o","hyper":{"learning_rate":1e-6},"task_options":{"beta":0.1,"loss_type":"sigmoid"}}"#,
    )
    .unwrap();
    assert_eq!(
        (config.backend.as_str(), config.device.as_str()),
        ("candle", "cpu")
    );
    assert_eq!(config.hyper.learning_rate, 1e-6);
    assert_eq!(config.hyper.per_device_train_batch_size, 8);
    assert_eq!(config.option::<f64>("beta").unwrap(), Some(0.1));
    assert_eq!(config.option::<f64>("missing").unwrap(), None);
    let err = config.option::<f64>("loss_type").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("config field `task_options.loss_type`:"),
        "{err}"
    );
    let bad =
        serde_json::from_str::<TrainConfig>(r#"{"task":"sft","model":"m","output":"o","lr":1}"#)
            .unwrap_err();
    assert!(bad.to_string().contains("unknown field `lr`"), "{bad}");
}

#[test]
fn a_writer_registered_in_another_crate_is_an_output_format() {
    let r = kiln::WriterRegistry::try_global().unwrap();
    assert_eq!(
        r.names(),
        [
            "bnb",
            "compressed-tensors",
            "gguf",
            "mlx",
            "modelopt",
            "plugin-manifest"
        ]
    );
    let entry = r.get("plugin-manifest").unwrap();
    assert_eq!(entry.meta.path, "kiln_test_plugin::PluginManifest");
    assert_eq!(entry.default_format(), Some("list"));
    // An export through it, with kiln's built-in exporters only (this binary's and the
    // plugin's own exporters write nothing): the walk hands it every Linear and tensor.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    kiln_runtime::demo::write_demo_model(&model, kiln_runtime::demo::DemoConfig::default())
        .unwrap();
    let mut builtins = kiln::RegistryBuilder::<kiln::ExporterEntry>::from_static().unwrap();
    let others: Vec<String> = builtins
        .entries()
        .iter()
        .map(|e| e.meta.path.to_string())
        .filter(|p| !p.starts_with("kiln_runtime::"))
        .collect();
    for p in &others {
        builtins.remove(p);
    }
    let options = export::ExportOptions {
        exporters: Some(std::sync::Arc::new(builtins.build().unwrap())),
        output: Some(kiln_runtime::export::run::OutputFormat {
            writer: "plugin-manifest".into(),
            format: "list".into(),
        }),
        ..export::ExportOptions::new(
            &model,
            tmp.path().join("out"),
            export::Recipe::new(kiln::Format::Nvfp4),
        )
    };
    let s = export::run(&options).unwrap();
    assert_eq!(s.files, ["manifest.txt"]);
    let manifest = std::fs::read_to_string(s.out.join("manifest.txt")).unwrap();
    assert!(
        manifest.starts_with("model.embed_tokens.weight Dtype(BF16) [4096, 512] 4194304\n"),
        "{manifest}"
    );
    assert!(manifest.contains("model.norm.weight Dtype(BF16) [512] 1024"));
    // Linears come through `linear`, in the checkpoint's dtype.
    assert!(
        manifest.contains("model.layers.0.self_attn.q_proj.weight Dtype(BF16) [512, 512] 524288")
    );
    assert_eq!(manifest.lines().count(), 39, "{manifest}");
    let e = entry.make("other").err().unwrap().to_string();
    assert_eq!(
        e,
        "the plugin-manifest writer has no format `other` (it writes: list)"
    );
}
