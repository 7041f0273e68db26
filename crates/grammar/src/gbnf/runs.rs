//! Faster masks for recursive grammars without changing their language: a repetition of one
//! character class (`[0-9]+`, `[^"\\]*`, `[ \t]{0,20}`) becomes one lexeme (a "run") where
//! llguidance's greedy lexer provably cuts the text where GBNF would, instead of one lexeme
//! per character.
//!
//! A run lexeme R of class C is exact when, in UTF-8 bytes:
//! - nothing that may follow R starts with a byte that starts a character of C (then every
//!   parse has the run maximal, which is what greedy lexing takes), and
//! - no other lexeme that may start where R starts begins with such a byte (then the first
//!   byte decides between R and the others, and R is never entered by mistake).
//!
//! Both are checked on FIRST/FOLLOW sets of lexeme occurrences over the grammar's rules (sets
//! that over-approximate what can happen, so the check is conservative); a run that fails is
//! written one character at a time again, and the check repeats until every kept run passes.
//! `(C | E)*` with one single-character alternative is first rewritten to `C* (E C*)*` (E not
//! nullable), so that the run never follows itself.

use super::ast::{Grammar, Node};

/// Rewrites candidate repetitions into [`Node::Run`]s; returns how many.
pub(crate) fn mark(g: &mut Grammar) -> usize {
    let mut next = 0;
    let nullable = nullable_rules(g);
    for rule in &mut g.rules {
        for seq in &mut rule.alternatives {
            for node in seq.iter_mut() {
                mark_node(node, &mut next, &nullable);
            }
        }
    }
    next
}

fn is_one_char(node: &Node) -> bool {
    matches!(node, Node::Class { .. } | Node::Any) || matches!(node, Node::Literal(c) if c.len() == 1)
}

fn mark_node(node: &mut Node, next: &mut usize, nullable: &[bool]) {
    match node {
        Node::Repeat { node: inner, min, max } if is_one_char(inner) && *max != Some(0) => {
            *next += 1;
            *node = Node::Run { id: *next - 1, class: inner.clone(), min: *min, max: *max };
        }
        Node::Repeat { node: inner, min: 0, max: None } if loop_with_one_char(inner, nullable) => {
            let Node::Group(alts) = inner.as_mut() else { unreachable!() };
            let k = alts.iter().position(|a| a.len() == 1 && is_one_char(&a[0])).expect("checked");
            let class = Box::new(alts.remove(k).remove(0));
            for n in alts.iter_mut().flatten() {
                mark_node(n, next, nullable);
            }
            let run = |id| Node::Run { id, class: class.clone(), min: 0, max: None };
            let (first, second) = (*next, *next + 1);
            *next += 2;
            let rest = Node::Group(vec![vec![Node::Group(std::mem::take(alts)), run(second)]]);
            *node = Node::Group(vec![vec![run(first), Node::Repeat { node: Box::new(rest), min: 0, max: None }]]);
        }
        Node::Repeat { node: inner, .. } => mark_node(inner, next, nullable),
        Node::Group(alts) => alts.iter_mut().flatten().for_each(|n| mark_node(n, next, nullable)),
        _ => {}
    }
}

/// `(C | E1 | …)*` with exactly one single-character alternative C and no nullable E.
fn loop_with_one_char(inner: &Node, nullable: &[bool]) -> bool {
    let Node::Group(alts) = inner else { return false };
    let ones = alts.iter().filter(|a| a.len() == 1 && is_one_char(&a[0])).count();
    ones == 1 && alts.len() > 1 && alts.iter().all(|a| !seq_nullable(a, nullable))
}

fn nullable_rules(g: &Grammar) -> Vec<bool> {
    let mut n = vec![false; g.rules.len()];
    loop {
        let mut changed = false;
        for (i, r) in g.rules.iter().enumerate() {
            if !n[i] && r.alternatives.iter().any(|a| seq_nullable(a, &n)) {
                n[i] = true;
                changed = true;
            }
        }
        if !changed {
            return n;
        }
    }
}

fn seq_nullable(seq: &[Node], rules: &[bool]) -> bool {
    seq.iter().all(|n| node_nullable(n, rules))
}

fn node_nullable(node: &Node, rules: &[bool]) -> bool {
    match node {
        Node::Literal(c) => c.is_empty(),
        Node::Class { .. } | Node::Any => false,
        Node::Ref(i) => rules[*i],
        Node::Group(alts) => alts.iter().any(|a| seq_nullable(a, rules)),
        Node::Repeat { node, min, max } => *min == 0 || *max == Some(0) || node_nullable(node, rules),
        Node::Run { min, .. } => *min == 0,
    }
}

/// Which of the `n` runs may be one lexeme (the others are written a character at a time).
pub(crate) fn safe(g: &Grammar, n: usize) -> Vec<bool> {
    let mut keep = vec![true; n];
    loop {
        let cfg = Cfg::build(g, &keep);
        let failing = cfg.unsafe_runs();
        if failing.is_empty() {
            return keep;
        }
        for r in failing {
            keep[r] = false;
        }
    }
}

/// 256 bits: the bytes a lexeme may start with.
type Bytes = [u64; 4];

fn set_byte(b: &mut Bytes, x: u8) {
    b[x as usize / 64] |= 1 << (x % 64);
}

fn overlap(a: &Bytes, b: &Bytes) -> bool {
    a.iter().zip(b).any(|(x, y)| x & y != 0)
}

/// A symbol of the lowered grammar: a lexeme occurrence or a rule.
#[derive(Clone, Copy)]
enum Sym {
    Lex(usize),
    Rule(usize),
}

/// The grammar lowered to rules over lexeme occurrences, as the translation would lex it.
struct Cfg {
    rules: Vec<Vec<Vec<Sym>>>,
    /// Per lexeme occurrence: its first bytes, and the run it is (if kept as a run).
    lexemes: Vec<(Bytes, Option<usize>)>,
    root: usize,
}

impl Cfg {
    fn build(g: &Grammar, keep: &[bool]) -> Cfg {
        let mut cfg = Cfg { rules: vec![Vec::new(); g.rules.len()], lexemes: Vec::new(), root: g.root };
        for (i, r) in g.rules.iter().enumerate() {
            cfg.rules[i] = r.alternatives.iter().map(|a| cfg.sequence(a, keep)).collect();
        }
        cfg
    }

    fn sequence(&mut self, seq: &[Node], keep: &[bool]) -> Vec<Sym> {
        let mut out = Vec::new();
        for n in seq {
            self.node(n, keep, &mut out);
        }
        out
    }

    fn lexeme(&mut self, first: Bytes, run: Option<usize>) -> Sym {
        self.lexemes.push((first, run));
        Sym::Lex(self.lexemes.len() - 1)
    }

    fn rule(&mut self, alts: Vec<Vec<Sym>>) -> Sym {
        self.rules.push(alts);
        Sym::Rule(self.rules.len() - 1)
    }

    fn node(&mut self, node: &Node, keep: &[bool], out: &mut Vec<Sym>) {
        match node {
            Node::Literal(chars) => {
                for &c in chars {
                    out.push(self.lexeme(first_bytes(&Node::Literal(vec![c])), None));
                }
            }
            Node::Class { .. } | Node::Any => out.push(self.lexeme(first_bytes(node), None)),
            Node::Ref(i) => out.push(Sym::Rule(*i)),
            Node::Group(alts) => {
                let lowered = alts.iter().map(|a| self.sequence(a, keep)).collect();
                out.push(self.rule(lowered));
            }
            Node::Repeat { node, max, .. } => {
                if *max != Some(0) {
                    let mut body = Vec::new();
                    self.node(node, keep, &mut body);
                    out.push(self.optional_loop(body));
                }
            }
            Node::Run { id, class, min, .. } if keep[*id] => {
                let lex = self.lexeme(first_bytes(class), Some(*id));
                out.push(if *min == 0 { self.rule(vec![vec![lex], Vec::new()]) } else { lex });
            }
            Node::Run { class, .. } => {
                let lex = self.lexeme(first_bytes(class), None);
                out.push(self.optional_loop(vec![lex]));
            }
        }
    }

    /// `A -> body A | ε`: over-approximates any repetition of `body` (more follows, never fewer).
    fn optional_loop(&mut self, body: Vec<Sym>) -> Sym {
        let id = self.rules.len();
        let mut again = body;
        again.push(Sym::Rule(id));
        self.rule(vec![again, Vec::new()])
    }

    /// Runs whose lexeme is not provably exact.
    fn unsafe_runs(&self) -> Vec<usize> {
        let (first, nullable) = self.first_sets();
        let follow = self.follow_sets(&first, &nullable);
        let n = self.lexemes.len();
        let mut bad = Vec::new();
        for (r, (bytes, run)) in self.lexemes.iter().enumerate() {
            let Some(run) = run else { continue };
            let clash = |set: &[bool]| (0..n).any(|s| s != r && set[s] && overlap(&self.lexemes[s].0, bytes));
            let follows_badly = clash(&follow[r]);
            let starts_with_others =
                (0..n).any(|z| follow[z][r] && clash(&follow[z])) || (first[self.root][r] && clash(&first[self.root]));
            if follows_badly || starts_with_others {
                bad.push(*run);
            }
        }
        bad
    }

    /// FIRST of every rule (as lexeme flags) and which rules are nullable.
    fn first_sets(&self) -> (Vec<Vec<bool>>, Vec<bool>) {
        let n = self.lexemes.len();
        let mut first = vec![vec![false; n]; self.rules.len()];
        let mut nullable = vec![false; self.rules.len()];
        loop {
            let mut changed = false;
            for (a, alts) in self.rules.iter().enumerate() {
                for alt in alts {
                    let (set, eps) = self.first_of(alt, &first, &nullable);
                    for (x, &s) in set.iter().enumerate() {
                        if s && !first[a][x] {
                            first[a][x] = true;
                            changed = true;
                        }
                    }
                    if eps && !nullable[a] {
                        nullable[a] = true;
                        changed = true;
                    }
                }
            }
            if !changed {
                return (first, nullable);
            }
        }
    }

    /// FIRST of a symbol string, and whether it is nullable.
    fn first_of(&self, syms: &[Sym], first: &[Vec<bool>], nullable: &[bool]) -> (Vec<bool>, bool) {
        let mut set = vec![false; self.lexemes.len()];
        for s in syms {
            match *s {
                Sym::Lex(l) => {
                    set[l] = true;
                    return (set, false);
                }
                Sym::Rule(r) => {
                    set.iter_mut().zip(&first[r]).for_each(|(x, &y)| *x |= y);
                    if !nullable[r] {
                        return (set, false);
                    }
                }
            }
        }
        (set, true)
    }

    /// FOLLOW of every lexeme occurrence (as lexeme flags).
    fn follow_sets(&self, first: &[Vec<bool>], nullable: &[bool]) -> Vec<Vec<bool>> {
        let n = self.lexemes.len();
        let mut lex_follow = vec![vec![false; n]; n];
        let mut rule_follow = vec![vec![false; n]; self.rules.len()];
        loop {
            let mut changed = false;
            for (a, alts) in self.rules.iter().enumerate() {
                for alt in alts {
                    for (k, s) in alt.iter().enumerate() {
                        let (mut set, eps) = self.first_of(&alt[k + 1..], first, nullable);
                        if eps {
                            set.iter_mut().zip(&rule_follow[a]).for_each(|(x, &y)| *x |= y);
                        }
                        let target = match *s {
                            Sym::Lex(l) => &mut lex_follow[l],
                            Sym::Rule(r) => &mut rule_follow[r],
                        };
                        for (x, &v) in set.iter().enumerate() {
                            if v && !target[x] {
                                target[x] = true;
                                changed = true;
                            }
                        }
                    }
                }
            }
            if !changed {
                return lex_follow;
            }
        }
    }
}

/// The bytes the UTF-8 encodings of a one-character node's characters may start with.
fn first_bytes(node: &Node) -> Bytes {
    let mut b = [0; 4];
    let ranges: Vec<(u32, u32)> = match node {
        Node::Literal(c) => c.iter().map(|&c| (c as u32, c as u32)).collect(),
        Node::Class { negated: false, ranges } => ranges.iter().map(|&(l, h)| (l as u32, h as u32)).collect(),
        Node::Class { negated: true, ranges } => complement(ranges),
        _ => vec![(0, 0x10FFFF)],
    };
    for (lo, hi) in ranges {
        // Lead bytes are monotonic in the code point within each UTF-8 length.
        for (start, end, lead) in [(0, 0x7F, 0u32), (0x80, 0x7FF, 1), (0x800, 0xFFFF, 2), (0x10000, 0x10FFFF, 3)] {
            let (l, h) = (lo.max(start), hi.min(end));
            if l > h {
                continue;
            }
            let byte = |cp: u32| match lead {
                0 => cp,
                1 => 0xC0 | cp >> 6,
                2 => 0xE0 | cp >> 12,
                _ => 0xF0 | cp >> 18,
            };
            for x in byte(l)..=byte(h) {
                set_byte(&mut b, x as u8);
            }
        }
    }
    b
}

/// The code points outside `ranges`.
fn complement(ranges: &[(char, char)]) -> Vec<(u32, u32)> {
    let mut sorted: Vec<(u32, u32)> = ranges.iter().map(|&(l, h)| (l as u32, h as u32)).collect();
    sorted.sort_unstable();
    let mut out = Vec::new();
    let mut next = 0u32;
    for (l, h) in sorted {
        if l > next {
            out.push((next, l - 1));
        }
        next = next.max(h + 1);
    }
    if next <= 0x10FFFF {
        out.push((next, 0x10FFFF));
    }
    out
}
