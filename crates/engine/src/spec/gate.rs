//! Whether a sequence's drafting pays for itself, measured rather than assumed.
//!
//! On a CPU drafts are not free: each verified row adds about 0.3–0.5 of a decode to the
//! target's forward (the multi-row products and every row's attention are arithmetic, not
//! weight reads, and a busy machine has less of it to spare), and a draft model's guess is a
//! decode of the draft (a 0.5B draft costs about 0.4 of a 1.5B target's decode on the 2-core dev
//! machine). Whether drafting wins depends on acceptance, which the text decides: high on an
//! edit that copies its input, low in open chat. So the gate times two ways of drafting on the
//! sequence itself — the proposer's full drafting and its lean fallback (the draft model: prompt
//! lookup alone; prompt lookup: no drafts) — in alternating phases of steps, keeps the one that
//! gave more tokens per second, and tries the other again now and then (less often while it
//! keeps losing). Only speed depends on it: every emitted token is the sampler's own draw.

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

impl DraftMode {
    fn index(self) -> usize {
        self as usize
    }

    fn other(self) -> Self {
        match self {
            Self::Full => Self::Lean,
            Self::Lean => Self::Full,
        }
    }
}

/// Steps a mode is measured for when it is tried.
const PROBE_STEPS: usize = 12;
/// Steps the better mode runs before the other is tried again, at first; doubled each time the
/// same mode wins, up to `MAX_EXPLOIT_STEPS`.
const EXPLOIT_STEPS: usize = 32;
const MAX_EXPLOIT_STEPS: usize = 512;

/// Whether a phase measures a mode that is being tried or runs the faster one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Probe,
    Exploit,
}

/// Chooses the draft mode of one sequence from the tokens per second each mode gave it.
#[derive(Debug)]
pub struct DraftGate {
    mode: DraftMode,
    phase: Phase,
    /// Steps left in the current phase.
    left: usize,
    /// The length of the next exploitation phase.
    exploit: usize,
    /// The mode the last exploitation phase ran.
    winner: Option<DraftMode>,
    /// The previous step's start: when `next` was called and the history's length then.
    last: Option<(Instant, usize)>,
    /// This phase's time and tokens so far.
    secs: f64,
    tokens: usize,
    /// Tokens per second of each mode, latest phases blended.
    rate: [Option<f64>; 2],
}

impl Default for DraftGate {
    fn default() -> Self {
        Self {
            mode: DraftMode::Full,
            phase: Phase::Probe,
            left: PROBE_STEPS,
            exploit: EXPLOIT_STEPS,
            winner: None,
            last: None,
            secs: 0.0,
            tokens: 0,
            rate: [None; 2],
        }
    }
}

impl DraftGate {
    /// Called once per step before drafting, with the sequence's history length: the time and
    /// tokens since the previous call are the previous step's, made in the mode then current.
    /// Returns the mode for this step.
    pub fn next(&mut self, history_len: usize) -> DraftMode {
        self.next_at(Instant::now(), history_len)
    }

    fn next_at(&mut self, now: Instant, history_len: usize) -> DraftMode {
        if let Some((then, len)) = self.last {
            self.secs += now.duration_since(then).as_secs_f64();
            self.tokens += history_len.saturating_sub(len);
            self.left = self.left.saturating_sub(1);
            if self.left == 0 || self.losing() {
                self.end_phase();
            }
        }
        self.last = Some((now, history_len));
        self.mode
    }

    /// An exploitation that has run a probe's length slower than the other mode's last rate
    /// (the text changed): it ends early.
    fn losing(&self) -> bool {
        let ran = self.exploit.saturating_sub(self.left);
        let other = self.rate[self.mode.other().index()];
        self.phase == Phase::Exploit && ran >= PROBE_STEPS && other.is_some_and(|r| self.tokens as f64 / self.secs.max(1e-9) < r)
    }

    /// Records the phase's rate and starts the next phase: the other mode while it is
    /// unmeasured; after a probe the faster mode (for longer each time the same one wins);
    /// after an exploitation a probe of the mode that did not run.
    fn end_phase(&mut self) {
        let measured = self.tokens as f64 / self.secs.max(1e-9);
        // A probe is short (its rate blended with the mode's last); an exploitation long enough to stand alone.
        let slot = &mut self.rate[self.mode.index()];
        *slot = Some(match (self.phase, *slot) {
            (Phase::Probe, Some(r)) => 0.5 * (r + measured),
            _ => measured,
        });
        (self.secs, self.tokens) = (0.0, 0);
        let (Some(full), Some(lean)) = (self.rate[0], self.rate[1]) else {
            (self.mode, self.phase, self.left) = (self.mode.other(), Phase::Probe, PROBE_STEPS);
            return;
        };
        if self.phase == Phase::Exploit {
            (self.mode, self.phase, self.left) = (self.mode.other(), Phase::Probe, PROBE_STEPS);
            return;
        }
        let best = if full >= lean { DraftMode::Full } else { DraftMode::Lean };
        self.exploit = match self.winner == Some(best) {
            true => (self.exploit * 2).min(MAX_EXPLOIT_STEPS),
            false => EXPLOIT_STEPS,
        };
        (self.mode, self.phase, self.left, self.winner) = (best, Phase::Exploit, self.exploit, Some(best));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    impl DraftGate {
        /// The mode of the current step (the engine reads it from `next`).
        fn mode(&self) -> DraftMode {
            self.mode
        }
    }

    /// Steps of `mode_rates` tokens per second (one token per step) and the modes chosen.
    fn run(gate: &mut DraftGate, steps: usize, rate: impl Fn(DraftMode) -> f64) -> Vec<DraftMode> {
        let mut now = Instant::now();
        let mut len = 0;
        let mut modes = Vec::new();
        for _ in 0..steps {
            let mode = gate.next_at(now, len);
            modes.push(mode);
            now += Duration::from_secs_f64(1.0 / rate(mode));
            len += 1;
        }
        modes
    }

    #[test]
    fn keeps_the_faster_mode_and_tries_the_other_less_and_less() {
        let mut gate = DraftGate::default();
        let modes = run(&mut gate, 1000, |m| if m == DraftMode::Lean { 30.0 } else { 20.0 });
        // The first probes: the model, then lookup.
        assert!(modes[..PROBE_STEPS].iter().all(|&m| m == DraftMode::Full));
        assert!(modes[PROBE_STEPS..2 * PROBE_STEPS].iter().all(|&m| m == DraftMode::Lean));
        let model = modes.iter().filter(|&&m| m == DraftMode::Full).count();
        assert!(model < 100, "the slower mode ran {model} of 1000 steps");
        // Later probes are rarer: the last 500 steps hold at most one probe.
        let late = modes[500..].iter().filter(|&&m| m == DraftMode::Full).count();
        assert!(late <= PROBE_STEPS, "{late} model steps late");
    }

    #[test]
    fn follows_a_change_of_the_faster_mode() {
        let mut gate = DraftGate::default();
        run(&mut gate, 200, |m| if m == DraftMode::Full { 40.0 } else { 20.0 });
        assert_eq!(gate.mode(), DraftMode::Full);
        // The text changes: the model's guesses stop being taken.
        let modes = run(&mut gate, 400, |m| if m == DraftMode::Full { 10.0 } else { 20.0 });
        assert_eq!(modes.last(), Some(&DraftMode::Lean));
    }
}
