//! Structured output: constraints on what a model may generate (JSON objects, JSON schemas,
//! regexes, Lark and GBNF grammars, choices, tool calls), enforced token by token with
//! [llguidance](https://github.com/guidance-ai/llguidance) over the model's own tokenizer.
//! Knows tokenizers, not models: the engine owns a [`Constraint`] per sequence and asks it for
//! each row's mask; the server turns request fields into a [`ConstraintSpec`] and compile
//! errors into 400s. See `docs/grammar.md`.
//!
//! ```ignore
//! let grammars = Grammars::new(tokenizer, &eos_ids, logits_width)?;   // once per model
//! let mut c = grammars.compile(&ConstraintSpec::from_response_format(&rf)?.unwrap())?;
//! loop {
//!     let forced = c.forced_tokens();                   // jump-forward: append these unsampled
//!     let mask = c.mask()?;                             // -> Mask::Allowed(mask)
//!     let token = sample(mask);
//!     c.consume(token)?;
//!     if c.is_stopped() { break }                       // Status::Accepted or Failed
//! }
//! ```

mod constraint;
mod env;
mod error;
mod gbnf;
mod grammars;
mod spec;
mod tools;

pub use constraint::{Constraint, Status};
pub use error::GrammarError;
pub use gbnf::gbnf_to_lark;
/// The tool description tool calls are constrained by (the same type the output parser uses).
pub use ferrolm_text::ToolSpec;
pub use grammars::Grammars;
pub use spec::ConstraintSpec;
pub use tools::{ToolCallFormat, ToolCallSpec, ToolChoice};

#[cfg(test)]
mod tests {
    /// The engine moves constraints between threads; the server shares the compiler.
    #[test]
    fn public_types_are_send_and_sync_where_needed() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<super::Constraint>();
        send_sync::<super::Grammars>();
        send_sync::<super::GrammarError>();
    }
}
