//! llama.cpp's GBNF grammars (llama-server's `grammar` field) translated into llguidance's Lark
//! dialect, accepting exactly the strings llama.cpp accepts (checked against llama.cpp's own
//! parser in tests/gbnf.rs). GBNF that llama.cpp refuses is refused here with the line and
//! column; token references (`<...>`, `!<...>`) are refused: they name token ids of llama.cpp's
//! vocabulary handling.

mod ast;
mod lark;
mod parse;
mod recursion;
mod runs;

use crate::GrammarError;

/// The request field GBNF arrives in.
const FIELD: &str = "grammar";

/// The Lark grammar for a GBNF grammar, or an `Invalid` error naming `grammar` with the line
/// and column of the problem.
pub fn gbnf_to_lark(src: &str) -> Result<String, GrammarError> {
    to_lark_rule(src, "start")
}

/// [`gbnf_to_lark`] with the grammar's start as rule `start` (to embed it in a larger grammar:
/// its own rules are named `r<n>` and `T<n>`).
pub(crate) fn to_lark_rule(src: &str, start: &str) -> Result<String, GrammarError> {
    let grammar = parse::parse(src).map_err(|e| {
        let (line, col) = line_col(src, e.at);
        GrammarError::invalid(FIELD, format!("GBNF line {line}, column {col}: {}", e.message))
    })?;
    if let Some(rule) = recursion::left_recursive(&grammar) {
        let msg = format!("GBNF rule '{rule}' is left-recursive (llama.cpp refuses left recursion)");
        return Err(GrammarError::invalid(FIELD, msg));
    }
    Ok(lark::to_lark(&grammar, start))
}

/// 1-based line and column (in characters) of character offset `at`.
fn line_col(src: &str, at: usize) -> (usize, usize) {
    let mut line = 1;
    let mut col = 1;
    for c in src.chars().take(at) {
        if c == '\n' {
            line += 1;
            col = 1;
        } else {
            col += 1;
        }
    }
    (line, col)
}

#[cfg(test)]
mod tests;
