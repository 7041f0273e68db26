//! Tool calls in model output, streamed. Formats:
//!
//! - Qwen / Hermes: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one or more blocks,
//!   a block may hold a JSON list of calls (SmolLM2, some Hermes fine-tunes);
//! - Qwen3-Coder / Qwen3.5: `<tool_call><function=NAME><parameter=KEY>value</parameter>…
//!   </function></tool_call>`, values decoded against the tool's JSON schema (a parameter typed
//!   `string` stays a string even when it looks like a number);
//! - plain JSON: the whole output is a function call object or a list of them (Llama 3.x style,
//!   `{"name": …, "parameters": {…}}`), optionally in a ``` fence; only names of offered tools
//!   count, so an ordinary JSON answer stays content.
//!
//! Content before a call streams as it comes; from a possible `<tool_call>` marker on, text is
//! held until the block closes. A block that does not parse comes back as content, verbatim:
//! nothing the model wrote is dropped. Arguments are a JSON string in Python's `json.dumps`
//! layout (`{"city": "Paris"}`), as mlx_lm.server writes them.

use crate::pyjson::{dumps, DumpOptions};
use crate::reasoning::partial_suffix_len;
use serde_json::{Map, Value};

pub const TOOL_CALL_START: &str = "<tool_call>";
pub const TOOL_CALL_END: &str = "</tool_call>";

/// A parsed call: the function name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// What a tool offered in the request looks like to the parser.
#[derive(Debug, Clone, Default)]
pub struct ToolSpec {
    pub name: String,
    /// The JSON schema of the arguments (`{"type": "object", "properties": …}`), or null.
    pub parameters: Value,
}

impl ToolSpec {
    /// From OpenAI's `{"type": "function", "function": {"name", "parameters"}}` (or the inner
    /// object alone).
    pub fn from_openai(tool: &Value) -> Option<ToolSpec> {
        let f = tool.get("function").unwrap_or(tool);
        Some(ToolSpec {
            name: f.get("name")?.as_str()?.to_string(),
            parameters: f.get("parameters").cloned().unwrap_or(Value::Null),
        })
    }
}

/// One piece of parsed output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    Call(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Only whitespace so far: the output may still be a plain JSON call.
    Start,
    /// Ordinary text; watching for the start marker.
    Text,
    /// Inside `<tool_call>`; waiting for the end marker.
    InCall,
    /// The output began like JSON: buffered to the end, then parsed as a whole.
    Json,
}

#[derive(Debug, Clone)]
pub struct ToolCallParser {
    tools: Vec<ToolSpec>,
    mode: Mode,
    held: String,
}

impl ToolCallParser {
    pub fn new(tools: Vec<ToolSpec>) -> Self {
        ToolCallParser { tools, mode: Mode::Start, held: String::new() }
    }

    /// Feeds a delta; returns the events now decided.
    pub fn push(&mut self, delta: &str) -> Vec<ToolEvent> {
        self.held.push_str(delta);
        let mut out = Vec::new();
        loop {
            let progressed = match self.mode {
                Mode::Start => self.step_start(),
                Mode::Text => self.step_text(&mut out),
                Mode::InCall => self.step_call(&mut out),
                Mode::Json => false,
            };
            if !progressed {
                return merge(out);
            }
        }
    }

    /// End of stream: an unterminated block or buffered JSON is parsed if it can be, otherwise
    /// returned as content.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.mode {
            Mode::Start | Mode::Text => push_content(&mut out, held),
            Mode::InCall => match parse_block(&held, &self.tools) {
                Some(calls) => out.extend(calls.into_iter().map(ToolEvent::Call)),
                None => push_content(&mut out, format!("{TOOL_CALL_START}{held}")),
            },
            Mode::Json => match parse_plain(&held, &self.tools) {
                Some(calls) => out.extend(calls.into_iter().map(ToolEvent::Call)),
                None => push_content(&mut out, held),
            },
        }
        self.mode = Mode::Text;
        merge(out)
    }

    /// Decides between plain JSON and text once the first non-space characters are known.
    fn step_start(&mut self) -> bool {
        let t = self.held.trim_start();
        if t.is_empty() {
            return false;
        }
        let json = match t.as_bytes()[0] {
            b'{' | b'[' => Some(true),
            b'`' => fenced_json(t),
            _ => Some(false),
        };
        match json {
            None => false,
            Some(true) => {
                self.mode = Mode::Json;
                false
            }
            Some(false) => {
                self.mode = Mode::Text;
                true
            }
        }
    }

    fn step_text(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        if let Some(at) = self.held.find(TOOL_CALL_START) {
            let before: String = self.held.drain(..at + TOOL_CALL_START.len()).collect();
            push_content(out, before[..at].to_string());
            self.mode = Mode::InCall;
            return true;
        }
        let keep = partial_suffix_len(&self.held, TOOL_CALL_START);
        let emit: String = self.held.drain(..self.held.len() - keep).collect();
        push_content(out, emit);
        false
    }

    fn step_call(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let Some(at) = self.held.find(TOOL_CALL_END) else {
            return false;
        };
        let block: String = self.held.drain(..at + TOOL_CALL_END.len()).collect();
        let body = &block[..at];
        match parse_block(body, &self.tools) {
            Some(calls) => out.extend(calls.into_iter().map(ToolEvent::Call)),
            None => push_content(out, format!("{TOOL_CALL_START}{block}")),
        }
        self.mode = Mode::Text;
        true
    }
}

/// `Some(true)` when text starting with a backtick is a ```json fence around a JSON value,
/// `Some(false)` when it is not, `None` while undecided.
fn fenced_json(t: &str) -> Option<bool> {
    if t.len() < 3 {
        return if "```".starts_with(t) { None } else { Some(false) };
    }
    if !t.starts_with("```") {
        return Some(false);
    }
    let Some(nl) = t.find('\n') else {
        // Still on the fence line: only a language tag may follow.
        let tag = &t[3..];
        return if tag.chars().all(|c| c.is_ascii_alphanumeric()) { None } else { Some(false) };
    };
    let rest = t[nl + 1..].trim_start();
    match rest.as_bytes().first() {
        None => None,
        Some(b'{' | b'[') => Some(true),
        Some(_) => Some(false),
    }
}

fn push_content(out: &mut Vec<ToolEvent>, text: String) {
    if !text.is_empty() {
        out.push(ToolEvent::Content(text));
    }
}

/// Joins adjacent content pieces.
fn merge(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(ToolEvent::Content(a)), ToolEvent::Content(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

/// The body of one `<tool_call>` block: JSON (an object or a list of objects) or the
/// `<function=…>` form.
pub fn parse_block(body: &str, tools: &[ToolSpec]) -> Option<Vec<ToolCall>> {
    let t = body.trim();
    if t.starts_with("<function=") {
        return parse_function_xml(t, tools).map(|c| vec![c]);
    }
    let value: Value = serde_json::from_str(t).ok()?;
    calls_from_value(&value)
}

/// A whole output that is a JSON function call (or a list of them), possibly fenced. Every
/// call must name an offered tool.
pub fn parse_plain(text: &str, tools: &[ToolSpec]) -> Option<Vec<ToolCall>> {
    let mut t = text.trim();
    if let Some(rest) = t.strip_prefix("```") {
        let rest = rest.trim_end();
        let rest = rest.strip_suffix("```")?;
        t = rest.split_once('\n').map_or("", |(_, body)| body).trim();
    }
    let value: Value = serde_json::from_str(t).ok()?;
    let calls = calls_from_value(&value)?;
    let known = |c: &ToolCall| tools.iter().any(|s| s.name == c.name);
    calls.iter().all(known).then_some(calls)
}

fn calls_from_value(value: &Value) -> Option<Vec<ToolCall>> {
    match value {
        Value::Array(items) if !items.is_empty() => items.iter().map(call_from_object).collect(),
        Value::Object(_) => call_from_object(value).map(|c| vec![c]),
        _ => None,
    }
}

/// `{"name", "arguments"|"parameters"}`, also wrapped as `{"function": {…}}`.
fn call_from_object(v: &Value) -> Option<ToolCall> {
    let obj = v.as_object()?;
    let obj = match obj.get("function") {
        Some(Value::Object(inner)) => inner,
        _ => obj,
    };
    let name = obj.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args = ["arguments", "parameters", "args"].iter().find_map(|k| obj.get(*k));
    let args = match args {
        None | Some(Value::Null) => Value::Object(Map::new()),
        // Arguments already serialized: accept a JSON object in the string.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => return None,
        },
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some(ToolCall { name: name.to_string(), arguments: python_json(&args) })
}

/// `<function=NAME><parameter=KEY>value</parameter>…</function>`.
fn parse_function_xml(t: &str, tools: &[ToolSpec]) -> Option<ToolCall> {
    let rest = t.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim();
    let schema = tools.iter().find(|s| s.name == name).map(|s| &s.parameters);
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix("<parameter=") {
            let (key, r) = r.split_once('>')?;
            let (raw, r) = r.split_once("</parameter>")?;
            let value = strip_one_newline(raw);
            let key = key.trim().to_string();
            let decoded = decode_param(value, schema.and_then(|s| param_type(s, &key)));
            args.insert(key, decoded);
            rest = r;
        } else if rest.starts_with("</function>") || rest.is_empty() {
            break;
        } else {
            return None;
        }
    }
    if name.is_empty() {
        return None;
    }
    Some(ToolCall { name: name.to_string(), arguments: python_json(&Value::Object(args)) })
}

fn strip_one_newline(s: &str) -> &str {
    let s = s.strip_prefix('\n').unwrap_or(s);
    s.strip_suffix('\n').unwrap_or(s)
}

fn param_type<'a>(schema: &'a Value, key: &str) -> Option<&'a str> {
    schema.get("properties")?.get(key)?.get("type")?.as_str()
}

/// A parameter value: strings stay strings when the schema says so (or when they are not
/// JSON); otherwise JSON literals are decoded.
fn decode_param(raw: &str, ty: Option<&str>) -> Value {
    if ty == Some("string") {
        return Value::String(raw.to_string());
    }
    match serde_json::from_str::<Value>(raw.trim()) {
        Ok(v) => v,
        Err(_) => Value::String(raw.to_string()),
    }
}

/// Python's `json.dumps(value, ensure_ascii=False)`.
pub fn python_json(value: &Value) -> String {
    dumps(value, &DumpOptions::default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}),
        }]
    }

    fn run(deltas: &[&str]) -> Vec<ToolEvent> {
        let mut p = ToolCallParser::new(tools());
        let mut out = Vec::new();
        for d in deltas {
            out.extend(p.push(d));
        }
        out.extend(p.finish());
        merge(out)
    }

    fn call(name: &str, args: &str) -> ToolEvent {
        ToolEvent::Call(ToolCall { name: name.into(), arguments: args.into() })
    }

    fn content(s: &str) -> ToolEvent {
        ToolEvent::Content(s.into())
    }

    #[test]
    fn hermes_blocks_cut_across_deltas() {
        let ev = run(&[
            "Let me check.\n<tool",
            "_call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_",
            "call>",
        ]);
        assert_eq!(ev, vec![content("Let me check.\n"), call("get_weather", r#"{"city": "Paris"}"#)]);
    }

    #[test]
    fn content_streams_before_the_marker() {
        let mut p = ToolCallParser::new(tools());
        assert_eq!(p.push("Hello <"), vec![content("Hello ")]);
        assert_eq!(p.push("b>"), vec![content("<b>")]);
        assert_eq!(p.push(" <tool_ca"), vec![content(" ")]);
        assert_eq!(p.push("ll>{\"name\""), vec![]);
    }

    #[test]
    fn two_blocks_and_a_list_inside_a_block() {
        let ev = run(&[
            "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n",
            "<tool_call>[{\"name\": \"b\", \"arguments\": {\"x\": 1}}, {\"name\": \"c\"}]</tool_call>",
        ]);
        assert_eq!(ev, vec![call("a", "{}"), content("\n"), call("b", r#"{"x": 1}"#), call("c", "{}")]);
    }

    #[test]
    fn malformed_blocks_come_back_as_content() {
        let text = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call> after";
        assert_eq!(run(&[text]), vec![content(text)]);
        // Unterminated and unparseable at the end of the stream.
        assert_eq!(run(&["x <tool_call>{\"na"]), vec![content("x <tool_call>{\"na")]);
        // Unterminated but complete JSON: a call (mlx-lm does the same).
        assert_eq!(run(&["<tool_call>{\"name\": \"get_weather\"}"]), vec![call("get_weather", "{}")]);
    }

    #[test]
    fn plain_json_calls_need_an_offered_name() {
        let ev = run(&[" {\"name\": \"get_weather\", ", "\"parameters\": {\"city\": \"Oslo\"}}"]);
        assert_eq!(ev, vec![call("get_weather", r#"{"city": "Oslo"}"#)]);
        let other = "{\"name\": \"unknown\", \"parameters\": {}}";
        assert_eq!(run(&[other]), vec![content(other)]);
        let answer = "[1, 2, 3]";
        assert_eq!(run(&[answer]), vec![content(answer)]);
        let fenced = "```json\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n```";
        assert_eq!(run(&["``", &fenced[2..]]), vec![call("get_weather", r#"{"city": "Rome"}"#)]);
        let code = "```python\nprint(1)\n```";
        assert_eq!(run(&["```py", "thon\nprint(1)\n```"]), vec![content(code)]);
    }

    #[test]
    fn function_xml_follows_the_schema() {
        let ev = run(&[
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
            "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>",
        ]);
        assert_eq!(ev, vec![call("get_weather", r#"{"city": "Paris", "days": 3, "zip": "75001"}"#)]);
    }

    #[test]
    fn non_ascii_arguments_are_kept() {
        let ev = run(&["<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}</tool_call>"]);
        assert_eq!(ev, vec![call("get_weather", r#"{"city": "Zürich"}"#)]);
    }
}
