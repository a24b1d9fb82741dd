//! `#[exporter(...)]`: one entry in the exporter registry.

use crate::args::{ArgList, Common};
use crate::emit::{self, Kind};
use crate::item;
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, Lit, Path};

const ALLOWED: &[&str] = &[
    "keys",
    "predicate",
    "prepend",
    "fallback",
    "priority",
    "replaces",
    "crate",
];

/// A match key: a type (matched by `TypeId`) or a class name.
enum Key {
    Type(Path),
    Name(syn::LitStr),
}

pub fn expand(args: TokenStream, input: TokenStream) -> syn::Result<TokenStream> {
    let target = item::parse("exporter", input)?;
    let mut args = ArgList::parse("exporter", args, ALLOWED)?;
    let common = Common::take(&mut args)?;
    let keys = args.take_list("keys")?;
    let predicate = args.take_path("predicate")?;
    let prepend = args.take_flag("prepend")?;
    let fallback = args.take_flag("fallback")?;
    args.finish()?;

    if let (Some(_), Some(f)) = (&prepend, &fallback) {
        return Err(syn::Error::new_spanned(
            f,
            "`prepend` and `fallback` are mutually exclusive: an exporter is either ahead of \
             the built-ins or behind everything",
        ));
    }
    let keys = match keys {
        None => None,
        Some((span, elems)) => Some(parse_keys(span, elems)?),
    };
    if keys.is_none() && predicate.is_none() {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[exporter] needs `keys = [...]`, `predicate = path`, or both: with neither it \
             would match nothing",
        ));
    }

    let krate = &common.krate;
    let ident = &target.ident;
    let tier = match (&prepend, &fallback) {
        (Some(_), _) => quote!(Prepend),
        (_, Some(_)) => quote!(Fallback),
        _ => quote!(Normal),
    };
    let replaces = common
        .replaces
        .as_ref()
        .map(|p| (p, quote!(exporter_type_id)));
    let meta = emit::meta(krate, ident, tier, common.priority, replaces);
    let keys = keys.unwrap_or_default().into_iter().map(|k| match k {
        Key::Type(path) => quote_spanned! {path.span()=>
            #krate::__private::Key::of_class::<#path>()
        },
        Key::Name(s) => quote! { #krate::__private::Key::name(#s) },
    });
    let predicate = match &predicate {
        None => quote!(::core::option::Option::None),
        Some(path) => {
            let name = quote!(#path).to_string().replace(' ', "");
            let func = quote_spanned! {path.span()=>
                { let f: #krate::__private::PredicateFn = #path; f }
            };
            quote! {
                ::core::option::Option::Some(#krate::__private::Predicate {
                    func: #func,
                    name: #krate::__private::Cow::Borrowed(#name),
                })
            }
        }
    };
    let value = if target.is_unit {
        quote!(#ident)
    } else {
        quote!(<#ident as ::core::default::Default>::default())
    };
    let construct = quote_spanned! {ident.span()=>
        || #krate::__private::boxed_exporter::<#ident>(#value)
    };
    let entry = quote! {
        #krate::__private::ExporterEntry {
            meta: #meta,
            keys: #krate::__private::Cow::Borrowed(&[#(#keys),*]),
            predicate: #predicate,
            construct: #construct,
        }
    };
    Ok(emit::register(krate, Kind::Exporter, entry))
}

fn parse_keys(list_span: Span, elems: Vec<Expr>) -> syn::Result<Vec<Key>> {
    if elems.is_empty() {
        return Err(syn::Error::new(
            list_span,
            "`keys` is empty: name at least one type or class-name string, or drop `keys` and \
             use `predicate`",
        ));
    }
    elems
        .into_iter()
        .map(|e| match e {
            Expr::Path(p) if p.qself.is_none() => Ok(Key::Type(p.path)),
            Expr::Lit(ExprLit {
                lit: Lit::Str(s), ..
            }) => {
                if s.value().is_empty() {
                    Err(syn::Error::new_spanned(
                        s,
                        "a class-name key cannot be empty",
                    ))
                } else {
                    Ok(Key::Name(s))
                }
            }
            other => Err(syn::Error::new_spanned(
                other,
                "a key is a type path (`Linear`, matched by type) or a string literal \
                 (`\"GptOssExperts\"`, matched by class name)",
            )),
        })
        .collect()
}
