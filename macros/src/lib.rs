//! Attribute macros that register kiln exporters, trainers and model architectures at
//! compile time.
//!
//! Each macro validates its arguments and the annotated item, then emits one registry entry:
//! a `linkme` distributed-slice element, or an `inventory::submit!` when kiln is built with
//! the `inventory` feature. The runtime (`kiln-runtime`) sorts the entries once, at first use.
//! Use them through the `kiln` facade:
//!
//! ```ignore
//! use kiln::{exporter, ExportContext, ExportError, Linear, ModuleExporter, ModuleRef};
//!
//! #[exporter(keys = [Linear], prepend)]
//! struct MyLinear;
//!
//! impl ModuleExporter for MyLinear {
//!     fn export(&self, name: &str, m: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
//!         Ok(())
//!     }
//! }
//! ```

#![warn(missing_docs)]

mod architecture;
mod args;
mod emit;
mod exporter;
mod item;
mod reward;
mod trainer;
mod writer;

use proc_macro::TokenStream;

/// Registers a `ModuleExporter` type: `keys = [Type, "ClassName"]`, `predicate = path`,
/// `prepend` | `fallback`, `priority = N`, `replaces = path::Type`, `crate = path`.
#[proc_macro_attribute]
pub fn exporter(args: TokenStream, input: TokenStream) -> TokenStream {
    emit::finish(exporter::expand(args.into(), input.clone().into()), input)
}

/// Registers a `Trainer` type for one `(task, backend)`: `task = "sft"`, `backend = "candle"`,
/// `priority = N`, `replaces = path::Type`, `crate = path`.
#[proc_macro_attribute]
pub fn trainer(args: TokenStream, input: TokenStream) -> TokenStream {
    emit::finish(trainer::expand(args.into(), input.clone().into()), input)
}

/// Registers an `Architecture` (model family): `names = ["LlamaForCausalLM", ...]` and/or
/// `fallback`, `priority = N`, `replaces = path::Type`, `crate = path`.
#[proc_macro_attribute]
pub fn architecture(args: TokenStream, input: TokenStream) -> TokenStream {
    emit::finish(
        architecture::expand(args.into(), input.clone().into()),
        input,
    )
}

/// Registers a reward function for GRPO under `name = "..."` (`crate = path` as the others):
/// the function has the signature `fn(&RewardInput<'_>) -> Option<f64>`.
#[proc_macro_attribute]
pub fn reward(args: TokenStream, input: TokenStream) -> TokenStream {
    emit::finish(reward::expand(args.into(), input.clone().into()), input)
}

/// Registers an output writer (`OutputWriter` + `WriterType`) under the `--output-format` name
/// `name = "..."`; `priority = N`, `replaces = path::Type`, `crate = path` as the others.
#[proc_macro_attribute]
pub fn writer(args: TokenStream, input: TokenStream) -> TokenStream {
    emit::finish(writer::expand(args.into(), input.clone().into()), input)
}
