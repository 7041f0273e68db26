//! `Grammars`: one per model. Holds llguidance's parser factory (the token trie and its
//! precomputed token slices, built once: ~0.1–1 s for a large vocabulary) and compiles
//! request constraints against it.

use std::sync::Arc;

use ferrolm_text::Tokenizer;
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};

use crate::constraint::tidy;
use crate::env::token_env;
use crate::{Constraint, ConstraintSpec, GrammarError};

/// The model's constraint compiler; cheap to clone (shared), `Send + Sync`.
#[derive(Clone)]
pub struct Grammars {
    inner: Arc<Inner>,
}

struct Inner {
    factory: ParserFactory,
    tokenizer: Arc<Tokenizer>,
    width: usize,
}

impl Grammars {
    /// Sets up structured output for a model: its tokenizer, the ids that end a generation
    /// (the tokenizer's EOS ids plus any the model's config adds) and the width of its logits
    /// (at least the vocabulary; wider heads, like Qwen's 151,936, pad ids that no grammar
    /// ever allows).
    pub fn new(tokenizer: Arc<Tokenizer>, eos_ids: &[u32], logits_width: usize) -> Result<Grammars, GrammarError> {
        let env = token_env(tokenizer.clone(), eos_ids, logits_width)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        // A library does not print: llguidance's warnings would go to stderr.
        factory.quiet();
        // Errors go back to API clients: the message, not a dump of the grammar and parser.
        *factory.limits_mut() = ParserLimits { verbose_errors: false, ..ParserLimits::default() };
        Ok(Grammars { inner: Arc::new(Inner { factory, tokenizer, width: logits_width }) })
    }

    /// Compiles a request's constraint into a fresh sequence state. Errors name what is wrong
    /// (the server's 400); compiling a large schema can take milliseconds, so call it off the
    /// engine's step (e.g. in the request handler). Clone the result for `n` choices.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, GrammarError> {
        let field = spec.field();
        let grammar = spec.to_grammar(&self.inner.tokenizer)?;
        match self.matcher(grammar) {
            Ok(m) => Ok(Constraint::new(m, self.inner.width)),
            Err(msg) => Err(match spec {
                ConstraintSpec::ToolCalls(tools) => tools
                    .blame(|schema| self.matcher(TopLevelGrammar::from_json_schema(schema.clone())).map(|_| ()))
                    .unwrap_or_else(|| GrammarError::invalid(field, msg)),
                _ => GrammarError::invalid(field, msg),
            }),
        }
    }

    /// The logits' width the masks cover.
    pub fn width(&self) -> usize {
        self.inner.width
    }

    fn matcher(&self, grammar: TopLevelGrammar) -> Result<Matcher, String> {
        let parser = self.inner.factory.create_parser(grammar).map_err(|e| tidy(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(tidy(&e)),
            None => Ok(matcher),
        }
    }
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("width", &self.inner.width).finish()
    }
}
