//! llama.cpp refuses left-recursive grammars ("unsupported grammar, left recursion detected"):
//! its parser is a stack machine that would never terminate on them. llguidance's Earley parser
//! would run them, but a grammar llama-server refuses is refused here too, found the same way:
//! on llama.cpp's own lowering of groups and repetitions into rules, where a rule "may be empty"
//! only when one of its alternatives is literally empty.

use super::ast::{Grammar, Node};

/// A lowered rule's alternatives: `None` is a character, `Some(i)` a reference to rule `i`.
type Lowered = Vec<Vec<Option<usize>>>;

/// The name of a rule (as written) on a left-recursive cycle, if there is one.
pub(crate) fn left_recursive(g: &Grammar) -> Option<String> {
    let mut low = Lowering { rules: g.rules.iter().map(|_| Vec::new()).collect(), owner: (0..g.rules.len()).collect() };
    for (i, rule) in g.rules.iter().enumerate() {
        low.rules[i] = rule.alternatives.iter().map(|seq| low.sequence(seq, i)).collect();
    }
    let edges = low.left_edges();
    find_cycle(&edges).map(|r| g.rules[low.owner[r]].name.clone())
}

struct Lowering {
    rules: Vec<Lowered>,
    /// The written rule each lowered rule came from.
    owner: Vec<usize>,
}

impl Lowering {
    fn new_rule(&mut self, alts: Lowered, owner: usize) -> usize {
        self.rules.push(alts);
        self.owner.push(owner);
        self.rules.len() - 1
    }

    fn sequence(&mut self, seq: &[Node], owner: usize) -> Vec<Option<usize>> {
        let mut out = Vec::new();
        for node in seq {
            self.element(node, owner, &mut out);
        }
        out
    }

    /// llama.cpp's `parse_sequence` for one element (with its repetition rewrite).
    fn element(&mut self, node: &Node, owner: usize, out: &mut Vec<Option<usize>>) {
        match node {
            Node::Literal(chars) => out.extend(chars.iter().map(|_| None)),
            Node::Class { .. } | Node::Any | Node::Run { .. } => out.push(None),
            Node::Ref(i) => out.push(Some(*i)),
            Node::Group(alts) => {
                let lowered = alts.iter().map(|seq| self.sequence(seq, owner)).collect();
                out.push(Some(self.new_rule(lowered, owner)));
            }
            Node::Repeat { node, min, max } => {
                let mut s = Vec::new();
                self.element(node, owner, &mut s);
                for _ in 0..*min {
                    out.extend_from_slice(&s);
                }
                let optional = max.map_or(1, |m| m - min);
                let mut last = None;
                for k in 0..optional {
                    let id = self.rules.len();
                    let mut body = s.clone();
                    match max {
                        None => body.push(Some(id)),
                        Some(_) if k > 0 => body.push(last),
                        Some(_) => {}
                    }
                    last = Some(self.new_rule(vec![body, Vec::new()], owner));
                }
                if optional > 0 {
                    out.push(last);
                }
            }
        }
    }

    /// For each rule, the rules it can begin with (past leading rules with an empty alternative).
    fn left_edges(&self) -> Vec<Vec<usize>> {
        let may_be_empty: Vec<bool> = self.rules.iter().map(|alts| alts.iter().any(Vec::is_empty)).collect();
        let leading = |alt: &Vec<Option<usize>>| {
            let mut out = Vec::new();
            for e in alt {
                match e {
                    Some(r) => {
                        out.push(*r);
                        if !may_be_empty[*r] {
                            break;
                        }
                    }
                    None => break,
                }
            }
            out
        };
        self.rules.iter().map(|alts| alts.iter().flat_map(leading).collect()).collect()
    }
}

/// A rule on a cycle of `edges`, by depth-first search with an explicit stack.
fn find_cycle(edges: &[Vec<usize>]) -> Option<usize> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    let mut mark = vec![Mark::New; edges.len()];
    for start in 0..edges.len() {
        if mark[start] != Mark::New {
            continue;
        }
        let mut stack = vec![(start, 0usize)];
        mark[start] = Mark::Open;
        while let Some((node, next)) = stack.last_mut() {
            let node = *node;
            if let Some(&succ) = edges[node].get(*next) {
                *next += 1;
                match mark[succ] {
                    Mark::Open => return Some(succ),
                    Mark::New => {
                        mark[succ] = Mark::Open;
                        stack.push((succ, 0));
                    }
                    Mark::Done => {}
                }
            } else {
                mark[node] = Mark::Done;
                stack.pop();
            }
        }
    }
    None
}
