//! The one glob matcher kiln reads module-name patterns with (`--exclude`, `--include`,
//! `--lora-target-modules`, the checkers of `exclude_modules`): shell-style, over the whole
//! name — `*` any run of characters (dots included: module paths have no `/`), `?` exactly one
//! character, `[abc]` / `[a-z]` one character of the class, `[!abc]` one not in it. A `[` with
//! no closing `]` is a literal `[`.

/// One element of a parsed pattern.
#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// A literal character.
    Char(char),
    /// `?`.
    Any,
    /// `*`.
    Star,
    /// `[...]`: ranges (single characters are `(c, c)`), negated or not.
    Class(Vec<(char, char)>, bool),
}

fn parse(pattern: &str) -> Vec<Token> {
    let p: Vec<char> = pattern.chars().collect();
    let mut out = Vec::with_capacity(p.len());
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            '*' => out.push(Token::Star),
            '?' => out.push(Token::Any),
            '[' => {
                let mut j = i + 1;
                let negated = j < p.len() && p[j] == '!';
                if negated {
                    j += 1;
                }
                let start = j;
                // A `]` right after `[` (or `[!`) is a member, as in the shell.
                if j < p.len() && p[j] == ']' {
                    j += 1;
                }
                while j < p.len() && p[j] != ']' {
                    j += 1;
                }
                if j >= p.len() {
                    out.push(Token::Char('['));
                } else {
                    let body = &p[start..j];
                    let mut ranges = Vec::new();
                    let mut k = 0;
                    while k < body.len() {
                        if k + 2 < body.len() && body[k + 1] == '-' {
                            ranges.push((body[k], body[k + 2]));
                            k += 3;
                        } else {
                            ranges.push((body[k], body[k]));
                            k += 1;
                        }
                    }
                    out.push(Token::Class(ranges, negated));
                    i = j;
                }
            }
            c => out.push(Token::Char(c)),
        }
        i += 1;
    }
    out
}

fn one(t: &Token, c: char) -> bool {
    match t {
        Token::Char(x) => *x == c,
        Token::Any => true,
        Token::Star => false,
        Token::Class(ranges, negated) => {
            ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated
        }
    }
}

/// Whether `name` matches `pattern` as a whole.
pub fn matches(pattern: &str, name: &str) -> bool {
    let p = parse(pattern);
    let n: Vec<char> = name.chars().collect();
    // Greedy with one backtrack point: the last `*` seen.
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && p[pi] != Token::Star && one(&p[pi], n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == Token::Star {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|t| *t == Token::Star)
}

/// Whether `pattern` has any glob syntax (else it is a plain name).
pub fn is_pattern(pattern: &str) -> bool {
    pattern.contains(['*', '?', '['])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stars_questions_and_classes_on_module_names() {
        let m = "model.layers.12.self_attn.q_proj";
        assert!(matches("model.layers.*.self_attn.q_proj", m));
        assert!(matches("*q_proj", m));
        assert!(matches("*", m));
        assert!(!matches("*k_proj", m));
        // `*` spans dots.
        assert!(matches("model.*.q_proj", m));
        // `?` is exactly one character.
        assert!(matches("model.layers.1?.self_attn.q_proj", m));
        assert!(!matches("model.layers.1?.*", "model.layers.1.mlp"));
        assert!(!matches("model.layers.?.self_attn.q_proj", m));
        // Classes, ranges, negation.
        assert!(matches("*.[qkv]_proj", m));
        assert!(!matches("*.[kv]_proj", m));
        assert!(matches("model.layers.1[0-3].*", m));
        assert!(!matches("model.layers.1[3-9].*", m));
        assert!(matches("*.[!kv]_proj", m));
        assert!(!matches("*.[!q]_proj", m));
        // An unclosed `[` is literal.
        assert!(matches("a[b", "a[b"));
        assert!(!matches("a[b", "ab"));
        // The whole name, not a part.
        assert!(!matches("self_attn", m));
        assert!(matches("", ""));
        assert!(!matches("", "x"));
    }

    /// A readable reference: the same pattern language by recursion.
    fn reference(p: &[Token], n: &[char]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some((Token::Star, rest)) => (0..=n.len()).any(|k| reference(rest, &n[k..])),
            Some((t, rest)) => !n.is_empty() && one(t, n[0]) && reference(rest, &n[1..]),
        }
    }

    proptest! {
        #[test]
        fn equals_the_recursive_reference(
            pattern in "[ab.*?\\[\\]!-]{0,8}",
            name in "[ab.\\[-]{0,8}",
        ) {
            let n: Vec<char> = name.chars().collect();
            prop_assert_eq!(matches(&pattern, &name), reference(&parse(&pattern), &n));
        }
    }
}
