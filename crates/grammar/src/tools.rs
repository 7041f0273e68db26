//! Tool calls as a grammar: the scaffold the model's chat template teaches (literal text, or
//! the template's special tokens), around JSON arguments constrained by each tool's schema.
//! The scaffold is fixed text, so llguidance forces it (jump-forward) up to the point where the
//! tool name is decided, and again between the name and the arguments.

use ferrolm_text::{Tokenizer, ToolSpec};
use serde_json::{json, Value};

use crate::spec::{lark_literal, prepare_schema};
use crate::GrammarError;

/// How the model writes a call, i.e. what `ferrolm_text::toolcall` parses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": "NAME", "arguments": {…}}\n</tool_call>`, one call per block,
    /// blocks separated by a newline (Qwen2.5, Hermes-style templates).
    Hermes,
    /// `{"name": "NAME", "parameters": {…}}` as the whole output (Llama 3.x JSON tool calls).
    Json,
}

impl ToolCallFormat {
    /// The format a chat template teaches: `Hermes` when its source writes `<tool_call>`
    /// blocks, `Json` otherwise.
    pub fn from_template(source: &str) -> ToolCallFormat {
        if source.contains("<tool_call>") {
            ToolCallFormat::Hermes
        } else {
            ToolCallFormat::Json
        }
    }
}

/// OpenAI's `tool_choice` values that oblige a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// `"required"`: one or more calls, each to any declared tool.
    Required,
    /// `{"type": "function", "function": {"name": …}}`: exactly one call to this tool.
    Function(String),
}

/// The tools of a request and how a call must look.
#[derive(Debug, Clone)]
pub struct ToolCallSpec {
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    pub format: ToolCallFormat,
    /// Whether `Required` allows several calls (OpenAI's `parallel_tool_calls`, default true;
    /// `Hermes` only: a `Json` output is one call).
    pub parallel: bool,
}

/// By value (`ToolSpec` itself has no equality).
impl PartialEq for ToolCallSpec {
    fn eq(&self, other: &Self) -> bool {
        let same = |a: &ToolSpec, b: &ToolSpec| a.name == b.name && a.parameters == b.parameters;
        self.choice == other.choice
            && self.format == other.format
            && self.parallel == other.parallel
            && self.tools.len() == other.tools.len()
            && self.tools.iter().zip(&other.tools).all(|(a, b)| same(a, b))
    }
}

impl ToolCallSpec {
    /// The Lark grammar of the whole output, its top rule named `rule` (`start`, or another name
    /// where the calls follow something else).
    pub(crate) fn to_lark(&self, tokenizer: &Tokenizer, rule: &str) -> Result<String, GrammarError> {
        let chosen = self.chosen()?;
        let key = match self.format {
            ToolCallFormat::Hermes => "arguments",
            ToolCallFormat::Json => "parameters",
        };
        let mut rules = Vec::new();
        let mut bodies = Vec::new();
        for (i, tool) in chosen.iter().enumerate() {
            let args = arguments_schema(tool)?;
            let head = format!("{{\"name\": {}, \"{key}\": ", Value::String(tool.name.clone()));
            rules.push(format!("fn_{i}: {} args_{i} \"}}\"", lark_literal(&head)));
            rules.push(format!("args_{i}: %json {args}"));
            bodies.push(format!("fn_{i}"));
        }
        let top = match self.format {
            ToolCallFormat::Json => format!("{rule}: body"),
            ToolCallFormat::Hermes => {
                let open = scaffold(tokenizer, "<tool_call>");
                let close = scaffold(tokenizer, "</tool_call>");
                let repeat = if self.parallel && self.choice == ToolChoice::Required { " (\"\\n\" call)*" } else { "" };
                format!("{rule}: call{repeat}\ncall: {open} \"\\n\" body \"\\n\" {close}")
            }
        };
        Ok(format!("{top}\nbody: {}\n{}\n", bodies.join(" | "), rules.join("\n")))
    }

    /// The tools a call may name, checked: at least one, names unique and non-empty, a named
    /// choice among them.
    fn chosen(&self) -> Result<Vec<&ToolSpec>, GrammarError> {
        let bad = |m: String| GrammarError::invalid("tools", m);
        if self.tools.is_empty() {
            return Err(bad("tool_choice obliges a call but no tools are declared".into()));
        }
        for (i, t) in self.tools.iter().enumerate() {
            if t.name.is_empty() {
                return Err(bad(format!("tools[{i}] has an empty name")));
            }
            if self.tools[..i].iter().any(|u| u.name == t.name) {
                return Err(bad(format!("tools[{i}]: the name '{}' is declared twice", t.name)));
            }
        }
        match &self.choice {
            ToolChoice::Required => Ok(self.tools.iter().collect()),
            ToolChoice::Function(name) => match self.tools.iter().find(|t| &t.name == name) {
                Some(t) => Ok(vec![t]),
                None => Err(bad(format!("tool_choice names '{name}', which is not among the tools"))),
            },
        }
    }

    /// After a failed compile: the first tool whose schema fails alone, named in the error.
    pub(crate) fn blame(&self, compile: impl Fn(&Value) -> Result<(), String>) -> Option<GrammarError> {
        self.tools.iter().enumerate().find_map(|(i, tool)| {
            let schema = match arguments_schema(tool) {
                Ok(s) => s,
                Err(e) => return Some(e),
            };
            let msg = compile(&schema).err()?;
            Some(GrammarError::invalid("tools", format!("tools[{i}] ('{}') parameters: {msg}", tool.name)))
        })
    }
}

/// A tool's arguments schema with ferrolm's JSON layout. No `parameters` means no arguments
/// (OpenAI: "omitting parameters defines a function with an empty parameter list").
fn arguments_schema(tool: &ToolSpec) -> Result<Value, GrammarError> {
    let params = match &tool.parameters {
        Value::Null => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        p => p.clone(),
    };
    if let Some(ty) = params.get("type") {
        if ty != "object" {
            return Err(GrammarError::invalid(
                "tools",
                format!("'{}' parameters must be a schema of type 'object', not {ty}", tool.name),
            ));
        }
    }
    prepare_schema(&params, "tools")
}

/// A fixed piece of the scaffold: the special-token reference when the tokenizer has it as a
/// control token (text could not spell it), otherwise a literal (user-defined tokens such as
/// Qwen's `<tool_call>` are text and still come out as their one token).
fn scaffold(tokenizer: &Tokenizer, text: &str) -> String {
    match tokenizer.token_to_id(text) {
        Some(id) if tokenizer.is_special(id) => text.to_string(),
        _ => lark_literal(text),
    }
}
