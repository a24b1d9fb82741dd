//! `#[architecture(names = [...])]`: one entry in the model-family registry.

use crate::args::{ArgList, Common};
use crate::emit::{self, Kind};
use crate::item;
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::{Expr, ExprLit, Lit};

const ALLOWED: &[&str] = &["names", "fallback", "priority", "replaces", "crate"];

pub fn expand(args: TokenStream, input: TokenStream) -> syn::Result<TokenStream> {
    let target = item::parse("architecture", input)?;
    let mut args = ArgList::parse("architecture", args, ALLOWED)?;
    let common = Common::take(&mut args)?;
    let names = args.take_list("names")?;
    let fallback = args.take_flag("fallback")?;
    args.finish()?;

    let names = match names {
        None if fallback.is_none() => {
            return Err(syn::Error::new(
                Span::call_site(),
                "#[architecture] needs `names = [\"...ForCausalLM\"]` (the `architectures` \
                 entries of config.json it builds), or `fallback` for a generic builder",
            ));
        }
        None => Vec::new(),
        Some((span, elems)) if elems.is_empty() => {
            return Err(syn::Error::new(
                span,
                "`names` is empty: list at least one architecture name",
            ));
        }
        Some((_, elems)) => elems
            .into_iter()
            .map(|e| match e {
                Expr::Lit(ExprLit {
                    lit: Lit::Str(s), ..
                }) if !s.value().is_empty() => Ok(s),
                other => Err(syn::Error::new_spanned(
                    other,
                    "an architecture name is a non-empty string literal, such as \
                     \"LlamaForCausalLM\"",
                )),
            })
            .collect::<syn::Result<Vec<_>>>()?,
    };

    let krate = &common.krate;
    let ident = &target.ident;
    let tier = if fallback.is_some() {
        quote!(Fallback)
    } else {
        quote!(Normal)
    };
    let replaces = common
        .replaces
        .as_ref()
        .map(|p| (p, quote!(architecture_type_id)));
    let meta = emit::meta(krate, ident, tier, common.priority, replaces);
    let value = if target.is_unit {
        quote!(#ident)
    } else {
        quote!(<#ident as ::core::default::Default>::default())
    };
    let construct = quote_spanned! {ident.span()=>
        || #krate::__private::boxed_architecture::<#ident>(#value)
    };
    let names = names
        .iter()
        .map(|n| quote!(#krate::__private::Cow::Borrowed(#n)));
    let entry = quote! {
        #krate::__private::ArchitectureEntry {
            meta: #meta,
            names: #krate::__private::Cow::Borrowed(&[#(#names),*]),
            construct: #construct,
        }
    };
    Ok(emit::register(krate, Kind::Architecture, entry))
}
