//! Stop strings on streamed deltas.

use ferrolm_text::{StopHit, StopMatcher};

/// Feeds all deltas; returns (everything emitted, the hit).
fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<StopHit>) {
    let mut m = StopMatcher::new(stops.iter().copied());
    let mut out = String::new();
    for d in deltas {
        let (text, hit) = m.push(d);
        out.push_str(&text);
        if hit.is_some() {
            return (out, hit);
        }
    }
    out.push_str(&m.flush());
    (out, None)
}

fn hit(index: usize, stop: &str) -> Option<StopHit> {
    Some(StopHit {
        index,
        stop: stop.to_string(),
    })
}

#[test]
fn stop_spanning_tokens() {
    assert_eq!(
        run(
            &["</answer>"],
            &["The result", " is 4</an", "swer> trailing"]
        ),
        ("The result is 4".into(), hit(0, "</answer>"))
    );
}

#[test]
fn partial_prefix_is_held_then_released() {
    let mut m = StopMatcher::new(["STOP"]);
    assert_eq!(m.push("abc ST"), ("abc ".to_string(), None));
    assert_eq!(m.push("O"), (String::new(), None));
    // "STOX" can no longer become "STOP": all of it is released.
    assert_eq!(m.push("X more"), ("STOX more".to_string(), None));
    assert_eq!(m.push(" S"), (" ".to_string(), None));
    assert_eq!(m.flush(), "S");
}

#[test]
fn multiple_stops_first_to_complete_wins() {
    // "bc" completes (at byte 3) before "abcd" would (at byte 4).
    assert_eq!(
        run(&["abcd", "bc"], &["xabcd"]),
        ("xa".into(), hit(1, "bc"))
    );
    // Same end: the longer stop, so the emitted text is the shorter one.
    assert_eq!(run(&["cd", "bcd"], &["abcd"]), ("a".into(), hit(1, "bcd")));
    assert_eq!(
        run(&["\n\n", "User:"], &["Hi.", "\nUse", "r: next"]),
        ("Hi.\n".into(), hit(1, "User:"))
    );
}

#[test]
fn stop_at_start() {
    assert_eq!(
        run(&["<|end|>"], &["<|end|>after"]),
        (String::new(), hit(0, "<|end|>"))
    );
    assert_eq!(
        run(&["<|end|>"], &["<|", "end", "|>"]),
        (String::new(), hit(0, "<|end|>"))
    );
}

#[test]
fn chunking_does_not_change_the_result() {
    let text = "alpha beta ##gamma## delta";
    let stops = ["##g", "beta #", "gamma"];
    let whole = run(&stops, &[text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let per_char: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(&stops, &per_char), whole);
    assert_eq!(whole, ("alpha ".into(), hit(1, "beta #")));
}

#[test]
fn multibyte_text_is_held_on_char_boundaries() {
    let mut m = StopMatcher::new(["é!"]);
    assert_eq!(m.push("caf"), ("caf".to_string(), None));
    assert_eq!(m.push("é"), (String::new(), None));
    assert_eq!(m.push("é!"), ("é".to_string(), hit(0, "é!")));
    assert!(m.is_stopped());
    assert_eq!(m.push("more"), (String::new(), None));
}

#[test]
fn no_stops_or_empty_stop_pass_everything() {
    assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
    assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), None));
}
