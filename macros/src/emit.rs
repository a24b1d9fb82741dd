//! What every attribute emits: the item unchanged, plus one registry entry collected by
//! `linkme` (default) or `inventory` (feature `inventory`).

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::Path;

/// The registries; each names its entry type and its distributed slice.
#[derive(Clone, Copy)]
pub enum Kind {
    Exporter,
    Trainer,
    Architecture,
    Reward,
    Writer,
    Reader,
}

impl Kind {
    fn entry_type(self) -> &'static str {
        match self {
            Kind::Exporter => "ExporterEntry",
            Kind::Trainer => "TrainerEntry",
            Kind::Architecture => "ArchitectureEntry",
            Kind::Reward => "RewardEntry",
            Kind::Writer => "WriterEntry",
            Kind::Reader => "ReaderEntry",
        }
    }

    fn slice(self) -> &'static str {
        match self {
            Kind::Exporter => "EXPORTERS",
            Kind::Trainer => "TRAINERS",
            Kind::Architecture => "ARCHITECTURES",
            Kind::Reward => "REWARDS",
            Kind::Writer => "WRITERS",
            Kind::Reader => "READERS",
        }
    }
}

/// Wraps `entry` (an expression of the kind's entry type) in its collection mechanism.
/// Everything sits in an anonymous `const` so that two attributes never clash by name; a
/// type registered twice is then reported by the runtime's validation with both locations.
pub fn register(krate: &Path, kind: Kind, entry: TokenStream) -> TokenStream {
    let ty = format_ident!("{}", kind.entry_type());
    let collect = if cfg!(feature = "inventory") {
        quote! { #krate::__private::inventory::submit! { #entry } }
    } else {
        let slice = format_ident!("{}", kind.slice());
        quote! {
            #[#krate::__private::linkme::distributed_slice(#krate::__private::#slice)]
            #[linkme(crate = #krate::__private::linkme)]
            static ENTRY: #krate::__private::#ty = #entry;
        }
    };
    quote! {
        #[doc(hidden)]
        #[allow(non_upper_case_globals, clippy::all)]
        const _: () = { #collect };
    }
}

/// The `EntryMeta` expression shared by the three kinds. `line!()` keeps the call-site span:
/// the attribute's own line, which tells apart two attributes on one type.
pub fn meta(
    krate: &Path,
    ident: &syn::Ident,
    tier: TokenStream,
    priority: i32,
    replaces: Option<(&Path, TokenStream)>,
) -> TokenStream {
    let name = ident.to_string();
    let line = quote!(::core::line!());
    let replaces = match replaces {
        None => quote!(::core::option::Option::None),
        Some((path, assert_kind)) => {
            let written = quote!(#path).to_string().replace(' ', "");
            let id = quote_spanned!(path_span(path)=> #krate::__private::#assert_kind::<#path>);
            quote! {
                ::core::option::Option::Some(#krate::__private::Replaces {
                    type_id: #id,
                    written: #written,
                })
            }
        }
    };
    quote! {
        #krate::__private::EntryMeta {
            path: #krate::__private::Cow::Borrowed(
                ::core::concat!(::core::module_path!(), "::", #name)
            ),
            type_id: ::core::option::Option::Some(::core::any::TypeId::of::<#ident>),
            tier: #krate::__private::Tier::#tier,
            priority: #priority,
            replaces: #replaces,
            location: #krate::__private::SourceLocation { file: ::core::file!(), line: #line },
        }
    }
}

/// The span of a path, for errors about the type it names.
pub fn path_span(path: &Path) -> proc_macro2::Span {
    syn::spanned::Spanned::span(path)
}

/// Returns the item plus the entry, or the item plus the error (so the user sees only the
/// real mistake, not follow-on "cannot find type" errors).
pub fn finish(
    expanded: syn::Result<TokenStream>,
    input: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    let input = TokenStream::from(input);
    match expanded {
        Ok(entry) => quote!(#input #entry).into(),
        Err(e) => {
            let e = e.into_compile_error();
            quote!(#input #e).into()
        }
    }
}
