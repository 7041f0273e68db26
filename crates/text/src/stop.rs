//! Stop strings on streamed text. Deltas go in; what comes out is text that can no longer be
//! part of a stop string. A suffix that could be the start of a stop string is held back until
//! the next delta decides it. On a hit, the text before the stop is released and the stop
//! string itself never is.
//!
//! Which stop wins when several match: the one that *ends* first (ties: the longer one). That is
//! the stop a token-by-token stream would see first, so the result does not depend on how the
//! text was cut into deltas.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopHit {
    /// Index into the stop strings given to [`StopMatcher::new`].
    pub index: usize,
    pub stop: String,
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    done: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Self {
        let stops = stops.into_iter().map(Into::into).collect();
        StopMatcher {
            stops,
            held: String::new(),
            done: false,
        }
    }

    /// Feeds a delta; returns the text safe to emit now and the stop that was hit, if any.
    /// After a hit every later call returns nothing.
    pub fn push(&mut self, delta: &str) -> (String, Option<StopHit>) {
        if self.done {
            return (String::new(), None);
        }
        self.held.push_str(delta);
        if let Some((start, index)) = self.first_hit() {
            self.done = true;
            let before = self.held[..start].to_string();
            self.held.clear();
            return (
                before,
                Some(StopHit {
                    index,
                    stop: self.stops[index].clone(),
                }),
            );
        }
        let keep = self.partial_suffix_len();
        let emit = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (emit, None)
    }

    /// End of stream: the held-back text (nothing after a hit).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    pub fn is_stopped(&self) -> bool {
        self.done
    }

    /// (start byte, stop index) of the match that ends first; the longer one on a tie.
    fn first_hit(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, index)
        for (index, stop) in self.stops.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
            if let Some(start) = self.held.find(stop.as_str()) {
                let cand = (start + stop.len(), start, index);
                if best.is_none_or(|b| (cand.0, cand.1) < (b.0, b.1)) {
                    best = Some(cand);
                }
            }
        }
        best.map(|(_, start, index)| (start, index))
    }

    /// Length of the longest suffix of the held text that is a proper prefix of some stop.
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_str();
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let min_start = held.len().saturating_sub(longest_stop.saturating_sub(1));
        held.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= min_start)
            .find(|&i| {
                self.stops
                    .iter()
                    .any(|s| s.len() > held.len() - i && s.starts_with(&held[i..]))
            })
            .map_or(0, |i| held.len() - i)
    }
}
