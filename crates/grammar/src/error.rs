//! The crate's one error type. `Invalid` is the request's fault (the server answers 400 naming
//! `field`); `Tokenizer` is the model's (the server cannot offer structured output for it);
//! `Generation` happens mid-sequence (the engine finishes that sequence with a clear reason).

/// What went wrong, with a message meant for the API client or the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// A constraint the request asked for cannot be built: a bad or unsupported JSON schema, a
    /// regex or Lark grammar that does not compile, a tool list that cannot be constrained.
    /// `field` names the part of the request at fault (`json_schema`, `regex`, `grammar`,
    /// `choice`, `tools`).
    #[error("invalid {field}: {message}")]
    Invalid { field: &'static str, message: String },
    /// The model's tokenizer cannot back a token environment (set up once per model).
    #[error("structured output is unavailable for this model: {0}")]
    Tokenizer(String),
    /// A running constraint failed: a token it did not allow, a parser limit, an internal error.
    #[error("constraint failed: {0}")]
    Generation(String),
}

impl GrammarError {
    pub(crate) fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        GrammarError::Invalid { field, message: message.into() }
    }
}
