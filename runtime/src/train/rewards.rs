//! kiln's built-in reward functions for GRPO (registered like any plugin's, with
//! `#[reward]`): `exact_match`, `regex`, `length`. Each reads its parameters from the run's
//! task settings.

use crate::train::reward_registry::RewardInput;
use serde_json::Value;

/// The answer column of an example as text (a string, or a number written out).
fn column(input: &RewardInput<'_>, name: &str) -> Option<String> {
    match input.example.get(name)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The column `exact_match` compares with (`answer_column`, default `answer`).
pub fn answer_column(options: &serde_json::Map<String, Value>) -> String {
    options
        .get("answer_column")
        .and_then(Value::as_str)
        .unwrap_or("answer")
        .to_string()
}

/// 1 when the example's answer (column `answer_column`, default `answer`, trimmed) appears in
/// the completion, else 0; `None` for an example without the column.
#[crate::reward(name = "exact_match", crate = crate)]
pub fn exact_match(input: &RewardInput<'_>) -> Option<f64> {
    let answer = column(input, &answer_column(input.options))?;
    Some(f64::from(u8::from(
        input.completion.contains(answer.trim()),
    )))
}

/// The compiled `reward_regex`, cached by pattern.
fn compiled(pattern: &str) -> Option<regex::Regex> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<String, Option<regex::Regex>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(pattern.to_string())
        .or_insert_with(|| regex::Regex::new(pattern).ok())
        .clone()
}

/// 1 when the completion matches `reward_regex` (a format check: anchor it with `^…$` to
/// require the whole completion), else 0. The pattern is checked when the run starts.
#[crate::reward(name = "regex", crate = crate)]
pub fn regex_format(input: &RewardInput<'_>) -> Option<f64> {
    let pattern = input.options.get("reward_regex")?.as_str()?;
    let re = compiled(pattern)?;
    Some(f64::from(u8::from(re.is_match(input.completion))))
}

/// 0 up to `reward_length_target` completion tokens (default 128), then minus the excess as
/// a fraction of the target: a penalty for rambling.
#[crate::reward(name = "length", crate = crate)]
pub fn length(input: &RewardInput<'_>) -> Option<f64> {
    let target = input
        .options
        .get("reward_length_target")
        .and_then(Value::as_u64)
        .unwrap_or(128)
        .max(1) as f64;
    let n = input.completion_ids.len() as f64;
    Some(if n <= target {
        0.0
    } else {
        -(n - target) / target
    })
}

/// Checks the settings the chosen built-ins read, before any work: a regex that compiles.
pub fn check_options(
    names: &[String],
    options: &serde_json::Map<String, Value>,
) -> Result<(), String> {
    if names.iter().any(|n| n == "regex") {
        let p = options
            .get("reward_regex")
            .and_then(Value::as_str)
            .ok_or("reward `regex` needs `reward_regex` (the pattern)")?;
        regex::Regex::new(p).map_err(|e| format!("`reward_regex`: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::reward_registry::RewardRegistry;

    fn input<'a>(
        completion: &'a str,
        ids: &'a [u32],
        example: &'a serde_json::Map<String, Value>,
        options: &'a serde_json::Map<String, Value>,
    ) -> RewardInput<'a> {
        RewardInput {
            prompt: "1+2=",
            completion,
            completion_ids: ids,
            example,
            options,
        }
    }

    #[test]
    fn built_ins_are_registered_and_score_as_documented() {
        let r = RewardRegistry::try_global().unwrap();
        for name in ["exact_match", "regex", "length"] {
            assert!(r.get(name).is_some(), "{name}");
        }
        let ex: serde_json::Map<String, Value> =
            serde_json::from_str(r#"{"prompt":"1+2=","answer":3}"#).unwrap();
        let mut opt = serde_json::Map::new();
        assert_eq!(exact_match(&input(" 3", &[], &ex, &opt)), Some(1.0));
        assert_eq!(exact_match(&input("4", &[], &ex, &opt)), Some(0.0));
        assert_eq!(
            exact_match(&input("3", &[], &serde_json::Map::new(), &opt)),
            None
        );
        opt.insert("reward_regex".into(), Value::from(r"^\d+$"));
        assert_eq!(regex_format(&input("12", &[], &ex, &opt)), Some(1.0));
        assert_eq!(regex_format(&input("12 apples", &[], &ex, &opt)), Some(0.0));
        opt.insert("reward_length_target".into(), Value::from(4));
        assert_eq!(length(&input("", &[1, 2, 3], &ex, &opt)), Some(0.0));
        assert_eq!(
            length(&input("", &[1, 2, 3, 4, 5, 6], &ex, &opt)),
            Some(-0.5)
        );
        let bad = serde_json::from_str(r#"{"reward_regex":"("}"#).unwrap();
        assert!(
            check_options(&["regex".into()], &bad)
                .unwrap_err()
                .starts_with("`reward_regex`:")
        );
    }
}
