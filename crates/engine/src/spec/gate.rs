//! Whether a sequence's drafting pays for itself, measured rather than assumed.
//!
//! On a CPU drafts are not free: each verified row adds about 0.3–0.5 of a decode to the
//! target's forward (the multi-row products and every row's attention are arithmetic, not
//! weight reads, and a busy machine has less of it to spare), and a draft model's guess is a
//! forward of the draft (a 0.5B draft costs about 0.4 of a 1.5B target's decode on the 2-core
//! dev machine). Whether drafting wins depends on acceptance, which the text decides: high on an
//! edit that copies its input, low in open chat.
//!
//! So the gate weighs, on the sequence itself, the steps whose drafts came from the drafting
//! under test (the draft model's guesses; prompt lookup's matches) against plain steps (no
//! drafts): the tested steps pay when the tokens they gave, each worth a plain step's time,
//! outweigh the time they took (drafting included): `tokens × plain step > their time`. That
//! is measured acceptance times the measured target step against the measured drafting and
//! verification, so a verdict comes after a few tested steps (`VERDICT_STEPS`) instead of whole
//! phases of each mode. Steps whose drafts came from elsewhere (prompt lookup beside the draft
//! model, the same in both modes) are not weighed. Once the tested drafting loses, it rests for
//! a while, twice as long each time it loses again (`FIRST_REST` up to `MAX_REST` steps), and is
//! then probed again; while it wins, every tested step keeps the verdict current. Only speed
//! depends on the gate: every emitted token is still the sampler's own draw.

use std::time::Instant;

/// How the next drafts are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftMode {
    /// The proposer's own drafting (the draft model: prompt lookup where it matches, the model
    /// otherwise; prompt lookup: its matches).
    Full,
    /// The fallback (the draft model: prompt lookup alone, the model resting and its cache not
    /// kept up; prompt lookup: no drafts).
    Lean,
}

/// What a step drafted, told to the gate at the next step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepNote {
    /// Its drafts (or its attempt, when the draft model guessed nothing) came from the drafting
    /// the gate weighs.
    pub tested: bool,
    /// How many drafts were verified.
    pub drafts: usize,
    /// Seconds spent drafting them (the draft model's forwards).
    pub draft_secs: f64,
    /// Seconds of the step to leave out: a draft model catching up on the tokens it missed
    /// while it rested (a cost of resting, paid once, not of each guess).
    pub excluded_secs: f64,
}

/// Tested steps measured before a verdict.
const VERDICT_STEPS: usize = 3;
/// Steps of rest after the first loss; doubled after each further loss, up to `MAX_REST`.
const FIRST_REST: usize = 32;
const MAX_REST: usize = 1024;
/// Tested steps that must pay in a row before the rest after a loss starts short again.
const WINS_TO_FORGIVE: usize = 16;
/// Weight of the older steps in the running sums (each new step multiplies them by it): about
/// the last eight steps count.
const DECAY: f64 = 0.875;
/// Plain steps measured before the draft model is first tried (`plain_first`).
const PLAIN_FIRST: usize = 3;

/// Decaying sums over steps of one kind.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    steps: f64,
    tokens: f64,
    secs: f64,
    /// Of `secs`: drafting.
    draft_secs: f64,
}

impl Tally {
    fn add(&mut self, tokens: usize, secs: f64, draft_secs: f64) {
        let d = DECAY;
        *self = Self {
            steps: self.steps * d + 1.0,
            tokens: self.tokens * d + tokens as f64,
            secs: self.secs * d + secs,
            draft_secs: self.draft_secs * d + draft_secs,
        };
    }
}

/// Chooses the draft mode of one sequence from what its tested and plain steps cost and gave.
#[derive(Debug)]
pub struct DraftGate {
    mode: DraftMode,
    /// Lean: steps left to rest (or to measure plain steps first).
    left: usize,
    /// The next rest's length.
    rest: usize,
    /// Tested steps that paid in a row.
    wins: usize,
    /// Tested steps in the current Full phase.
    probed: usize,
    /// The previous step's start: when `next` was called and the history's length then.
    last: Option<(Instant, usize)>,
    /// Tested steps since the current Full phase began, and plain steps (one row each).
    tested: Tally,
    plain: Tally,
}

impl DraftGate {
    /// Drafting from the first step (prompt lookup: its cost is only the verified rows).
    pub fn drafting_first() -> Self {
        Self {
            mode: DraftMode::Full,
            left: 0,
            rest: FIRST_REST,
            wins: 0,
            probed: 0,
            last: None,
            tested: Tally::default(),
            plain: Tally::default(),
        }
    }

    /// A few plain steps first, to know what a step costs before the draft model is weighed
    /// (plain steps cost nothing over plain decoding).
    pub fn plain_first() -> Self {
        Self { mode: DraftMode::Lean, left: PLAIN_FIRST, ..Self::drafting_first() }
    }

    /// Called once per step before drafting, with the sequence's history length and what the
    /// previous step drafted: the time and tokens since the previous call are that step's.
    /// Returns the mode for this step.
    pub fn next(&mut self, history_len: usize, previous: StepNote) -> DraftMode {
        self.next_at(Instant::now(), history_len, previous)
    }

    fn next_at(&mut self, now: Instant, history_len: usize, previous: StepNote) -> DraftMode {
        if let Some((then, len)) = self.last {
            let secs = (now.duration_since(then).as_secs_f64() - previous.excluded_secs).max(0.0);
            self.record(history_len.saturating_sub(len), secs, previous);
        }
        self.last = Some((now, history_len));
        self.mode
    }

    /// Counts a finished step and, in Full, weighs the tested drafting after a tested step; in
    /// Lean, counts down the rest.
    fn record(&mut self, tokens: usize, secs: f64, note: StepNote) {
        if note.drafts == 0 {
            self.plain.add(1, secs - note.draft_secs, 0.0);
        }
        match self.mode {
            DraftMode::Full if note.tested => {
                self.tested.add(tokens, secs, note.draft_secs);
                self.weigh();
            }
            DraftMode::Full => {}
            DraftMode::Lean => {
                self.left = self.left.saturating_sub(1);
                if self.left == 0 {
                    (self.mode, self.tested, self.probed) = (DraftMode::Full, Tally::default(), 0);
                }
            }
        }
    }

    /// After enough tested steps: rests the drafting when it does not pay.
    fn weigh(&mut self) {
        self.probed += 1;
        if self.probed < VERDICT_STEPS {
            return;
        }
        if self.pays() {
            self.wins += 1;
            if self.wins >= WINS_TO_FORGIVE {
                self.rest = FIRST_REST;
            }
            return;
        }
        (self.mode, self.left, self.wins) = (DraftMode::Lean, self.rest, 0);
        self.rest = (self.rest * 2).min(MAX_REST);
    }

    /// Whether the tested steps gave more tokens per second than plain steps do: their tokens,
    /// each worth a plain step, against their time. Before any plain step is measured, a plain
    /// step is taken to cost what the tested steps' verification did (more than it does: a
    /// verdict against the drafting is then certain, one for it provisional).
    fn pays(&self) -> bool {
        let t = &self.tested;
        let plain_step = match self.plain.steps > 0.5 {
            true => self.plain.secs / self.plain.steps,
            false => (t.secs - t.draft_secs) / t.steps,
        };
        t.tokens * plain_step > t.secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A step as the gate sees it: tokens gained, seconds, drafting seconds, drafts.
    #[derive(Clone, Copy)]
    struct Step {
        tokens: usize,
        secs: f64,
        draft_secs: f64,
        drafts: usize,
    }

    /// Runs `steps` steps; `step(mode)` says what a step in that mode gives. Returns the modes.
    fn run(gate: &mut DraftGate, steps: usize, step: impl Fn(DraftMode) -> Step) -> Vec<DraftMode> {
        let (mut now, mut len, mut note, mut modes) = (Instant::now(), 0, StepNote::default(), Vec::new());
        for _ in 0..steps {
            let mode = gate.next_at(now, len, note);
            let s = step(mode);
            modes.push(mode);
            note = StepNote {
                tested: mode == DraftMode::Full,
                drafts: s.drafts,
                draft_secs: s.draft_secs,
                excluded_secs: 0.0,
            };
            now += Duration::from_secs_f64(s.secs);
            len += s.tokens;
        }
        modes
    }

    const PLAIN: Step = Step { tokens: 1, secs: 0.050, draft_secs: 0.0, drafts: 0 };
    /// The chat case: 3 guesses (0.02 s each) and 2 verified rows (0.02 s each) for 1.8 tokens.
    const CHAT: Step = Step { tokens: 2, secs: 0.050 + 0.060 + 0.040, draft_secs: 0.060, drafts: 2 };
    /// The code edit case: 6 guesses, 6 rows, 6 tokens kept.
    const EDIT: Step = Step { tokens: 7, secs: 0.050 + 0.120 + 0.120, draft_secs: 0.120, drafts: 6 };

    fn count(modes: &[DraftMode], mode: DraftMode) -> usize {
        modes.iter().filter(|&&m| m == mode).count()
    }

    #[test]
    fn a_losing_draft_model_is_tried_a_few_steps_and_rested_longer_each_time() {
        let mut gate = DraftGate::plain_first();
        let modes = run(&mut gate, 1000, |m| if m == DraftMode::Full { CHAT } else { PLAIN });
        // Plain steps first, then the verdict after three tested steps.
        assert!(modes[..PLAIN_FIRST].iter().all(|&m| m == DraftMode::Lean));
        assert_eq!(count(&modes[..PLAIN_FIRST + 3 + FIRST_REST], DraftMode::Full), 3);
        let tried = count(&modes, DraftMode::Full);
        assert!(tried <= 5 * 3, "the losing mode ran {tried} of 1000 steps");
        // Rests double: the last 500 steps hold at most one probe.
        assert!(count(&modes[500..], DraftMode::Full) <= 3);
    }

    #[test]
    fn a_paying_draft_model_keeps_drafting() {
        let mut gate = DraftGate::plain_first();
        let modes = run(&mut gate, 500, |m| if m == DraftMode::Full { EDIT } else { PLAIN });
        assert_eq!(count(&modes, DraftMode::Lean), PLAIN_FIRST);
    }

    #[test]
    fn follows_a_change_of_the_text() {
        let mut gate = DraftGate::plain_first();
        run(&mut gate, 100, |m| if m == DraftMode::Full { EDIT } else { PLAIN });
        assert_eq!(gate.mode, DraftMode::Full);
        // The text changes: the model's guesses stop being taken.
        let modes = run(&mut gate, 40, |m| if m == DraftMode::Full { CHAT } else { PLAIN });
        assert!(count(&modes[..12], DraftMode::Full) < 12, "still drafting after 12 losing steps");
        // And back: a probe finds the model paying again, and it stays.
        let modes = run(&mut gate, 300, |m| if m == DraftMode::Full { EDIT } else { PLAIN });
        assert_eq!(modes.last(), Some(&DraftMode::Full));
    }

    #[test]
    fn without_a_plain_step_a_clear_loss_is_still_seen() {
        // Prompt lookup from the first step: every step drafts; verification alone as the
        // plain step's cost still shows that 1.1 tokens per step do not pay 0.1 s of drafting.
        let mut gate = DraftGate::drafting_first();
        let bad = Step { tokens: 1, secs: 0.2, draft_secs: 0.1, drafts: 1 };
        let modes = run(&mut gate, 10, |m| if m == DraftMode::Full { bad } else { PLAIN });
        assert_eq!(modes.last(), Some(&DraftMode::Lean));
    }
}
