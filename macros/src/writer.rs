//! `#[writer(name = "...", reader = R)]`: one entry in the output-writer registry, and with
//! `reader` one in the format-reader registry under the same name and identity.

use crate::args::{ArgList, Common};
use crate::emit::{self, Kind};
use crate::item;
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};

const ALLOWED: &[&str] = &["name", "reader", "priority", "replaces", "crate"];

/// `[a-z][a-z0-9_-]*`: the form of `--output-format` names (`compressed-tensors`).
fn is_format_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some('a'..='z'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_' | '-'))
}

pub fn expand(args: TokenStream, input: TokenStream) -> syn::Result<TokenStream> {
    let target = item::parse("writer", input)?;
    let mut args = ArgList::parse("writer", args, ALLOWED)?;
    let common = Common::take(&mut args)?;
    let Some(name) = args.take_str("name")? else {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[writer] needs `name = \"...\"`: the `--output-format` it answers to, such as \
             `name = \"gguf\"`",
        ));
    };
    if !is_format_name(&name.value()) {
        return Err(syn::Error::new_spanned(
            &name,
            format!(
                "`name` must be a lowercase name ([a-z][a-z0-9_-]*); found {:?}",
                name.value()
            ),
        ));
    }
    let reader = args.take_path("reader")?;
    args.finish()?;
    let krate = &common.krate;
    let ident = &target.ident;
    let replaces = common
        .replaces
        .as_ref()
        .map(|p| (p, quote!(writer_type_id)));
    let meta = emit::meta(krate, ident, quote!(Normal), common.priority, replaces);
    let construct = quote_spanned!(ident.span()=> #krate::__private::boxed_writer::<#ident>);
    let formats = quote_spanned!(ident.span()=> #krate::__private::writer_formats::<#ident>);
    let entry = quote! {
        #krate::__private::WriterEntry {
            meta: #meta,
            name: #krate::__private::Cow::Borrowed(#name),
            formats: #formats,
            construct: #construct,
        }
    };
    let writer = emit::register(krate, Kind::Writer, entry);
    // Every writer has a reader entry (without a reader: `None`) under its identity, so a
    // writer that `replaces` another replaces its reader too, whether either has one.
    let construct = match &reader {
        Some(reader) => {
            quote_spanned!(syn::spanned::Spanned::span(reader)=> ::core::option::Option::Some(#krate::__private::boxed_reader::<#reader>))
        }
        None => quote!(::core::option::Option::None),
    };
    let entry = quote! {
        #krate::__private::ReaderEntry {
            meta: #meta,
            name: #krate::__private::Cow::Borrowed(#name),
            construct: #construct,
        }
    };
    let reader = emit::register(krate, Kind::Reader, entry);
    Ok(quote! { #writer #reader })
}
