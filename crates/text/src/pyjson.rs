//! Python-compatible text for template values: `json.dumps` (what transformers' `tojson`
//! filter calls) and `repr`/`str` (what Jinja2 prints for `{{ value }}`). Chat templates are
//! written against Python, and a prompt that differs by one space changes the tokens.

use serde_json::Value;

/// Options of `json.dumps` that transformers' `tojson` forwards.
#[derive(Debug, Clone, Default)]
pub(crate) struct DumpOptions {
    pub indent: Option<String>,
    pub ensure_ascii: bool,
    /// (item separator, key separator); Python's default depends on `indent`.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// `json.dumps(value, ...)`.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> String {
    let (item_sep, key_sep) = opts.separators.clone().unwrap_or_else(|| {
        let item = if opts.indent.is_some() { "," } else { ", " };
        (item.to_string(), ": ".to_string())
    });
    let mut w = Writer {
        opts,
        item_sep,
        key_sep,
        out: String::new(),
    };
    w.value(value, 0);
    w.out
}

struct Writer<'a> {
    opts: &'a DumpOptions,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl Writer<'_> {
    fn value(&mut self, v: &Value, depth: usize) {
        match v {
            Value::Null => self.out.push_str("null"),
            Value::Bool(b) => self.out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => self.out.push_str(&number(n)),
            Value::String(s) => string_literal(&mut self.out, s, self.opts.ensure_ascii),
            Value::Array(a) => {
                let items: Vec<&Value> = a.iter().collect();
                self.container('[', ']', items.len(), depth, |w, i| {
                    w.value(items[i], depth + 1)
                });
            }
            Value::Object(m) => {
                let mut entries: Vec<(&String, &Value)> = m.iter().collect();
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                self.container('{', '}', entries.len(), depth, |w, i| {
                    string_literal(&mut w.out, entries[i].0, w.opts.ensure_ascii);
                    w.out.push_str(&w.key_sep.clone());
                    w.value(entries[i].1, depth + 1);
                });
            }
        }
    }

    /// Brackets, separators and (with `indent`) one item per line, as `json.dumps` lays them out.
    fn container(
        &mut self,
        open: char,
        close: char,
        n: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize),
    ) {
        self.out.push(open);
        if n == 0 {
            self.out.push(close);
            return;
        }
        let indent = self.opts.indent.clone();
        for i in 0..n {
            if i > 0 {
                self.out.push_str(&self.item_sep.clone());
            }
            if let Some(ind) = &indent {
                self.out.push('\n');
                self.out.push_str(&ind.repeat(depth + 1));
            }
            item(self, i);
        }
        if let Some(ind) = &indent {
            self.out.push('\n');
            self.out.push_str(&ind.repeat(depth));
        }
        self.out.push(close);
    }
}

fn number(n: &serde_json::Number) -> String {
    match n.as_f64() {
        Some(f) if n.is_f64() => python_float(f),
        _ => n.to_string(),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4 <= |x| < 1e16.
pub(crate) fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let sci = format!("{f:e}"); // e.g. "1.5e-7"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if f == 0.0 || (-4..16).contains(&exp) {
        let s = format!("{f}");
        return if s.contains('.') { s } else { format!("{s}.0") };
    }
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}

/// A JSON string literal escaped like Python's json module.
fn string_literal(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7E) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr()` of a JSON-like value (`str()` of containers uses it for their items).
pub(crate) fn repr(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) => number(n),
        Value::String(s) => repr_str(s),
        Value::Array(a) => format!("[{}]", a.iter().map(repr).collect::<Vec<_>>().join(", ")),
        Value::Object(m) => {
            let items: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}: {}", repr_str(k), repr(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double quote.
fn repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7F => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dumps_matches_python_layout() {
        let v = json!({"b": [1, 2.5, "x\"é"], "a": {}, "c": null});
        let compact = dumps(&v, &DumpOptions::default());
        assert_eq!(compact, r#"{"b": [1, 2.5, "x\"é"], "a": {}, "c": null}"#);
        let opts = DumpOptions {
            indent: Some("  ".into()),
            ..Default::default()
        };
        assert_eq!(
            dumps(&json!({"a": [1], "b": []}), &opts),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": []\n}"
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..Default::default()
        };
        assert_eq!(dumps(&json!("é😀"), &ascii), r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn floats_like_python() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.1), "0.1");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(1.5e-7), "1.5e-07");
        assert_eq!(python_float(123456.789), "123456.789");
    }

    #[test]
    fn repr_like_python() {
        assert_eq!(
            repr(&json!({"a": [true, null, "it's"]})),
            r#"{'a': [True, None, "it's"]}"#
        );
    }
}
