//! A parsed GBNF grammar: its rules as written (groups and repetitions kept as trees), in the
//! order llama.cpp numbers them.

/// One element of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node {
    /// A string literal's characters (maybe none: `""` matches the empty string).
    Literal(Vec<char>),
    /// `[...]` / `[^...]`: inclusive code point ranges. llama.cpp reads `[]` and `[^]` as no
    /// element at all, so the parser gives those as an empty `Literal`.
    Class { negated: bool, ranges: Vec<(char, char)> },
    /// `.`: any one character.
    Any,
    /// A rule by its index in [`Grammar::rules`].
    Ref(usize),
    /// `( a | b )`.
    Group(Vec<Vec<Node>>),
    /// `x*`, `x+`, `x?`, `x{m}`, `x{m,}`, `x{m,n}` (`max: None` is unbounded).
    Repeat { node: Box<Node>, min: u32, max: Option<u32> },
    /// A repetition of one character (`class`: a class, `.` or a one-character literal) that
    /// may become one lexeme (`runs.rs`): run number `id`; written by the translator, never by
    /// the parser.
    Run { id: usize, class: Box<Node>, min: u32, max: Option<u32> },
}

/// A rule: its name and alternatives (each a sequence, maybe empty).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rule {
    pub name: String,
    pub alternatives: Vec<Vec<Node>>,
}

/// Every rule named in the grammar (referenced or defined, in order of first appearance, as
/// llama.cpp numbers its symbols), and which one is `root`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Grammar {
    pub rules: Vec<Rule>,
    pub root: usize,
}

impl Node {
    /// Rules this node refers to, directly or inside its groups and repetitions.
    pub fn refs(&self, out: &mut Vec<usize>) {
        match self {
            Node::Ref(i) => out.push(*i),
            Node::Group(alts) => alts.iter().flatten().for_each(|n| n.refs(out)),
            Node::Repeat { node, .. } => node.refs(out),
            Node::Literal(_) | Node::Class { .. } | Node::Any | Node::Run { .. } => {}
        }
    }
}
