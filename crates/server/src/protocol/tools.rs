//! Tools for chat templates that do not read `tools` (SmolLM2's, Llama 2's…). mlx_lm.server
//! passes them to such a template, which drops them, so the model never learns of them. We
//! describe them in the system message the way Qwen2.5 / Hermes templates do, and render the
//! tool-call history in that format, so the model can answer with `<tool_call>` blocks, which
//! the parser understands.

use ferrolm_text::toolcall::python_json;
use serde_json::{json, Value};

fn preamble(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&python_json(t));
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// A chat tool's `function` in OpenAI's key order (name, description, parameters), for tools
/// given in another API's shape: templates and the system-message description print the object
/// as given, so the prompt is the one the equivalent chat request renders.
pub fn function(name: &str, description: Option<&Value>, parameters: Value) -> Value {
    let mut f = serde_json::Map::new();
    f.insert("name".into(), json!(name));
    if let Some(d) = description.filter(|d| d.is_string()) {
        f.insert("description".into(), d.clone());
    }
    f.insert("parameters".into(), parameters);
    Value::Object(f)
}

/// Describes `tools` in the (first) system message, adding one if there is none.
pub fn describe_in_system(messages: &mut Vec<Value>, tools: &[Value]) {
    let text = preamble(tools);
    match messages.first_mut() {
        Some(m) if m["role"] == "system" => {
            let content = m["content"].as_str().unwrap_or_default().to_string();
            m["content"] = Value::String(if content.is_empty() { text } else { format!("{content}\n\n{text}") });
        }
        _ => messages.insert(0, json!({"role": "system", "content": text})),
    }
}

/// Assistant `tool_calls` become `<tool_call>` blocks in the content; consecutive `tool`
/// messages become one user message of `<tool_response>` blocks (Qwen2.5's rendering).
pub fn inline_tool_history(messages: Vec<Value>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    let mut prev_tool = false;
    for mut m in messages {
        let role = m["role"].as_str().unwrap_or_default().to_string();
        if role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", m["content"].as_str().unwrap_or_default());
            match out.last_mut() {
                Some(last) if prev_tool => {
                    let joined = format!("{}\n{block}", last["content"].as_str().unwrap_or_default());
                    last["content"] = Value::String(joined);
                }
                _ => out.push(json!({"role": "user", "content": block})),
            }
            prev_tool = true;
            continue;
        }
        prev_tool = false;
        if role == "assistant" {
            if let Some(Value::Array(calls)) = m.get("tool_calls").cloned() {
                let mut content = m["content"].as_str().unwrap_or_default().to_string();
                for c in &calls {
                    let f = c.get("function").unwrap_or(c);
                    let call = json!({"name": f["name"], "arguments": f["arguments"]});
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&format!("<tool_call>\n{}\n</tool_call>", python_json(&call)));
                }
                m["content"] = Value::String(content);
            }
        }
        out.push(m);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_go_into_the_system_message() {
        let tools = vec![json!({"type": "function", "function": {"name": "f", "parameters": {}}})];
        let mut m = vec![json!({"role": "user", "content": "hi"})];
        describe_in_system(&mut m, &tools);
        assert_eq!(m[0]["role"], "system");
        let text = m[0]["content"].as_str().unwrap();
        assert!(text.starts_with("# Tools"));
        assert!(text.contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}\n</tools>"
        ));
        let mut m = vec![json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "hi"})];
        describe_in_system(&mut m, &tools);
        assert!(m[0]["content"].as_str().unwrap().starts_with("Be brief.\n\n# Tools"));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn tool_history_is_rendered_inline() {
        let m = vec![
            json!({"role": "user", "content": "weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
            json!({"role": "tool", "tool_call_id": "call_2", "content": "warm"}),
        ];
        let out = inline_tool_history(m);
        assert_eq!(out.len(), 3);
        assert_eq!(
            out[1]["content"],
            "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert_eq!(out[2]["role"], "user");
        assert_eq!(
            out[2]["content"],
            "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
        );
    }
}
