//! A parsed GBNF grammar as llguidance Lark, accepting exactly the same strings.
//!
//! GBNF is a context-free grammar over characters with no lexer; llguidance runs an Earley
//! parser over lexemes, and its lexer is greedy (a lexeme extends while the next byte can
//! extend it, with no going back). So a multi-character lexeme followed by something that
//! could also continue it would cut the text differently from GBNF (`[a-z]+ "s"` on "cats"),
//! and the translation would refuse strings llama.cpp accepts. Two shapes keep it exact:
//! - a grammar whose `root` is regular (no recursion below it) is one terminal: a single
//!   regex over the whole output, with no lexeme boundaries at all;
//! - otherwise every lexeme is exactly one character (each character of a literal, a class,
//!   `.`), so lexing is unambiguous and the Earley parser decides everything, like llama.cpp's
//!   character-by-character stacks; except repetitions of one class that `runs.rs` proves
//!   safe to lex whole (most of the mask time of a one-character lexeme grammar is in them).

use super::ast::{Grammar, Node};
use super::runs;
use crate::spec::lark_literal;

/// The Lark grammar, its start rule named `start`.
pub(crate) fn to_lark(g: &Grammar, start: &str) -> String {
    let regular = regular_rules(g);
    let reachable = reachable(g);
    let terminal = regular[g.root];
    let mut g = g.clone();
    let keep = if terminal {
        Vec::new()
    } else {
        let n = runs::mark(&mut g);
        runs::safe(&g, n)
    };
    let name = |i: usize| if terminal { format!("T{i}") } else { format!("r{i}") };
    let mut out = format!("{start}: {}\n", name(g.root));
    for (i, rule) in g.rules.iter().enumerate().filter(|(i, _)| reachable[*i]) {
        let body = Emit { terminal, name: &name, keep: &keep }.alternatives(&rule.alternatives);
        out.push_str(&format!("{}: {body}\n", name(i)));
    }
    out
}

/// Rules that only reach other non-recursive rules: each is a regular language.
fn regular_rules(g: &Grammar) -> Vec<bool> {
    let refs: Vec<Vec<usize>> = g
        .rules
        .iter()
        .map(|r| {
            let mut out = Vec::new();
            r.alternatives.iter().flatten().for_each(|n| n.refs(&mut out));
            out
        })
        .collect();
    let mut regular = vec![false; g.rules.len()];
    loop {
        let mut changed = false;
        for i in 0..g.rules.len() {
            if !regular[i] && refs[i].iter().all(|&j| regular[j]) {
                regular[i] = true;
                changed = true;
            }
        }
        if !changed {
            return regular;
        }
    }
}

fn reachable(g: &Grammar) -> Vec<bool> {
    let mut seen = vec![false; g.rules.len()];
    let mut todo = vec![g.root];
    while let Some(i) = todo.pop() {
        if std::mem::replace(&mut seen[i], true) {
            continue;
        }
        g.rules[i].alternatives.iter().flatten().for_each(|n| n.refs(&mut todo));
    }
    seen
}

struct Emit<'a, F: Fn(usize) -> String> {
    /// Emitting terminals (one regex) rather than rules over one-character lexemes.
    terminal: bool,
    name: &'a F,
    /// Which runs are lexed whole.
    keep: &'a [bool],
}

impl<F: Fn(usize) -> String> Emit<'_, F> {
    fn alternatives(&self, alts: &[Vec<Node>]) -> String {
        alts.iter().map(|seq| self.sequence(seq)).collect::<Vec<_>>().join(" | ")
    }

    fn sequence(&self, seq: &[Node]) -> String {
        if seq.is_empty() {
            return "\"\"".into();
        }
        seq.iter().map(|n| self.node(n)).collect::<Vec<_>>().join(" ")
    }

    fn node(&self, node: &Node) -> String {
        match node {
            Node::Literal(chars) if chars.is_empty() => "\"\"".into(),
            Node::Literal(chars) if self.terminal => lark_literal(&chars.iter().collect::<String>()),
            Node::Literal(chars) => {
                let each: Vec<String> = chars.iter().map(|c| lark_literal(&c.to_string())).collect();
                format!("({})", each.join(" "))
            }
            Node::Class { .. } | Node::Any => format!("/{}/", class_body(node)),
            Node::Ref(i) => (self.name)(*i),
            Node::Group(alts) => format!("({})", self.alternatives(alts)),
            Node::Repeat { node, min, max } => quantified(&format!("({})", self.node(node)), *min, *max),
            Node::Run { id, class, min, max } if self.keep[*id] => match (min, max) {
                (0, max) => format!("({})?", run_regex(class, 1, *max)),
                (m, max) => run_regex(class, *m, *max),
            },
            Node::Run { class, min, max, .. } => quantified(&format!("({})", self.node(class)), *min, *max),
        }
    }
}

/// `inner` repeated (`inner` already parenthesised).
fn quantified(inner: &str, min: u32, max: Option<u32>) -> String {
    match (min, max) {
        (_, Some(0)) => "\"\"".into(),
        (0, None) => format!("{inner}*"),
        (1, None) => format!("{inner}+"),
        (0, Some(1)) => format!("{inner}?"),
        (m, None) => format!("{inner}{{{m},}}"),
        (m, Some(n)) if m == n => format!("{inner}{{{m}}}"),
        (m, Some(n)) => format!("{inner}{{{m},{n}}}"),
    }
}

/// One lexeme for `min..=max` characters of a one-character node (`min` at least 1).
fn run_regex(class: &Node, min: u32, max: Option<u32>) -> String {
    let body = class_body(class);
    match max {
        None if min == 1 => format!("/{body}+/"),
        None => format!("/{body}{{{min},}}/"),
        Some(n) if n == min => format!("/{body}{{{min}}}/"),
        Some(n) => format!("/{body}{{{min},{n}}}/"),
    }
}

/// The regex class of a one-character node: `[...]` with every character but ASCII letters
/// and digits written as `\x{HEX}` (no escaping rules of Lark's or the regex dialect's to get
/// wrong).
fn class_body(node: &Node) -> String {
    let one = |c: char| if c.is_ascii_alphanumeric() { c.to_string() } else { format!("\\x{{{:X}}}", c as u32) };
    let (negated, ranges) = match node {
        Node::Class { negated, ranges } => (*negated, ranges.clone()),
        Node::Literal(c) if c.len() == 1 => (false, vec![(c[0], c[0])]),
        _ => (false, vec![('\0', char::MAX)]),
    };
    let body: String =
        ranges.iter().map(|&(lo, hi)| if lo == hi { one(lo) } else { format!("{}-{}", one(lo), one(hi)) }).collect();
    format!("[{}{body}]", if negated { "^" } else { "" })
}
