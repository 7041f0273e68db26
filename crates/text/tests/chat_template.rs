//! Chat templates against transformers' rendering (scripts/fixtures/template_fixtures.py).

mod common;

use common::{fixtures_dir, model, read_fixture, GEMMA3, QWEN25, SMOLLM2};
use ferrolm_text::{ChatTemplate, RenderOptions, Tokenizer};
use serde_json::Value;

fn options(case: &Value) -> RenderOptions {
    RenderOptions {
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(false),
        tools: case.get("tools").cloned(),
        extra: case
            .get("kwargs")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default(),
    }
}

/// Renders every case of a fixture with `template`; returns the number of cases checked.
fn check_cases(name: &str, template: &ChatTemplate, fx: &Value) -> usize {
    let cases = fx["cases"].as_array().expect("cases");
    for case in cases {
        let label = format!("{name} [{}]", case["name"].as_str().unwrap());
        let got = template.render(&case["messages"], &options(case));
        match (
            case.get("expected").and_then(Value::as_str),
            case.get("error").and_then(Value::as_str),
        ) {
            (Some(want), _) => assert_eq!(got.expect(&label), want, "{label}"),
            (None, Some(err)) => {
                let msg = got.expect_err(&label).to_string();
                assert!(
                    msg.contains(err),
                    "{label}: error {msg:?} should contain {err:?}"
                );
            }
            _ => panic!("{label}: fixture has neither expected nor error"),
        }
    }
    cases.len()
}

/// The template as read from the GGUF, which must be the one the fixture was made from.
fn check_model_template(fixture: &str, gguf: &str) {
    let fx = read_fixture(&format!("templates/{fixture}.json"));
    let Some(path) = model(gguf) else { return };
    let tk = Tokenizer::from_gguf_file(&path).unwrap();
    assert_eq!(
        tk.chat_template(),
        fx["template"].as_str(),
        "{gguf}: template changed since the fixture"
    );
    assert_eq!(tk.bos_token(), fx["bos_token"].as_str());
    assert_eq!(tk.eos_token(), fx["eos_token"].as_str());
    let template = ChatTemplate::from_tokenizer(&tk).unwrap();
    let n = check_cases(fixture, &template, &fx);
    eprintln!("{fixture}: {n} renders identical to transformers");
}

#[test]
fn smollm2_template_matches_transformers() {
    check_model_template("smollm2", SMOLLM2);
}

#[test]
fn qwen25_template_with_tools_matches_transformers() {
    check_model_template("qwen2.5", QWEN25);
}

/// Small templates for Jinja2 behaviours: Python printing, tojson, whitespace control,
/// loop controls, namespace, raise_exception, reasoning aliases.
#[test]
fn custom_templates_match_transformers() {
    let mut checked = 0;
    for entry in std::fs::read_dir(fixtures_dir().join("templates")).unwrap() {
        let file = entry.unwrap().file_name().into_string().unwrap();
        let Some(name) = file
            .strip_prefix("custom_")
            .and_then(|f| f.strip_suffix(".json"))
        else {
            continue;
        };
        let fx = read_fixture(&format!("templates/{file}"));
        let template = ChatTemplate::new(
            fx["template"].as_str().unwrap(),
            fx["bos_token"].as_str(),
            fx["eos_token"].as_str(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        checked += check_cases(name, &template, &fx);
    }
    assert!(checked >= 7, "only {checked} custom cases found");
}

#[test]
fn model_without_template_is_a_clear_error() {
    let Some(path) = model(GEMMA3) else { return };
    let tk = Tokenizer::from_gguf_file(&path).unwrap();
    assert!(tk.chat_template().is_none());
    let err = ChatTemplate::from_tokenizer(&tk)
        .err()
        .expect("no template")
        .to_string();
    assert_eq!(err, "model has no chat template");
}

#[test]
fn syntax_errors_are_reported_at_compile_time() {
    let err = ChatTemplate::new("{% for m in messages %}", None, None)
        .err()
        .expect("bad template");
    assert!(
        err.to_string().contains("chat template does not compile"),
        "{err}"
    );
}

/// Qwen3's template with thinking on, off (the empty `<think>` block the server's
/// `chat_template_kwargs.enable_thinking: false` asks for) and unset, and with reasoning in the
/// history, tools and tool calls.
#[test]
fn qwen3_template_thinking_on_and_off_matches_transformers() {
    let fx = read_fixture("templates/qwen3.json");
    let template = ChatTemplate::new(fx["template"].as_str().unwrap(), fx["bos_token"].as_str(), fx["eos_token"].as_str()).unwrap();
    let n = check_cases("qwen3", &template, &fx);
    assert!(n >= 8, "only {n} qwen3 cases");
    let off = fx["cases"].as_array().unwrap().iter().find(|c| c["name"] == "thinking_off").unwrap();
    assert!(off["expected"].as_str().unwrap().ends_with("<think>\n\n</think>\n\n"), "the fixture's thinking_off case");
}
