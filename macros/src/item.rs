//! The annotated item: kiln registers concrete, non-generic structs only.

use proc_macro2::TokenStream;
use syn::{Fields, Ident, Item, ItemStruct};

/// A struct that may be registered.
pub struct Target {
    pub ident: Ident,
    /// A unit struct is constructed by name; any other struct through `Default`.
    pub is_unit: bool,
}

/// Parses the annotated item and checks that it is a non-generic struct.
pub fn parse(attr: &str, input: TokenStream) -> syn::Result<Target> {
    let item: Item = syn::parse2(input)?;
    let what = match &item {
        Item::Struct(s) => return check_struct(attr, s),
        Item::Enum(e) => syn::Error::new_spanned(
            e.enum_token,
            format!("#[{attr}] applies to a struct, not an enum: put the enum inside a struct"),
        ),
        Item::Fn(f) => syn::Error::new_spanned(
            f.sig.fn_token,
            format!(
                "#[{attr}] applies to a struct, not a function: implement the trait on a struct"
            ),
        ),
        other => syn::Error::new_spanned(other, format!("#[{attr}] applies to a struct")),
    };
    Err(what)
}

fn check_struct(attr: &str, s: &ItemStruct) -> syn::Result<Target> {
    if !s.generics.params.is_empty() || s.generics.where_clause.is_some() {
        return Err(syn::Error::new_spanned(
            &s.generics,
            format!(
                "#[{attr}] cannot be applied to a generic struct: a registry entry names one \
                 concrete type; register a non-generic wrapper instead"
            ),
        ));
    }
    Ok(Target {
        ident: s.ident.clone(),
        is_unit: matches!(s.fields, Fields::Unit),
    })
}
