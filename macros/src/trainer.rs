//! `#[trainer(task = "...", backend = "...")]`: one entry in the trainer registry.

use crate::args::{self, ArgList, Common};
use crate::emit::{self, Kind};
use crate::item;
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::LitStr;

const ALLOWED: &[&str] = &["task", "backend", "priority", "replaces", "crate"];

pub fn expand(args: TokenStream, input: TokenStream) -> syn::Result<TokenStream> {
    let target = item::parse("trainer", input)?;
    let mut args = ArgList::parse("trainer", args, ALLOWED)?;
    let common = Common::take(&mut args)?;
    let task = required_name(args.take_str("task")?, "task", "\"sft\"")?;
    let backend = required_name(args.take_str("backend")?, "backend", "\"candle\"")?;
    args.finish()?;

    let krate = &common.krate;
    let ident = &target.ident;
    let replaces = common
        .replaces
        .as_ref()
        .map(|p| (p, quote!(trainer_type_id)));
    let meta = emit::meta(krate, ident, quote!(Normal), common.priority, replaces);
    let construct = quote_spanned!(ident.span()=> #krate::__private::boxed_trainer::<#ident>);
    let entry = quote! {
        #krate::__private::TrainerEntry {
            meta: #meta,
            task: #krate::__private::Cow::Borrowed(#task),
            backend: #krate::__private::Cow::Borrowed(#backend),
            construct: #construct,
        }
    };
    Ok(emit::register(krate, Kind::Trainer, entry))
}

fn required_name(value: Option<LitStr>, field: &str, example: &str) -> syn::Result<LitStr> {
    let Some(lit) = value else {
        return Err(syn::Error::new(
            Span::call_site(),
            format!("#[trainer] needs `{field} = {example}`"),
        ));
    };
    if !args::is_lowercase_identifier(&lit.value()) {
        return Err(syn::Error::new_spanned(
            &lit,
            format!(
                "`{field}` must be a lowercase identifier ([a-z][a-z0-9_]*), such as {example}; \
                 found {:?}",
                lit.value()
            ),
        ));
    }
    Ok(lit)
}
