//! Masks are exactly the tokens that keep the output a valid prefix. The oracle is independent
//! of llguidance: a regex's DFA (regex-automata) over the bytes of every token of the real
//! vocabulary (SmolLM2's 49,152 and Gemma 3's 262,144), at every step of seeded random walks.

mod common;

use common::*;
use ferrolm_grammar::{Constraint, ConstraintSpec, Grammars, Status};
use ferrolm_text::Tokenizer;
use rand::Rng;
use regex_automata::dfa::{dense, Automaton};
use regex_automata::{Anchored, Input, MatchKind};
use serde_json::json;

/// Which byte strings are prefixes of a match (`live`) or matches (`full`) of a regex.
struct Oracle {
    dfa: dense::DFA<Vec<u32>>,
}

impl Oracle {
    fn new(rx: &str) -> Oracle {
        // All matches, not leftmost-first: a leftmost-first DFA drops continuations that a
        // higher-priority branch already matched.
        let config = dense::Config::new().match_kind(MatchKind::All);
        let dfa = dense::Builder::new().configure(config).build(&format!("(?:{rx})$")).expect("oracle regex");
        Oracle { dfa }
    }

    fn state(&self, bytes: &[u8]) -> Option<regex_automata::util::primitives::StateID> {
        let mut s = self.dfa.start_state_forward(&Input::new("").anchored(Anchored::Yes)).unwrap();
        for &b in bytes {
            s = self.dfa.next_state(s, b);
            if self.dfa.is_dead_state(s) {
                return None;
            }
        }
        Some(s)
    }

    fn live(&self, bytes: &[u8]) -> bool {
        self.state(bytes).is_some()
    }

    fn full(&self, bytes: &[u8]) -> bool {
        self.state(bytes).is_some_and(|s| self.dfa.is_match_state(self.dfa.next_eoi_state(s)))
    }
}

/// Checks one mask against the oracle for every id of the mask's width.
fn check_mask(c: &mut Constraint, tok: &Tokenizer, oracle: &Oracle, width: usize, prefix: &[u8]) -> Vec<u32> {
    let forced = c.forced_tokens();
    let mask = c.mask().expect("mask").to_vec();
    assert_eq!(mask.len(), width.div_ceil(32), "mask words");
    if let Some(&first) = forced.first() {
        // A forced run: llguidance masks down to its first token (the canonical spelling).
        assert_eq!(allowed(&mask), vec![first], "forced {forced:?} after {:?}", String::from_utf8_lossy(prefix));
        assert!(oracle.live(&[prefix, tok.token_bytes(first)].concat()));
        return mask;
    }
    let at_end = oracle.full(prefix);
    let mut text = prefix.to_vec();
    for id in 0..width as u32 {
        let expected = if tok.eos_ids().contains(&id) {
            at_end
        } else if tok.is_special(id) || tok.token_bytes(id).is_empty() {
            false
        } else {
            text.truncate(prefix.len());
            text.extend_from_slice(tok.token_bytes(id));
            oracle.live(&text)
        };
        assert_eq!(
            bit(&mask, id),
            expected,
            "token {id} {:?} after {:?}",
            String::from_utf8_lossy(tok.token_bytes(id)),
            String::from_utf8_lossy(prefix)
        );
    }
    mask
}

/// Random walks under `spec`, every mask checked against `oracle_rx`; every accepted output
/// is a full match.
fn walks_match_oracle(tok: &Tokenizer, grammars: &Grammars, spec: &ConstraintSpec, oracle_rx: &str, walks: u64) {
    let oracle = Oracle::new(oracle_rx);
    for seed in 0..walks {
        let mut rng = rng(seed);
        let mut c = grammars.compile(spec).expect("compiles");
        let mut prefix = Vec::new();
        for _ in 0..80 {
            if c.is_stopped() {
                break;
            }
            let mask = check_mask(&mut c, tok, &oracle, grammars.width(), &prefix);
            let ids = allowed(&mask);
            let t = ids[rng.random_range(0..ids.len())];
            c.consume(t).expect("allowed token consumed");
            if tok.eos_ids().contains(&t) {
                break;
            }
            prefix.extend_from_slice(tok.token_bytes(t));
        }
        if c.status() == Status::Accepted {
            assert!(oracle.full(&prefix), "accepted {:?}", String::from_utf8_lossy(&prefix));
        }
    }
}

const REGEXES: &[&str] = &[
    r"[a-z]{1,6}( [a-z]{1,6}){0,3}\.",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r#"\{"id": [1-9][0-9]{0,3}, "label": "(alpha|beta|gamma)[a-z]{0,4}"\}"#,
    r"(café|naïve|東京) [0-9]{1,3}",
];

fn regexes_on(file: &str, walks: u64) {
    let Some((tok, grammars)) = load(file) else { return };
    for rx in REGEXES {
        walks_match_oracle(&tok, &grammars, &ConstraintSpec::Regex(rx.to_string()), rx, walks);
    }
}

#[test]
fn regex_masks_are_exactly_the_live_prefixes_smollm2() {
    regexes_on(SMOLLM2, 6);
}

#[test]
fn regex_masks_are_exactly_the_live_prefixes_gemma3() {
    regexes_on(GEMMA3, 2);
}

/// A flat JSON schema in a fixed layout is a regular language: the same exactness check.
#[test]
fn json_schema_masks_are_exactly_the_live_prefixes() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let schema = json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["red", "green", "blue"]}
        },
        "required": ["id", "ok", "tag"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}
    });
    let rx = r#"\{"id": (0|[1-9][0-9]{0,2}), "ok": (true|false), "tag": "(red|green|blue)"\}"#;
    walks_match_oracle(&tok, &grammars, &ConstraintSpec::JsonSchema(schema), rx, 8);
}

/// Logits wider than the vocabulary (Qwen's padded head): the mask covers the width, and the
/// padding ids are never allowed.
#[test]
fn padded_logits_never_allow_the_padding() {
    let Some((tok, _)) = load(SMOLLM2) else { return };
    let width = tok.vocab_size() + 100;
    let grammars = Grammars::new(tok.clone(), tok.eos_ids(), width).unwrap();
    let mut c = grammars.compile(&ConstraintSpec::JsonObject).unwrap();
    let mut rng = rng(7);
    for _ in 0..40 {
        if c.is_stopped() {
            break;
        }
        let mask = c.mask().unwrap().to_vec();
        assert_eq!(mask.len(), width.div_ceil(32));
        let ids = allowed(&mask);
        assert!(ids.iter().all(|&t| (t as usize) < tok.vocab_size()), "a padding id allowed");
        c.consume(ids[rng.random_range(0..ids.len())]).unwrap();
    }
    assert!(Grammars::new(tok.clone(), tok.eos_ids(), tok.vocab_size() - 1).is_err(), "narrower than the vocabulary");
}

/// Control tokens are never text: `<|im_start|>` is never allowed, EOS only once complete.
#[test]
fn control_tokens_and_eos() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    let eos = tok.eos_ids().to_vec();
    let mut c = grammars.compile(&ConstraintSpec::Regex("ab(c)?".into())).unwrap();
    let ends = |m: &[u32]| eos.iter().all(|&e| bit(m, e));
    assert!(!bit(c.mask().unwrap(), im_start));
    assert!(!ends(c.mask().unwrap()) && !c.can_end());
    c.consume_all(&tok.encode("ab", false).unwrap()).unwrap();
    assert!(ends(c.mask().unwrap()) && c.can_end(), "complete: EOS allowed");
    assert!(bit(c.mask().unwrap(), tok.token_to_id("c").unwrap()), "and so is the optional c");
    c.consume(tok.token_to_id("c").unwrap()).unwrap();
    // Nothing can follow: accepted at once, and the mask is EOS alone.
    assert_eq!(c.status(), Status::Accepted);
    let only: Vec<u32> = allowed(c.mask().unwrap());
    assert_eq!(only, eos);
}

/// A token the mask did not allow fails the constraint, with a message; it stays failed.
#[test]
fn a_disallowed_token_fails_the_constraint() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let mut c = grammars.compile(&ConstraintSpec::Regex("[0-9]+".into())).unwrap();
    let x = tok.token_to_id("x").unwrap();
    assert!(!bit(c.mask().unwrap(), x));
    let err = c.consume(x).unwrap_err();
    assert!(matches!(err, ferrolm_grammar::GrammarError::Generation(_)), "{err:?}");
    assert!(matches!(c.status(), Status::Failed(m) if !m.is_empty()));
    assert!(c.is_stopped() && c.mask().is_err());
}

/// Rollback restores the state before the rolled-back tokens (speculation's rejected drafts),
/// also out of an accepted end.
#[test]
fn rollback_restores_earlier_masks() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let spec = ConstraintSpec::Regex(r#"\{"n": [0-9]{1,3}\}"#.into());
    let mut c = grammars.compile(&spec).unwrap();
    let ids = tok.encode(r#"{"n": 42}"#, false).unwrap();
    let cut = ids.len() - 2;
    c.consume_all(&ids[..cut]).unwrap();
    let before = c.mask().unwrap().to_vec();
    c.consume_all(&ids[cut..]).unwrap();
    assert!(c.can_end());
    c.consume(tok.eos_ids()[0]).unwrap();
    assert_eq!(c.status(), Status::Accepted);
    c.rollback(3).unwrap();
    assert_eq!(c.status(), Status::Running);
    assert_eq!(c.mask().unwrap(), &before[..]);
    assert_eq!(c.accepted_prefix(&ids[cut..]), 2, "the rolled-back tokens are valid again");
}

/// Clones (n choices) go their own ways.
#[test]
fn clones_are_independent() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let a = grammars.compile(&ConstraintSpec::Choice(vec!["yes".into(), "no".into()])).unwrap();
    let mut b = a.clone();
    let mut a = a;
    a.consume_all(&tok.encode("yes", false).unwrap()).unwrap();
    b.consume_all(&tok.encode("no", false).unwrap()).unwrap();
    assert_eq!(a.status(), Status::Accepted);
    assert_eq!(b.status(), Status::Accepted);
    let c = grammars.compile(&ConstraintSpec::Choice(vec!["yes".into(), "no".into()])).unwrap();
    assert_eq!(c.status(), Status::Running);
}

/// JSON layout: separators with or without spaces, pretty-printing with one newline and an
/// indent between tokens; runs of blank lines or long space runs (a small model's loop) are
/// refused.
#[test]
fn json_whitespace_is_bounded() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let accepts = |text: &str| {
        let mut c = grammars.compile(&ConstraintSpec::JsonObject).unwrap();
        c.consume_all(&tok.encode(text, false).unwrap()).is_ok() && c.can_end()
    };
    for ok in
        ["{\"a\":1}", "{\"a\": 1, \"b\": [true, null]}", "{\n  \"a\": {\n    \"b\": \"x\"\n  }\n}", "{\t\"a\" :\t1 }"]
    {
        assert!(accepts(ok), "refused {ok:?}");
    }
    for bad in ["{\n\n\"a\": 1}", "{\"a\":      1}", " {\"a\": 1}", "{'a': 1}", "[1, 2]", "{\"a\": 1,}"] {
        assert!(!accepts(bad), "accepted {bad:?}");
    }
}

/// `json_object`: whatever is sampled under the mask is a JSON object.
#[test]
fn json_object_walks_are_objects() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let mut finished = 0;
    for seed in 0..20 {
        let mut c = grammars.compile(&ConstraintSpec::JsonObject).unwrap();
        let w = walk(&mut c, &tok, &mut rng(seed), 40);
        if w.accepted {
            let v: serde_json::Value = serde_json::from_str(&w.text()).unwrap_or_else(|e| panic!("{e}: {}", w.text()));
            assert!(v.is_object(), "{v}");
            finished += 1;
        }
    }
    assert!(finished >= 18, "{finished} of 20 walks finished");
}
