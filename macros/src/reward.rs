//! `#[reward(name = "...")]` on a function: one entry in the reward registry.

use crate::args::{self, ArgList};
use crate::emit::{self, Kind};
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::{Item, Path};

const ALLOWED: &[&str] = &["name", "crate"];

pub fn expand(args: TokenStream, input: TokenStream) -> syn::Result<TokenStream> {
    let item: Item = syn::parse2(input)?;
    let Item::Fn(f) = item else {
        return Err(syn::Error::new_spanned(
            item,
            "#[reward] applies to a function `fn(&RewardInput<'_>) -> Option<f64>`",
        ));
    };
    if !f.sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &f.sig.generics,
            "#[reward] cannot be applied to a generic function",
        ));
    }
    let mut args = ArgList::parse("reward", args, ALLOWED)?;
    let krate: Path = args
        .take_path("crate")?
        .unwrap_or_else(|| syn::parse_quote!(::kiln));
    let Some(name) = args.take_str("name")? else {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[reward] needs `name = \"...\"`, such as `name = \"exact_match\"`",
        ));
    };
    if !args::is_lowercase_identifier(&name.value()) {
        return Err(syn::Error::new_spanned(
            &name,
            format!(
                "`name` must be a lowercase identifier ([a-z][a-z0-9_]*); found {:?}",
                name.value()
            ),
        ));
    }
    args.finish()?;
    let ident = &f.sig.ident;
    let fn_name = ident.to_string();
    let func = quote_spanned!(ident.span()=> #ident as #krate::__private::RewardFn);
    let entry = quote! {
        #krate::__private::RewardEntry {
            meta: #krate::__private::EntryMeta {
                path: #krate::__private::Cow::Borrowed(
                    ::core::concat!(::core::module_path!(), "::", #fn_name)
                ),
                type_id: ::core::option::Option::None,
                tier: #krate::__private::Tier::Normal,
                priority: 0,
                replaces: ::core::option::Option::None,
                location: #krate::__private::SourceLocation {
                    file: ::core::file!(),
                    line: ::core::line!(),
                },
            },
            name: #krate::__private::Cow::Borrowed(#name),
            func: #func,
        }
    };
    Ok(emit::register(&krate, Kind::Reward, entry))
}
