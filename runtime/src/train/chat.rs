//! Chat templates as transformers renders them: the Jinja template of `tokenizer_config.json`
//! (`chat_template`, or the folder's `chat_template.jinja`), rendered with `minijinja` under
//! transformers' settings (`trim_blocks`, `lstrip_blocks`, Python string methods,
//! `raise_exception`, `strftime_now`) with `messages`, `add_generation_prompt`, the special
//! tokens and `tools`. `{% generation %}…{% endgeneration %}` marks what the assistant
//! generates (TRL's `assistant_only_loss`): kiln rewrites the tags into an `if` block that emits
//! private-use marker characters, then removes the markers and keeps their spans.

use super::TrainError;
use serde_json::Value;
use std::path::{Path, PathBuf};

const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

/// The most minijinja instructions one rendering may run: a conversation of thousands of
/// messages through the largest templates shipped with models needs well under a tenth.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

/// A model's chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: PathBuf,
    special: serde_json::Map<String, Value>,
    /// Whether the template marks the assistant's turns with `{% generation %}`.
    pub has_generation: bool,
}

/// A rendered conversation: the text and the byte spans the assistant generated.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The text.
    pub text: String,
    /// `[start, end)` byte ranges of `{% generation %}` blocks.
    pub generation: Vec<(usize, usize)>,
}

fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// `{% generation %}` / `{% endgeneration %}` (with any whitespace control) rewritten into an
/// `if` block that prints the markers.
fn rewrite_generation(src: &str) -> (String, bool) {
    let re = regex::Regex::new(r"\{%(-?)\s*(end)?generation\s*(-?)%\}").expect("regex");
    let mut found = false;
    let out = re
        .replace_all(src, |c: &regex::Captures<'_>| {
            found = true;
            let (l, r) = (&c[1], &c[3]);
            if c.get(2).is_some() {
                format!("{{{{ '{CLOSE}' }}}}{{%{l} endif {r}%}}")
            } else {
                format!("{{%{l} if true {r}%}}{{{{ '{OPEN}' }}}}")
            }
        })
        .into_owned();
    (out, found)
}

/// Today's date (UTC) in `fmt`, as Python's `strftime` writes `%d %m %Y %y %b %B %j %%`;
/// any other directive is an error naming it.
fn strftime_now(fmt: &str) -> Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_date((secs / 86_400) as i64, fmt)
}

/// `days` since 1970-01-01 formatted with `fmt` (see [`strftime_now`]).
fn format_date(days: i64, fmt: &str) -> Result<String, minijinja::Error> {
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(m - 1) as usize];
    let yday = before + d + i64::from(leap && m > 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("strftime_now: `%{}` is not supported", other.unwrap_or(' ')),
                ));
            }
        }
    }
    Ok(out)
}

impl ChatTemplate {
    /// The chat template of the model in `dir`, if it has one.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, TrainError> {
        let cfg_path = dir.join("tokenizer_config.json");
        let err = |path: &Path, m: String| TrainError::Data {
            path: path.to_path_buf(),
            line: None,
            message: m,
        };
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(t) => serde_json::from_str(&t)
                .map_err(|e| err(&cfg_path, format!("not valid JSON: {e}")))?,
            Err(_) => Value::Null,
        };
        let jinja = dir.join("chat_template.jinja");
        let (source, text) = if jinja.is_file() {
            let t = std::fs::read_to_string(&jinja).map_err(|e| err(&jinja, e.to_string()))?;
            (jinja, t)
        } else {
            match cfg.get("chat_template") {
                Some(Value::String(t)) => (cfg_path.clone(), t.clone()),
                Some(Value::Array(list)) => {
                    let t = list
                        .iter()
                        .find(|e| e["name"] == "default")
                        .and_then(|e| e["template"].as_str())
                        .ok_or_else(|| {
                            err(
                                &cfg_path,
                                "`chat_template` lists no \"default\" template".into(),
                            )
                        })?;
                    (cfg_path.clone(), t.to_string())
                }
                _ => return Ok(None),
            }
        };
        let (text, has_generation) = rewrite_generation(&text);
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // A template comes with a model from anywhere: one rendering may run at most
        // `TEMPLATE_FUEL` instructions (nested loops over `range(100000)` would otherwise run
        // for hours); minijinja bounds ranges, repeated strings and recursion itself.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function(
            "strftime_now",
            |fmt: String| -> Result<String, minijinja::Error> { strftime_now(&fmt) },
        );
        env.add_template_owned("chat", text)
            .map_err(|e| err(&source, format!("chat template: {e}")))?;
        let mut special = serde_json::Map::new();
        for k in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(t) = token_text(cfg.get(k)) {
                special.insert(k.to_string(), Value::String(t));
            }
        }
        Ok(Some(ChatTemplate {
            env,
            source,
            special,
            has_generation,
        }))
    }

    /// Renders `messages` (a list of `{"role", "content"}` objects), with the assistant's
    /// header at the end when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<Rendered, String> {
        self.render_with(messages, add_generation_prompt, false)
    }

    /// [`ChatTemplate::render`]; `continue_final_message`: the text ends where the last
    /// message's content ends, so that a completion continues it (transformers tags the end of
    /// the content, renders, and cuts at the tag — before any whitespace the template trimmed).
    pub fn render_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> Result<Rendered, String> {
        const TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
        let mut messages = messages.clone();
        if continue_final_message {
            let last = messages.as_array_mut().and_then(|m| m.last_mut()).ok_or(
                "continue_final_message needs a message to continue, and the conversation is empty",
            )?;
            match last.get_mut("content") {
                Some(Value::String(c)) => c.push_str(TAG),
                Some(Value::Array(blocks)) => {
                    let text = blocks
                        .iter_mut()
                        .rev()
                        .find_map(|b| match b.get_mut("text") {
                            Some(Value::String(t)) => Some(t),
                            _ => None,
                        })
                        .ok_or(
                            "continue_final_message: the final message has no text to continue",
                        )?;
                    text.push_str(TAG);
                }
                _ => {
                    return Err(
                        "continue_final_message: the final message has no `content` to continue"
                            .into(),
                    );
                }
            }
        }
        let mut r = self.render_raw(&messages, add_generation_prompt)?;
        if continue_final_message {
            let tag = TAG.trim();
            let at = r.text.rfind(tag).ok_or_else(|| {
                format!(
                    "the chat template drops part of the final message, so it cannot be continued (template {})",
                    self.source.display()
                )
            })?;
            let end = if r.text[at..].starts_with(TAG) {
                at
            } else {
                r.text[..at].trim_end().len()
            };
            r.text.truncate(end);
            r.generation = r
                .generation
                .into_iter()
                .filter(|&(a, _)| a < end)
                .map(|(a, b)| (a, b.min(end)))
                .collect();
        }
        Ok(r)
    }

    fn render_raw(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<Rendered, String> {
        let mut ctx = self.special.clone();
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        ctx.insert("tools".into(), Value::Null);
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let raw = tmpl
            .render(minijinja::Value::from_serialize(&ctx))
            .map_err(|e| format!("{} (template {})", e, self.source.display()))?;
        let mut text = String::with_capacity(raw.len());
        let mut generation = Vec::new();
        let mut open = None;
        for ch in raw.chars() {
            match ch {
                OPEN => open = Some(text.len()),
                CLOSE => {
                    if let Some(s) = open.take() {
                        generation.push((s, text.len()));
                    }
                }
                c => text.push(c),
            }
        }
        Ok(Rendered { text, generation })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(dir: &Path, t: &str) -> ChatTemplate {
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::json!({ "chat_template": t }).to_string(),
        )
        .unwrap();
        ChatTemplate::from_model_dir(dir).unwrap().unwrap()
    }

    #[test]
    fn a_runaway_template_is_stopped() {
        // Two nested loops of 99999: ten billion steps without a bound. The rendering stops
        // with an error within the fuel; the fuel is per rendering, so an ordinary template
        // renders any number of times.
        let dir = tempfile::tempdir().unwrap();
        let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
        let runaway = template(
            dir.path(),
            "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}",
        );
        let started = std::time::Instant::now();
        let err = runaway.render(&messages, false).unwrap_err();
        assert!(err.contains("fuel"), "{err}");
        assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
        let ordinary = template(
            dir.path(),
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}",
        );
        let long: Vec<_> = (0..2000)
            .map(|i| serde_json::json!({"role": "user", "content": format!("turn {i}")}))
            .collect();
        for _ in 0..50 {
            ordinary
                .render(&serde_json::Value::Array(long.clone()), false)
                .unwrap();
        }
    }

    /// Dates checked against Python's `date.fromordinal(...).strftime`.
    #[test]
    fn dates_format_as_python_strftime() {
        // 2024-07-26 is day 19930 since the epoch; 2000-03-01 is 11017; 1970-01-01 is 0.
        assert_eq!(format_date(19930, "%d %b %Y").unwrap(), "26 Jul 2024");
        assert_eq!(
            format_date(11017, "%Y-%m-%d %B %j %y %%").unwrap(),
            "2000-03-01 March 061 00 %"
        );
        assert_eq!(format_date(0, "%d/%m/%Y").unwrap(), "01/01/1970");
        assert!(format_date(0, "%H").is_err());
    }

    #[test]
    fn generation_tags_become_spans_and_whitespace_control_is_kept() {
        let (t, found) = rewrite_generation("a{%- generation -%}b{% endgeneration %}c");
        assert!(found);
        assert_eq!(
            t,
            "a{%- if true -%}{{ '\u{F8F0}' }}b{{ '\u{F8F1}' }}{% endif %}c"
        );
        let dir = tempfile::tempdir().unwrap();
        let tmpl = "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content.strip() }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            serde_json::json!({"chat_template": tmpl, "eos_token": "</s>"}).to_string(),
        )
        .unwrap();
        let c = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert!(c.has_generation);
        let msgs = serde_json::json!([{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo "}]);
        let r = c.render(&msgs, false).unwrap();
        // transformers' output for this template (jinja2 with trim_blocks drops the newline
        // after a block tag).
        assert_eq!(r.text, "<|user|>hi<|assistant|>yo</s>");
        assert_eq!(&r.text[r.generation[0].0..r.generation[0].1], "yo</s>");
        let p = c
            .render(&msgs.as_array().unwrap()[..1].to_vec().into(), true)
            .unwrap();
        assert_eq!(p.text, "<|user|>hi<|assistant|>");
        let bad = serde_json::json!({"chat_template": "{{ raise_exception('no system role') }}"});
        std::fs::write(dir.path().join("tokenizer_config.json"), bad.to_string()).unwrap();
        let c = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert!(
            c.render(&msgs, false)
                .unwrap_err()
                .contains("no system role")
        );
    }
}
