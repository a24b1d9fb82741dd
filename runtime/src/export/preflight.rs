//! The whole export checked before any work: every Linear the recipe quantizes against what
//! the output format can express of its shape (whole blocks or groups), so an export that
//! would fail on its first Linear fails before calibration starts — with every offending
//! module in one error and the fix (llm-compressor checks a scheme against every layer before
//! it calibrates, too).

use super::error::ExportError;
use super::run::{ExportOptions, module_tree};
use super::writer::OutputWriter;
use crate::checkpoint::Checkpoint;
use crate::export::writers::WriterRegistry;
use crate::module_tree::Linear;

/// One module the format cannot take: its path and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeProblem {
    /// The module path.
    pub module: String,
    /// The problem (`192 input features are not whole groups of 128`).
    pub what: String,
}

/// Every Linear `options` quantize whose shape the output format cannot express.
pub fn shape_problems(
    options: &ExportOptions,
    writer: &dyn OutputWriter,
) -> Result<Vec<ShapeProblem>, ExportError> {
    let checkpoint = Checkpoint::open(&options.model)?;
    let (tree, _, _) = module_tree(&checkpoint)?;
    let mut out = Vec::new();
    for m in tree.walk() {
        if !m.class_chain().is::<Linear>() || !options.recipe.quantizes(m.path()) {
            continue;
        }
        let Some(t) = checkpoint.tensor(&format!("{}.weight", m.path())) else {
            continue;
        };
        if let Some(what) = writer.check_linear(&t.shape) {
            out.push(ShapeProblem {
                module: m.path().to_string(),
                what,
            });
        }
    }
    Ok(out)
}

/// Checks the whole export of `options` before it starts (and before `--calib` runs): one
/// error naming every Linear the format cannot take, the `--exclude` that leaves them
/// unquantized, and the writer's formats that take every one of them.
pub fn preflight(options: &ExportOptions) -> Result<(), ExportError> {
    let (output, _, writer) = super::run::writer_of(options)?;
    let (writer_name, format) = (output.writer, output.format);
    let problems = shape_problems(options, writer.as_ref())?;
    if problems.is_empty() {
        return Ok(());
    }
    // The writer's other formats that take every offending shape.
    let registry =
        WriterRegistry::try_global().map_err(|e| ExportError::InvalidRegistry(e.clone()))?;
    let entry = registry.get(&writer_name)?;
    let checkpoint = Checkpoint::open(&options.model)?;
    let shapes: Vec<Vec<usize>> = problems
        .iter()
        .filter_map(|p| checkpoint.tensor(&format!("{}.weight", p.module)))
        .map(|t| t.shape.clone())
        .collect();
    let fits: Vec<String> = (entry.formats)()
        .iter()
        .filter(|(f, _)| *f != format)
        .filter_map(|(f, _)| {
            let mut w = entry.make(f).ok()?;
            let size = options.recipe.group_size;
            super::writer::configure(w.as_mut(), &writer_name, f, size).ok()?;
            Some((f, w))
        })
        .filter(|(_, w)| shapes.iter().all(|s| w.check_linear(s).is_none()))
        .map(|(f, _)| f.to_string())
        .collect();
    Err(ExportError::Plan {
        format: format!("{writer_name} {format}"),
        modules: problems.len(),
        problems: grouped(&problems),
        exclude: exclude_globs(&problems),
        fits,
    })
}

/// The problems, modules sharing a reason on one line: "`a`, `b`: why".
fn grouped(problems: &[ShapeProblem]) -> Vec<String> {
    let mut by_reason: Vec<(&str, Vec<&str>)> = Vec::new();
    for p in problems {
        match by_reason.iter_mut().find(|(w, _)| *w == p.what) {
            Some((_, ms)) => ms.push(&p.module),
            None => by_reason.push((&p.what, vec![&p.module])),
        }
    }
    by_reason
        .into_iter()
        .map(|(what, ms)| {
            let names: Vec<String> = ms.iter().map(|m| format!("`{m}`")).collect();
            format!("{} ({what})", names.join(", "))
        })
        .collect()
}

/// `--exclude` globs covering `problems`: a module name with its layer index replaced by `*`
/// where every layer's module of that name is affected, else the names themselves.
fn exclude_globs(problems: &[ShapeProblem]) -> Vec<String> {
    let mut globs: Vec<String> = Vec::new();
    for p in problems {
        let glob = match p.module.split_once(".layers.") {
            Some((head, rest)) => match rest.split_once('.') {
                Some((index, tail)) if index.parse::<usize>().is_ok() => {
                    format!("{head}.layers.*.{tail}")
                }
                _ => p.module.clone(),
            },
            None => p.module.clone(),
        };
        if !globs.contains(&glob) {
            globs.push(glob);
        }
    }
    globs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusions_cover_every_layer_by_name() {
        let p = |m: &str| ShapeProblem {
            module: m.into(),
            what: String::new(),
        };
        assert_eq!(
            exclude_globs(&[
                p("model.layers.0.self_attn.q_proj"),
                p("model.layers.1.self_attn.q_proj"),
                p("model.layers.0.mlp.down_proj"),
                p("lm_head"),
            ]),
            [
                "model.layers.*.self_attn.q_proj",
                "model.layers.*.mlp.down_proj",
                "lm_head"
            ]
        );
    }
}
