//! Progress of a model load on stderr (stdout is for answers and `serve`'s ready line): an
//! indicatif bar on a terminal; plain lines at each quarter otherwise (logs, pipes, tests),
//! or nothing when `quiet_when_piped`.

use ferrolm_models::loader::ProgressFn;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What a progress line calls the model: its file (or folder) name.
pub fn model_label(path: Option<&std::path::Path>) -> String {
    let path = path.map(std::path::Path::to_path_buf).unwrap_or_else(ferrolm_models::paths::default_model_path);
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// A load's progress display; `callback()` goes to `bundle::load_with_progress`.
pub struct LoadProgress {
    label: String,
    bar: Option<ProgressBar>,
    plain: bool,
    /// Tensor-parallel ranks each read every tensor: the bar counts them all.
    ranks: u64,
    started: Instant,
}

impl LoadProgress {
    /// `label`: what is loading (the model's path).
    pub fn new(label: String, ranks: usize, quiet_when_piped: bool) -> Self {
        let tty = std::io::stderr().is_terminal();
        let bar = tty.then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template("loading {msg} [{wide_bar}] {binary_bytes}/{binary_total_bytes} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar.set_message(label.clone());
            bar
        });
        let plain = !tty && !quiet_when_piped;
        LoadProgress { label, bar, plain, ranks: ranks.max(1) as u64, started: Instant::now() }
    }

    /// The callback for the loader: the bar's position, or a line at each quarter.
    pub fn callback(&self) -> Option<ProgressFn> {
        let ranks = self.ranks;
        if let Some(bar) = self.bar.clone() {
            return Some(Box::new(move |done, total| {
                let len = total * ranks;
                bar.set_length(len);
                bar.set_position(done.min(len));
            }));
        }
        if !self.plain {
            return None;
        }
        let (label, quarter) = (self.label.clone(), Arc::new(AtomicU64::new(0)));
        Some(Box::new(move |done, total| {
            let len = (total * ranks).max(1);
            let q = (done.min(len) * 4 / len).min(3);
            if q > quarter.fetch_max(q, Ordering::Relaxed) {
                eprintln!("loading {label}: {}% of {} MB", q * 25, len >> 20);
            }
        }))
    }

    /// The load is over, `ok` or not (the bar is cleared; a plain line says how it ended and
    /// how long it took; the caller reports the error itself).
    pub fn finish(self, ok: bool) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
        if self.plain {
            let how = if ok { "done" } else { "failed" };
            eprintln!("loading {}: {how} in {:.2} s", self.label, self.started.elapsed().as_secs_f64());
        }
    }
}
