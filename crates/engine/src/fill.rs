//! Fill (token fast-forwarding, mlx-bun 0.3.0; docs/fill.md): when a sequence's output enters a
//! span the engine already knows, the whole span is appended after the pending token as draft
//! rows of one forward, instead of one forward per token.
//!
//! - **Assert** spans are the ones the request determines: once the model opens a tool call,
//!   the rest of the chat template's call scaffold, the rest of a tool name after its first
//!   disambiguating token, the punctuation up to the arguments (and a tool's sole required
//!   key). They come from
//!   [`tool_call_spans`]: the conversation rendered with a call to each real tool by the
//!   model's own template, token ids diffed against the prompt (never a fragment tokenized
//!   alone, so every cut is a token boundary of a real rendering).
//! - **Verify** spans are guesses copied from earlier in the conversation: prompt lookup
//!   (`NgramProposer`), the same index speculative decoding uses; when the server already runs
//!   speculation, its drafts are these guesses and fill adds none.
//!
//! Both go through speculative decoding's verification (`Sequence::verify`): every row is
//! sampled by the request's own sampler and a span is kept while it equals those draws, the rest
//! trimmed from the cache. So the output — tokens, logprobs, seeded draws — is exactly what
//! decoding one token at a time gives, with fill on or off, under any sampling; a span that is
//! wrong (the model writes a tool name the request does not offer) costs rows, never tokens.

use crate::spec::{NgramProposer, Proposer, SpecConfig};
use ferrolm_core::{FillPlan, FillStats, SpanCounts, TokenId, ToolCallSpan};
use ferrolm_text::Tokenizer;

/// Longest span appended at once (mlx-bun's `MLX_BUN_FILL_MAX_SPAN`).
pub const MAX_SPAN: usize = 32;

/// Verify spans: n-grams of 3 to 6 tokens (a longer match than speculation's default asks,
/// since these run without the user asking for speculation), up to 8 tokens copied.
const COPY_NGRAM: (usize, usize) = (3, 6);
const COPY_MAX: usize = 8;

/// Where the drafts of a step came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Assert,
    Verify,
}

/// One sequence's fill: its request's plan, the copy index, its counters.
pub struct Fill {
    calls: Vec<ToolCallSpan>,
    /// The longest call span: openings further back than this cannot be matched.
    longest: usize,
    /// Prompt lookup for verify spans (gated: rested where its rows cost more than they save).
    copies: Option<NgramProposer>,
    prompt_len: usize,
    pub stats: FillStats,
}

impl Fill {
    pub fn new(plan: FillPlan, prompt_len: usize) -> Self {
        let cfg = SpecConfig { max_drafts: COPY_MAX, ngram_min: COPY_NGRAM.0, ngram_max: COPY_NGRAM.1 };
        let longest = plan.tool_calls.iter().map(|c| c.tokens.len()).max().unwrap_or(0);
        let copies = plan.copies.then(|| NgramProposer::new(&cfg));
        Self { calls: plan.tool_calls, longest, copies, prompt_len, stats: FillStats::default() }
    }

    /// The span to append after `tokens` (prompt ++ generated, the last one pending), at most
    /// `max` tokens: an assert span where the output is inside a tool call's scaffold, else
    /// (when `copy`) a verify span from prompt lookup.
    pub fn propose(&mut self, tokens: &[TokenId], max: usize, copy: bool) -> Option<(Vec<TokenId>, Policy)> {
        let max = max.min(MAX_SPAN);
        if max == 0 {
            return None;
        }
        let generated = &tokens[self.prompt_len.min(tokens.len())..];
        let mut span = asserted_span(&self.calls, self.longest, generated);
        if !span.is_empty() {
            span.truncate(max);
            return Some((span, Policy::Assert));
        }
        let lookup = self.copies.as_mut().filter(|_| copy)?;
        let span = lookup.propose(tokens, max.min(COPY_MAX));
        (!span.is_empty()).then_some((span, Policy::Verify))
    }

    /// Whether an assert span would be appended after `tokens` now (the captured greedy step
    /// hands back to the engine step there).
    pub fn has_assert_span(&self, tokens: &[TokenId]) -> bool {
        let generated = &tokens[self.prompt_len.min(tokens.len())..];
        !asserted_span(&self.calls, self.longest, generated).is_empty()
    }

    /// Counts a verified span: `proposed` rows appended, `kept` of them accepted.
    pub fn record(&mut self, policy: Policy, proposed: usize, kept: usize) {
        let counts = match policy {
            Policy::Assert => &mut self.stats.assert,
            Policy::Verify => &mut self.stats.verify,
        };
        counts.add(&SpanCounts { spans: 1, injected: kept, wasted: proposed - kept });
    }
}

/// The determined continuation of a tool call being written: the longest run of `generated`'s
/// tail found inside some calls' tokens with more after it, then what all those places share
/// after it. The run must be armed: it holds a token with a letter, and starts at the call's
/// opening (Qwen's `<tool_call>`) or at markup before a word (a model that writes the call
/// without the opening tag, `{"name`, is inside the scaffold too; a pretty-printed
/// `{\n  "name": "f",` matches the compact scaffold only from the word `name` on, and
/// continues differently after the comma). Empty when the output is not inside a call's
/// scaffold, or where the calls part (the model picks a name).
pub fn asserted_span(calls: &[ToolCallSpan], longest: usize, generated: &[TokenId]) -> Vec<TokenId> {
    let from = generated.len().saturating_sub(longest.saturating_sub(1));
    for start in from..generated.len() {
        let tail = &generated[start..];
        // Every (call, offset) the tail sits at, with something after it.
        let mut places = calls.iter().flat_map(|c| {
            (0..c.tokens.len().saturating_sub(tail.len())).filter(|&o| &c.tokens[o..o + tail.len()] == tail).map(move |o| (c, o))
        });
        let Some((c, o)) = places.next() else { continue };
        let armed = (o == 0 || !c.letters[o]) && c.letters[o..o + tail.len()].contains(&true);
        if !armed {
            return Vec::new();
        }
        let mut shared = &c.tokens[o + tail.len()..];
        for (c, o) in places {
            let rest = &c.tokens[o + tail.len()..];
            shared = &shared[..shared.iter().zip(rest).take_while(|(a, b)| a == b).count()];
        }
        return shared.to_vec();
    }
    Vec::new()
}

/// Argument objects a probe call is rendered with: two whose first keys differ, so that what
/// the renderings share ends where a real call's arguments begin (for a tool whose arguments
/// are empty, `{}` against one key). Keys are letters, as real keys are, so the token boundary
/// at the opening brace is the one real arguments give. A tool with one required key (`sole`)
/// has it first in both, with values that differ: the shared part then runs through the key
/// (mlx-bun asserts it too; a model that writes an optional key first wastes those rows).
pub fn probe_arguments(parameters: &serde_json::Value) -> [serde_json::Value; 2] {
    use serde_json::json;
    let takes_arguments = parameters["properties"].as_object().is_some_and(|p| !p.is_empty());
    let required: Vec<&str> = parameters["required"].as_array().map_or(Vec::new(), |r| r.iter().filter_map(|k| k.as_str()).collect());
    match (takes_arguments, required.as_slice()) {
        (true, [sole]) => [json!({ *sole: 1 }), json!({ *sole: "x" })],
        (true, _) => [json!({"a": 1}), json!({"b": "x"})],
        (false, _) => [json!({}), json!({"a": 1})],
    }
}

/// The probe renderings [`tool_call_spans`] diffs: per offered tool (OpenAI's `{"type":
/// "function", "function": {"name", "parameters"}}`), `render(messages ++ [an assistant turn
/// calling it])` once per [`probe_arguments`] value. `render` must be the request's own path
/// from messages to prompt ids (the same template, tools and protection), without the
/// generation prompt.
pub fn probe_tools<E>(
    messages: &[serde_json::Value],
    tools: &[serde_json::Value],
    mut render: impl FnMut(Vec<serde_json::Value>) -> Result<Vec<TokenId>, E>,
) -> Result<Vec<Vec<Vec<TokenId>>>, E> {
    let mut probes = Vec::with_capacity(tools.len());
    for tool in tools {
        let f = &tool["function"];
        let Some(name) = f["name"].as_str() else { continue };
        let mut variants = Vec::with_capacity(2);
        for arguments in probe_arguments(&f["parameters"]) {
            let call = serde_json::json!({"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}});
            let mut conversation = messages.to_vec();
            conversation.push(serde_json::json!({"role": "assistant", "content": "", "tool_calls": [call]}));
            variants.push(render(conversation)?);
        }
        probes.push(variants);
    }
    Ok(probes)
}

/// Assert spans from renderings: `prompt` is the request's prompt ids, `probes[i]` the ids of
/// the same conversation rendered (without a generation prompt) with an assistant turn that
/// calls tool i, once per [`probe_arguments`] value. A tool's span is what its probes share
/// after the prompt (they must extend the prompt exactly: a template that renders the
/// assistant's turn differently from its generation prompt gets no spans), cut before any
/// end-of-generation token and to [`MAX_SPAN`].
pub fn tool_call_spans(prompt: &[TokenId], probes: &[Vec<Vec<TokenId>>], tk: &Tokenizer) -> Vec<ToolCallSpan> {
    let mut spans = Vec::new();
    for variants in probes {
        let Some(tails) = variants.iter().map(|ids| ids.strip_prefix(prompt)).collect::<Option<Vec<_>>>() else {
            continue;
        };
        let Some((first, rest)) = tails.split_first() else { continue };
        let shared = rest.iter().fold(first.len(), |n, t| n.min(first.iter().zip(*t).take_while(|(a, b)| a == b).count()));
        let end = first[..shared].iter().position(|t| tk.eos_ids().contains(t)).unwrap_or(shared).min(MAX_SPAN);
        let tokens = first[..end].to_vec();
        let letters: Vec<bool> = tokens.iter().map(|&t| tk.token_bytes(t).iter().any(u8::is_ascii_alphabetic)).collect();
        if tokens.len() >= 2 && letters.contains(&true) {
            spans.push(ToolCallSpan { tokens, letters });
        }
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call of `tokens`; ids from 100 on stand for tokens with a letter.
    fn call(tokens: &[u32]) -> ToolCallSpan {
        ToolCallSpan { tokens: tokens.to_vec(), letters: tokens.iter().map(|&t| t >= 100).collect() }
    }

    #[test]
    fn the_scaffold_then_the_rest_of_a_name_once_it_is_decided() {
        // 109 = opening, 1 2 = scaffold, 105 106 / 105 107 = names sharing a first token, 3 4 =
        // punctuation.
        let calls = [call(&[109, 1, 2, 105, 106, 3, 4]), call(&[109, 1, 2, 105, 107, 3, 4]), call(&[109, 1, 2, 108, 3, 4])];
        let span = |g: &[u32]| asserted_span(&calls, 7, g);
        assert_eq!(span(&[40, 41]), Vec::<u32>::new());
        assert_eq!(span(&[40, 109]), vec![1, 2]);
        // The model chose 105: the two names starting with it still part.
        assert_eq!(span(&[40, 109, 1, 2, 105]), Vec::<u32>::new());
        assert_eq!(span(&[40, 109, 1, 2, 105, 107]), vec![3, 4]);
        assert_eq!(span(&[109, 1, 2, 108]), vec![3, 4]);
        // Past the punctuation (the arguments), or off the scaffold: nothing.
        assert_eq!(span(&[109, 1, 2, 108, 3, 4]), Vec::<u32>::new());
        assert_eq!(span(&[109, 1, 2, 30]), Vec::<u32>::new());
        // A second call opens after the first.
        assert_eq!(span(&[109, 1, 2, 108, 3, 4, 50, 51, 109, 1]), vec![2]);
    }

    #[test]
    fn a_call_written_without_its_opening_is_armed_by_a_word() {
        // 1 2 = `<tool_call>\n`, 3 = `{"`, 110 = `name`, 4 = `": "`, 111 / 112 = names, 5 = `",`.
        let calls = [call(&[1, 2, 3, 110, 4, 111, 5]), call(&[1, 2, 3, 110, 4, 112, 5])];
        let span = |g: &[u32]| asserted_span(&calls, 7, g);
        // Bare markup arms nothing, a lone word inside the scaffold neither.
        assert_eq!(span(&[3]), Vec::<u32>::new());
        assert_eq!(span(&[1, 2]), Vec::<u32>::new());
        assert_eq!(span(&[9, 110]), Vec::<u32>::new());
        assert_eq!(span(&[3, 110]), vec![4]);
        assert_eq!(span(&[3, 110, 4, 112]), vec![5]);
        // Pretty-printed (`{\n  "name` is not the scaffold's `{"name`): the longest run starts
        // at a word, so nothing is appended.
        assert_eq!(span(&[7, 110, 4]), Vec::<u32>::new());
        assert_eq!(span(&[7, 110, 4, 112]), Vec::<u32>::new());
        // The opening holds letters (`<tool_call>`): a bare `{"name` still enters.
        let calls = [call(&[120, 2, 3, 110, 4, 111, 5]), call(&[120, 2, 3, 110, 4, 112, 5])];
        assert_eq!(asserted_span(&calls, 7, &[3, 110]), vec![4]);
        assert_eq!(asserted_span(&calls, 7, &[120]), vec![2, 3, 110, 4]);
    }
}
