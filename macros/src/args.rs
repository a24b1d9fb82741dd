//! The argument list shared by every kiln attribute: `name`, `name = value`, comma-separated.
//!
//! Parsing only splits the list; each attribute then takes the arguments it allows through
//! [`ArgList::take_*`], so every misuse is reported at the offending token.

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, ExprUnary, Ident, Lit, LitStr, Path, Token, UnOp};

/// One `name` or `name = value` argument.
pub struct Arg {
    pub name: Ident,
    pub value: Option<Value>,
}

/// The value of an argument: `crate = ...` is a module path, everything else an expression.
pub enum Value {
    Path(Path),
    Expr(Expr),
}

impl Parse for Arg {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        // `crate` is a keyword; accept it (and any other keyword) as an argument name.
        let name = Ident::parse_any(input)?;
        if !input.peek(Token![=]) {
            return Ok(Arg { name, value: None });
        }
        input.parse::<Token![=]>()?;
        let value = if name == "crate" {
            Value::Path(Path::parse_mod_style(input)?)
        } else {
            Value::Expr(ungroup(input.parse()?))
        };
        Ok(Arg {
            name,
            value: Some(value),
        })
    }
}

/// The arguments of one attribute, consumed one by one by the attribute's expander.
pub struct ArgList {
    attr: &'static str,
    args: Vec<Arg>,
}

impl ArgList {
    /// Parses `tokens` and rejects unknown (with the nearest allowed name) and duplicate names.
    pub fn parse(attr: &'static str, tokens: TokenStream, allowed: &[&str]) -> syn::Result<Self> {
        let args = Punctuated::<Arg, Token![,]>::parse_terminated.parse2(tokens)?;
        let mut seen: Vec<&Ident> = Vec::new();
        for arg in &args {
            let name = arg.name.to_string();
            if !allowed.contains(&name.as_str()) {
                return Err(unknown_argument(attr, &arg.name, allowed));
            }
            if seen.iter().any(|s| **s == arg.name) {
                return Err(syn::Error::new_spanned(
                    &arg.name,
                    format!("duplicate argument `{name}` in #[{attr}]"),
                ));
            }
            seen.push(&arg.name);
        }
        Ok(ArgList {
            attr,
            args: args.into_iter().collect(),
        })
    }

    fn take(&mut self, name: &str) -> Option<Arg> {
        let at = self.args.iter().position(|a| a.name == name)?;
        Some(self.args.remove(at))
    }

    /// A bare flag such as `prepend`; `prepend = ...` is an error.
    pub fn take_flag(&mut self, name: &str) -> syn::Result<Option<Ident>> {
        match self.take(name) {
            None => Ok(None),
            Some(Arg { name, value: None }) => Ok(Some(name)),
            Some(Arg {
                name,
                value: Some(v),
            }) => Err(syn::Error::new(
                value_span(&v),
                format!("`{name}` is a flag and takes no value: write `{name}` alone"),
            )),
        }
    }

    /// `name = value`; a bare `name` is an error.
    fn take_value(&mut self, name: &str, form: &str) -> syn::Result<Option<(Ident, Value)>> {
        match self.take(name) {
            None => Ok(None),
            Some(Arg {
                name,
                value: Some(v),
            }) => Ok(Some((name, v))),
            Some(Arg { name, value: None }) => Err(syn::Error::new_spanned(
                &name,
                format!("`{name}` needs a value: `{name} = {form}`"),
            )),
        }
    }

    /// `name = path::to::item`.
    pub fn take_path(&mut self, name: &str) -> syn::Result<Option<Path>> {
        let Some((ident, value)) = self.take_value(name, "path::to::Item")? else {
            return Ok(None);
        };
        match value {
            Value::Path(p) => Ok(Some(p)),
            Value::Expr(Expr::Path(p)) if p.qself.is_none() => Ok(Some(p.path)),
            Value::Expr(e) => Err(syn::Error::new_spanned(
                e,
                format!("`{ident}` takes a path, such as `{ident} = my_crate::Item`"),
            )),
        }
    }

    /// `name = "string"`.
    pub fn take_str(&mut self, name: &str) -> syn::Result<Option<LitStr>> {
        let Some((ident, value)) = self.take_value(name, "\"...\"")? else {
            return Ok(None);
        };
        match value {
            Value::Expr(Expr::Lit(ExprLit {
                lit: Lit::Str(s), ..
            })) => Ok(Some(s)),
            v => Err(syn::Error::new(
                value_span(&v),
                format!("`{ident}` takes a string literal, such as `{ident} = \"sft\"`"),
            )),
        }
    }

    /// `name = <i32>` (negative values allowed).
    pub fn take_i32(&mut self, name: &str) -> syn::Result<Option<i32>> {
        let Some((ident, value)) = self.take_value(name, "0")? else {
            return Ok(None);
        };
        let (negative, lit) = match &value {
            Value::Expr(Expr::Lit(ExprLit {
                lit: Lit::Int(i), ..
            })) => (false, i),
            Value::Expr(Expr::Unary(ExprUnary {
                op: UnOp::Neg(_),
                expr,
                ..
            })) => match &**expr {
                Expr::Lit(ExprLit {
                    lit: Lit::Int(i), ..
                }) => (true, i),
                _ => return Err(not_an_i32(&ident, &value)),
            },
            _ => return Err(not_an_i32(&ident, &value)),
        };
        let magnitude: i64 = lit.base10_parse().map_err(|_| not_an_i32(&ident, &value))?;
        i32::try_from(if negative { -magnitude } else { magnitude })
            .map(Some)
            .map_err(|_| not_an_i32(&ident, &value))
    }

    /// `name = [a, b, ...]`: the elements, and the span of the list for "empty" errors.
    pub fn take_list(&mut self, name: &str) -> syn::Result<Option<(Span, Vec<Expr>)>> {
        let Some((ident, value)) = self.take_value(name, "[...]")? else {
            return Ok(None);
        };
        match value {
            Value::Expr(Expr::Array(a)) => Ok(Some((a.span(), a.elems.into_iter().collect()))),
            v => Err(syn::Error::new(
                value_span(&v),
                format!("`{ident}` takes a list in brackets, such as `{ident} = [...]`"),
            )),
        }
    }

    /// Errors for any argument the expander did not take (a bug guard: `parse` already
    /// rejected names outside `allowed`).
    pub fn finish(self) -> syn::Result<()> {
        match self.args.first() {
            None => Ok(()),
            Some(arg) => Err(syn::Error::new_spanned(
                &arg.name,
                format!("argument `{}` is not used by #[{}]", arg.name, self.attr),
            )),
        }
    }
}

/// Removes the invisible groups `macro_rules!` puts around `$x:literal` / `$x:path`, so a
/// registration generated by a user's macro parses like a hand-written one.
fn ungroup(e: Expr) -> Expr {
    match e {
        Expr::Group(g) => ungroup(*g.expr),
        Expr::Array(mut a) => {
            a.elems = a.elems.into_iter().map(ungroup).collect();
            Expr::Array(a)
        }
        other => other,
    }
}

fn value_span(v: &Value) -> Span {
    match v {
        Value::Path(p) => p.span(),
        Value::Expr(e) => e.span(),
    }
}

fn not_an_i32(name: &Ident, value: &Value) -> syn::Error {
    syn::Error::new(
        value_span(value),
        format!("`{name}` takes an integer literal in the i32 range, such as `{name} = 10`"),
    )
}

fn unknown_argument(attr: &str, name: &Ident, allowed: &[&str]) -> syn::Error {
    let written = name.to_string();
    // Jaro-Winkler favours shared prefixes, so abbreviations (`prio`) and typos both find
    // their argument; unrelated words (`colour`) stay below the bar.
    let nearest = allowed
        .iter()
        .map(|a| (strsim::jaro_winkler(&written, a), *a))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|x, y| x.0.total_cmp(&y.0));
    let list = allowed.join(", ");
    let msg = match nearest {
        Some((_, a)) => {
            format!(
                "unknown argument `{written}` in #[{attr}]; did you mean `{a}`? (allowed: {list})"
            )
        }
        None => format!("unknown argument `{written}` in #[{attr}] (allowed: {list})"),
    };
    syn::Error::new_spanned(name, msg)
}

/// The arguments every attribute takes: ordering and the path to kiln.
pub struct Common {
    /// The path under which kiln's `__private` module lives (`::kiln` unless `crate = ...`).
    pub krate: Path,
    pub priority: i32,
    pub replaces: Option<Path>,
}

impl Common {
    pub fn take(args: &mut ArgList) -> syn::Result<Self> {
        Ok(Common {
            krate: args
                .take_path("crate")?
                .unwrap_or_else(|| syn::parse_quote!(::kiln)),
            priority: args.take_i32("priority")?.unwrap_or(0),
            replaces: args.take_path("replaces")?,
        })
    }
}

/// `[a-z][a-z0-9_]*`: the form of task and backend names.
pub fn is_lowercase_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some('a'..='z'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
}
