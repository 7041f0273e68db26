//! Chat templates: the model's own Jinja template rendered with minijinja the way transformers'
//! `apply_chat_template` renders it with Jinja2: `trim_blocks` and `lstrip_blocks` on, no
//! trailing newline kept, Python string methods (pycompat), `raise_exception`,
//! `strftime_now`, a `tojson` that is `json.dumps(ensure_ascii=False)`, and Python's way of
//! printing `True`/`None`/lists.

use anyhow::{anyhow, Result};
use minijinja::value::{Kwargs, Value as JValue, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State};
use serde_json::{Map, Value};

use crate::pyjson::{self, DumpOptions};
use crate::{strftime, Tokenizer};

const NAME: &str = "chat_template";

#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    /// OpenAI-style tool definitions, passed to the template as `tools`.
    pub tools: Option<Value>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub extra: Map<String, Value>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// Passed only when the model has them, so `bos_token is defined` works as in transformers.
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are the texts templates see under those names.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| anyhow!("chat template does not compile: {}", describe(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
        })
    }

    /// The template of a tokenizer's model, with its BOS/EOS texts.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self> {
        let source = tokenizer
            .chat_template()
            .ok_or_else(|| anyhow!("model has no chat template"))?;
        Self::new(source, tokenizer.bos_token(), tokenizer.eos_token())
    }

    /// Renders `messages` (a JSON array of `{role, content, ...}`).
    pub fn render(&self, messages: &Value, opts: &RenderOptions) -> Result<String> {
        let mut ctx = opts.extra.clone();
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(t) = token {
                ctx.insert(key.into(), Value::String(t.clone()));
            }
        }
        ctx.insert("messages".into(), alias_reasoning(messages));
        // transformers passes tools=None / documents=None explicitly: `tools is none` is true.
        ctx.insert("tools".into(), opts.tools.clone().unwrap_or(Value::Null));
        ctx.entry("documents").or_insert(Value::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(opts.add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| anyhow!("{}", describe(&e)))?;
        tmpl.render(JValue::from_serialize(&ctx))
            .map_err(|e| anyhow!("chat template error: {}", describe(&e)))
    }
}

/// Names a message's reasoning may come under; templates read the first (transformers 5 copies
/// it to `reasoning_content`, and to `thinking` for templates that read that).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// transformers' `_alias_reasoning_fields`: `{"thinking": r, **message, "reasoning_content": r}`.
fn alias_reasoning(messages: &Value) -> Value {
    let Value::Array(list) = messages else {
        return messages.clone();
    };
    let aliased = list.iter().map(|m| {
        let Value::Object(obj) = m else {
            return m.clone();
        };
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|k| obj.get(*k).filter(|v| !v.is_null()));
        let Some(r) = reasoning else { return m.clone() };
        let mut out = Map::new();
        out.insert("thinking".into(), r.clone());
        out.extend(obj.iter().map(|(k, v)| (k.clone(), v.clone())));
        out.insert("reasoning_content".into(), r.clone());
        Value::Object(out)
    });
    Value::Array(aliased.collect())
}

/// The message a template author wrote for `raise_exception`, else minijinja's description.
fn describe(e: &Error) -> String {
    let mut msg = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) => detail.to_string(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        msg.push_str(&format!(" (template line {line})"));
    }
    msg
}

fn raise_exception(message: String) -> Result<JValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    strftime::format(&strftime::now_utc(), &format)
}

/// transformers: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &JValue, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<JValue>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.to_string()),
        },
    };
    let separators = kwargs
        .get::<Option<Vec<String>>>("separators")?
        .and_then(|s| (s.len() == 2).then(|| (s[0].clone(), s[1].clone())));
    let opts = DumpOptions {
        indent,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    Ok(pyjson::dumps(&to_json(value)?, &opts))
}

fn to_json(value: &JValue) -> Result<Value, Error> {
    if value.is_undefined() {
        return Ok(Value::Null);
    }
    serde_json::to_value(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("value is not JSON: {e}"),
        )
    })
}

/// Jinja2 prints values with Python's `str()`: `True`, `None`, `['a', 1]`.
fn python_formatter(out: &mut Output, state: &State, value: &JValue) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::Bool => Some(if value.is_true() {
            "True".to_string()
        } else {
            "False".to_string()
        }),
        ValueKind::None => Some("None".to_string()),
        ValueKind::Seq | ValueKind::Map => Some(pyjson::repr(&to_json(value)?)),
        _ => None,
    };
    match text {
        Some(t) => out.write_str(&t).map_err(Error::from),
        None => minijinja::escape_formatter(out, state, value),
    }
}
