//! `kiln registry [exporters|trainers|architectures|rewards|writers] [--json]`.

use super::table;
use anyhow::Result;
use clap::{Args, ValueEnum};
use kiln_runtime::registry::{EntryMeta, RegistryError, collect};
use kiln_runtime::train::registry::BUILTIN_BACKENDS;
use kiln_runtime::{
    ArchitectureRegistry, ExporterRegistry, RewardRegistry, TrainerRegistry, WriterRegistry,
};
use serde_json::{Value, json};
use std::io::Write;

#[derive(Debug, Args)]
pub struct RegistryArgs {
    /// Which registry to list (all when omitted).
    kind: Option<Kind>,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    Exporters,
    Trainers,
    Architectures,
    Rewards,
    Writers,
}

/// Every validation error of the registries asked for.
#[derive(Debug)]
pub struct InvalidRegistries(Vec<RegistryError>);

impl std::fmt::Display for InvalidRegistries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|e| e.to_string()).collect();
        write!(f, "{}", parts.join("\n"))
    }
}

impl std::error::Error for InvalidRegistries {}

/// Validates every registry; every error at once.
pub fn validate_all() -> Result<(), InvalidRegistries> {
    let errors: Vec<RegistryError> = [
        ExporterRegistry::try_global().err(),
        TrainerRegistry::try_global().err(),
        ArchitectureRegistry::try_global().err(),
        RewardRegistry::try_global().err(),
        WriterRegistry::try_global().err(),
    ]
    .into_iter()
    .flatten()
    .cloned()
    .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(InvalidRegistries(errors))
    }
}

pub fn run(args: &RegistryArgs, out: &mut dyn Write) -> Result<i32> {
    let wants = |k: Kind| args.kind.is_none_or(|a| a == k);
    let mut errors = Vec::new();
    let exporters = wants(Kind::Exporters).then(ExporterRegistry::try_global);
    let trainers = wants(Kind::Trainers).then(TrainerRegistry::try_global);
    let architectures = wants(Kind::Architectures).then(ArchitectureRegistry::try_global);
    let rewards = wants(Kind::Rewards).then(RewardRegistry::try_global);
    let writers = wants(Kind::Writers).then(WriterRegistry::try_global);
    if let Some(Err(e)) = rewards {
        errors.push(e.clone());
    }
    if let Some(Err(e)) = writers {
        errors.push(e.clone());
    }
    if let Some(Err(e)) = exporters {
        errors.push(e.clone());
    }
    if let Some(Err(e)) = trainers {
        errors.push(e.clone());
    }
    if let Some(Err(e)) = architectures {
        errors.push(e.clone());
    }
    if !errors.is_empty() {
        return Err(InvalidRegistries(errors).into());
    }
    let exporters = exporters.and_then(Result::ok);
    let trainers = trainers.and_then(Result::ok);
    let architectures = architectures.and_then(Result::ok);
    let rewards = rewards.and_then(Result::ok);
    let writers = writers.and_then(Result::ok);

    if args.json {
        let mut doc = serde_json::Map::new();
        doc.insert("collection".into(), json!(collect::MECHANISM));
        if let Some(r) = exporters {
            doc.insert("exporters".into(), exporters_json(r));
        }
        if let Some(r) = trainers {
            doc.insert("trainers".into(), trainers_json(r));
        }
        if let Some(r) = architectures {
            doc.insert("architectures".into(), architectures_json(r));
        }
        if let Some(r) = rewards {
            let items = r.entries().iter().enumerate().map(|(i, e)| {
                let mut o = common_json(i, &e.meta);
                o.insert("name".into(), json!(e.name));
                Value::Object(o)
            });
            doc.insert("rewards".into(), Value::Array(items.collect()));
        }
        if let Some(r) = writers {
            let items = r.entries().iter().enumerate().map(|(i, e)| {
                let mut o = common_json(i, &e.meta);
                o.insert("name".into(), json!(e.name));
                let formats: Vec<Value> = (e.formats)()
                    .into_iter()
                    .map(|(f, d)| {
                        let engines = engines_of(e, f);
                        json!({"format": f, "description": d, "engines": engines_json(&engines)})
                    })
                    .collect();
                o.insert("formats".into(), Value::Array(formats));
                o.insert("reads_back".into(), json!(reads_back(&e.name)));
                Value::Object(o)
            });
            doc.insert("writers".into(), Value::Array(items.collect()));
        }
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&Value::Object(doc))?
        )?;
        return Ok(0);
    }

    let mut sections = Vec::new();
    if let Some(r) = exporters {
        sections.push(exporters_table(r));
    }
    if let Some(r) = trainers {
        sections.push(trainers_table(r));
    }
    if let Some(r) = architectures {
        sections.push(architectures_table(r));
    }
    if let Some(r) = rewards {
        sections.push(rewards_table(r));
    }
    if let Some(r) = writers {
        sections.push(writers_table(r));
        sections.push(formats_table(r));
    }
    write!(out, "{}", sections.join("\n"))?;
    Ok(0)
}

fn common_json(position: usize, m: &EntryMeta) -> serde_json::Map<String, Value> {
    let mut o = serde_json::Map::new();
    o.insert("position".into(), json!(position));
    o.insert("path".into(), json!(m.path));
    o.insert("tier".into(), json!(m.tier.as_str()));
    o.insert("priority".into(), json!(m.priority));
    o.insert("file".into(), json!(m.location.file));
    o.insert("line".into(), json!(m.location.line));
    o
}

fn exporters_json(r: &ExporterRegistry) -> Value {
    let items = r.entries().iter().enumerate().map(|(i, e)| {
        let mut o = common_json(i, &e.meta);
        let keys: Vec<Value> = e
            .keys
            .iter()
            .map(|k| match k {
                kiln_runtime::Key::Type { name, .. } => json!({"type": name}),
                kiln_runtime::Key::Name(n) => json!({"name": n}),
            })
            .collect();
        o.insert("keys".into(), Value::Array(keys));
        o.insert(
            "predicate".into(),
            json!(e.predicate.as_ref().map(|p| &p.name)),
        );
        Value::Object(o)
    });
    Value::Array(items.collect())
}

fn trainers_json(r: &TrainerRegistry) -> Value {
    let items = r.entries().iter().enumerate().map(|(i, e)| {
        let mut o = common_json(i, &e.meta);
        o.insert("task".into(), json!(e.task));
        o.insert("backend".into(), json!(e.backend));
        Value::Object(o)
    });
    Value::Array(items.collect())
}

fn architectures_json(r: &ArchitectureRegistry) -> Value {
    let items = r.entries().iter().enumerate().map(|(i, e)| {
        let mut o = common_json(i, &e.meta);
        o.insert("names".into(), json!(e.names));
        Value::Object(o)
    });
    Value::Array(items.collect())
}

fn source(m: &EntryMeta) -> String {
    m.location.to_string()
}

fn empty_note(kind: &str, n: usize) -> String {
    if n == 0 {
        format!(
            "  (none registered: a crate's {kind}s appear only when it is linked — \
             reference it with `use my_plugins as _;`)\n"
        )
    } else {
        String::new()
    }
}

fn exporters_table(r: &ExporterRegistry) -> String {
    let rows: Vec<Vec<String>> = r
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mut matches: Vec<String> = e.keys.iter().map(|k| k.describe()).collect();
            if let Some(p) = &e.predicate {
                let joined = if matches.is_empty() {
                    String::new()
                } else {
                    " + ".to_string()
                };
                let keys = matches.join(" | ");
                matches = vec![format!("{keys}{joined}predicate {}", p.name)];
            }
            vec![
                i.to_string(),
                e.meta.path.to_string(),
                matches.join(" | "),
                e.meta.tier.as_str().to_string(),
                e.meta.priority.to_string(),
                source(&e.meta),
            ]
        })
        .collect();
    format!(
        "exporters ({}, collected by {})\n{}{}",
        rows.len(),
        collect::MECHANISM,
        table::render(
            &["#", "exporter", "matches", "tier", "priority", "source"],
            &rows
        ),
        empty_note("exporter", rows.len())
    )
}

fn trainers_table(r: &TrainerRegistry) -> String {
    let rows: Vec<Vec<String>> = r
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            vec![
                i.to_string(),
                e.meta.path.to_string(),
                e.task.to_string(),
                e.backend.to_string(),
                e.meta.priority.to_string(),
                source(&e.meta),
            ]
        })
        .collect();
    let backends: Vec<String> = r
        .backends()
        .into_iter()
        .map(|b| {
            let tasks = r.tasks(&b);
            let built = BUILTIN_BACKENDS.iter().find(|i| i.name == b);
            let state = match built {
                Some(i) if !i.enabled => {
                    format!(" (not built: feature '{}')", i.feature.unwrap_or("?"))
                }
                _ => String::new(),
            };
            let tasks = if tasks.is_empty() {
                "no tasks".to_string()
            } else {
                tasks.join(", ")
            };
            format!("  backend {b}: {tasks}{state}\n")
        })
        .collect();
    format!(
        "trainers ({})\n{}{}{}",
        rows.len(),
        table::render(
            &["#", "trainer", "task", "backend", "priority", "source"],
            &rows
        ),
        empty_note("trainer", rows.len()),
        backends.concat()
    )
}

fn architectures_table(r: &ArchitectureRegistry) -> String {
    let rows: Vec<Vec<String>> = r
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let names: Vec<&str> = e.names.iter().map(|n| n.as_ref()).collect();
            vec![
                i.to_string(),
                e.meta.path.to_string(),
                if names.is_empty() {
                    "(any)".to_string()
                } else {
                    names.join(", ")
                },
                e.meta.tier.as_str().to_string(),
                e.meta.priority.to_string(),
                source(&e.meta),
            ]
        })
        .collect();
    format!(
        "architectures ({})\n{}{}",
        rows.len(),
        table::render(
            &["#", "architecture", "names", "tier", "priority", "source"],
            &rows
        ),
        empty_note("architecture", rows.len())
    )
}

fn rewards_table(r: &RewardRegistry) -> String {
    let rows: Vec<Vec<String>> = r
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            vec![
                i.to_string(),
                e.name.to_string(),
                e.meta.path.to_string(),
                source(&e.meta),
            ]
        })
        .collect();
    format!(
        "rewards ({})\n{}{}",
        rows.len(),
        table::render(&["#", "reward", "function", "source"], &rows),
        empty_note("reward", rows.len())
    )
}

/// What the writer says of its format's engines (nothing when it cannot be made).
fn engines_of(
    e: &kiln_runtime::WriterEntry,
    format: &str,
) -> Vec<kiln_runtime::export::engines::EngineSupport> {
    e.make(format).map(|w| w.engines()).unwrap_or_default()
}

fn engines_json(engines: &[kiln_runtime::export::engines::EngineSupport]) -> Value {
    use kiln_runtime::export::engines::Support;
    let items = engines.iter().map(|s| match s.support {
        Support::Loads => json!({"engine": s.engine, "loads": true}),
        Support::Refuses { instead } => {
            json!({"engine": s.engine, "loads": false, "instead": instead})
        }
        Support::Unsure => json!({"engine": s.engine, "loads": null}),
    });
    Value::Array(items.collect())
}

/// Each writer's formats with the engines that load them (docs/FORMATS.md §10).
fn formats_table(r: &WriterRegistry) -> String {
    let mut rows = Vec::new();
    for e in r.entries() {
        for (f, _) in (e.formats)() {
            rows.push(vec![
                e.name.to_string(),
                f.to_string(),
                kiln_runtime::export::engines::Line(&engines_of(e, f)).to_string(),
            ]);
        }
    }
    format!(
        "formats and the engines that load them (docs/FORMATS.md §10)\n{}",
        table::render(&["writer", "format", "engines"], &rows)
    )
}

/// Whether a reader is registered with the writer `name` (`kiln eval` and `kiln verify` read
/// its output through it).
fn reads_back(name: &str) -> bool {
    kiln_runtime::ReaderRegistry::try_global()
        .is_ok_and(|r| r.get(name).is_some_and(|e| e.construct.is_some()))
}

fn writers_table(r: &WriterRegistry) -> String {
    let rows: Vec<Vec<String>> = r
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let formats: Vec<&str> = (e.formats)().iter().map(|(f, _)| *f).collect();
            vec![
                i.to_string(),
                e.name.to_string(),
                formats.join(" "),
                if reads_back(&e.name) { "yes" } else { "no" }.to_string(),
                e.meta.path.to_string(),
                source(&e.meta),
            ]
        })
        .collect();
    format!(
        "writers ({}): --output-format, its --format names (the first is the default), and \
         whether kiln eval / verify read its output back\n{}{}",
        rows.len(),
        table::render(
            &["#", "writer", "formats", "reads", "type", "source"],
            &rows
        ),
        empty_note("writer", rows.len())
    )
}
