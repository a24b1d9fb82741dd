//! A program whose registries are invalid: startup validation reports every problem with
//! both source locations, and `kiln registry` prints them and exits with code 2.

use kiln::{
    ModuleExporter, TrainConfig, TrainError, TrainObserver, TrainReport, Trainer, TrainerRegistry,
    exporter, trainer,
};

macro_rules! stub_trainer {
    ($name:ident) => {
        impl Trainer for $name {
            fn new(_: &TrainConfig) -> Result<Self, TrainError> {
                Ok($name)
            }
            fn train(&mut self, _: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
                unreachable!("never trained")
            }
        }
    };
}

#[trainer(task = "tune", backend = "candle")]
struct FirstSft;
stub_trainer!(FirstSft);

#[trainer(task = "tune", backend = "candle")]
struct SecondSft;
stub_trainer!(SecondSft);

/// Implements `Trainer` but is never registered.
struct Unregistered;
stub_trainer!(Unregistered);

#[trainer(task = "align", backend = "candle", replaces = Unregistered)]
struct ReplacesNothing;
stub_trainer!(ReplacesNothing);

#[exporter(keys = ["Linear"])]
#[exporter(keys = ["Linear"])]
struct Twice;
impl ModuleExporter for Twice {}

fn this_file() -> &'static str {
    file!()
}

/// The line number of the first line of this file that contains `needle`.
fn line_of(needle: &str) -> usize {
    include_str!("invalid_registry.rs")
        .lines()
        .position(|l| l.contains(needle))
        .expect("needle in file")
        + 1
}

/// The line of the attribute right above `struct <name>`, `back` lines up.
fn attr_line(name: &str, back: usize) -> usize {
    line_of(&format!("struct {name};")) - back
}

#[test]
fn trainer_validation_reports_every_problem_with_locations() {
    let err = TrainerRegistry::try_global().unwrap_err();
    let text = err.to_string();
    let f = this_file();
    assert!(text.starts_with("invalid trainer registry:"), "{text}");
    assert!(
        text.contains(&format!(
            "two trainers for task 'tune' on backend 'candle': `invalid_registry::FirstSft` ({f}:{}) and \
             `invalid_registry::SecondSft` ({f}:{})",
            attr_line("FirstSft", 1),
            attr_line("SecondSft", 1)
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "trainer `invalid_registry::ReplacesNothing` ({f}:{}) replaces `Unregistered`, but no trainer is \
             registered for that type",
            attr_line("ReplacesNothing", 1)
        )),
        "{text}"
    );
    assert_eq!(err.issues.len(), 2);
    // Routing surfaces the same error instead of guessing.
    let route = kiln::resolve_trainer(&TrainConfig::new("tune", "candle", "m", "o")).unwrap_err();
    assert_eq!(route.to_string(), text);
}

#[test]
fn a_type_registered_twice_is_a_duplicate_identity_with_both_locations() {
    let err = kiln::ExporterRegistry::try_global().unwrap_err();
    let f = this_file();
    assert_eq!(
        err.to_string(),
        format!(
            "invalid exporter registry:\n  - exporter `invalid_registry::Twice` is registered twice: at {f}:{} and at {f}:{}",
            attr_line("Twice", 2),
            attr_line("Twice", 1)
        )
    );
}

#[test]
fn kiln_registry_prints_the_errors_and_exits_2() {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = kiln::cli::run(["kiln", "registry"], &mut out, &mut err);
    let err = String::from_utf8(err).unwrap();
    assert_eq!(code, 2, "stderr: {err}");
    assert!(out.is_empty());
    assert!(
        err.contains("invalid exporter registry") && err.contains("invalid trainer registry"),
        "{err}"
    );
    assert!(
        err.contains(&format!("{}:{}", this_file(), attr_line("FirstSft", 1))),
        "{err}"
    );

    // The architecture registry alone is valid: kiln's built-in families are listed.
    let (mut out, mut err) = (Vec::new(), Vec::new());
    assert_eq!(
        kiln::cli::run(["kiln", "registry", "architectures"], &mut out, &mut err),
        0
    );
    let out = String::from_utf8(out).unwrap();
    assert!(
        out.starts_with("architectures (8)") && out.contains("LlamaForCausalLM"),
        "{out}"
    );
}

#[test]
fn every_command_exits_2_on_an_invalid_registry() {
    for args in [
        &["kiln", "export", "--format", "fp8"][..],
        &["kiln", "explain"],
        &["kiln", "demo-model", "--out", "/nonexistent/never-written"],
    ] {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = kiln::cli::run(args, &mut out, &mut err);
        let err = String::from_utf8(err).unwrap();
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.starts_with("error: invalid exporter registry")
                && err.contains("invalid trainer registry"),
            "{args:?}: {err}"
        );
    }
}
