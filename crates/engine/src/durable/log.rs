//! The checkpoint log's format: one append-only file per request.
//!
//! `MAGIC`, then frames `[len: u32 LE][check: 8 bytes][payload: len bytes]`, `check` being the
//! first 8 bytes of the payload's SHA-256. Frame 0 is the header (JSON), every later frame a
//! record (JSON) of the tokens emitted since the previous one. A reader stops at the first frame
//! that is short, fails its check or does not continue the tokens read so far: a torn last
//! write (a crash mid-append) loses that record only, never poisons the log.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MAGIC: &[u8; 8] = b"FLMCKPT1";
/// The frame's length and check.
const FRAME_HEAD: usize = 12;
/// No record is this large; a length beyond it is a torn or foreign file.
const MAX_FRAME: usize = 64 << 20;

/// What a log says about its request, written once when the generation starts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// The request's identity (a hash of the model, prompt ids, parameters, stops): a retry
    /// under the same `Idempotency-Key` must carry the same one.
    pub identity: String,
    /// `identity::model_identity` of the model that wrote it.
    pub model: String,
    /// The seed actually used (the server's own when the request gave none).
    pub seed: u64,
    pub prompt_tokens: usize,
    /// Unix seconds the generation first started.
    pub created: u64,
}

/// Tokens emitted since the previous record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Index of `tokens[0]` in the generation (= tokens emitted before this record).
    pub from: usize,
    pub tokens: Vec<u32>,
    /// The sampler's random-stream position after these tokens: draws made so far.
    pub rng_step: u64,
}

/// A log read back: its header and every token its intact records hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    pub header: Header,
    pub tokens: Vec<u32>,
    pub rng_step: u64,
    /// Whether bytes after the last intact record were ignored (a torn write).
    pub torn: bool,
}

fn check(payload: &[u8]) -> [u8; 8] {
    let d = Sha256::digest(payload);
    d[..8].try_into().expect("8 bytes")
}

/// One frame around `payload`.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEAD + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&check(payload));
    out.extend_from_slice(payload);
    out
}

/// The bytes of a new log: the magic, the header and (when resuming) one record of `tokens`.
pub fn new_log(header: &Header, tokens: &[u32], rng_step: u64) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend(frame(&serde_json::to_vec(header).expect("a header serializes")));
    if !tokens.is_empty() {
        out.extend(record_frame(&Record { from: 0, tokens: tokens.to_vec(), rng_step }));
    }
    out
}

pub fn record_frame(r: &Record) -> Vec<u8> {
    frame(&serde_json::to_vec(r).expect("a record serializes"))
}

/// The next intact frame's payload at `bytes[at..]` and where the one after starts.
fn next_frame(bytes: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let head = bytes.get(at..at + FRAME_HEAD)?;
    let len = u32::from_le_bytes(head[..4].try_into().ok()?) as usize;
    if len > MAX_FRAME {
        return None;
    }
    let payload = bytes.get(at + FRAME_HEAD..at + FRAME_HEAD + len)?;
    (check(payload) == head[4..12]).then_some((payload, at + FRAME_HEAD + len))
}

/// Reads a log; None when it has no intact header (not a log, or torn before the header).
pub fn parse(bytes: &[u8]) -> Option<Saved> {
    if bytes.get(..MAGIC.len())? != MAGIC {
        return None;
    }
    let (payload, mut at) = next_frame(bytes, MAGIC.len())?;
    let header: Header = serde_json::from_slice(payload).ok()?;
    let mut saved = Saved { header, tokens: Vec::new(), rng_step: 0, torn: false };
    while at < bytes.len() {
        let record = next_frame(bytes, at).and_then(|(p, next)| Some((serde_json::from_slice::<Record>(p).ok()?, next)));
        match record {
            Some((r, next)) if r.from == saved.tokens.len() => {
                saved.tokens.extend(r.tokens);
                saved.rng_step = r.rng_step;
                at = next;
            }
            _ => {
                saved.torn = true;
                break;
            }
        }
    }
    Some(saved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header { identity: "abc".into(), model: "m".into(), seed: 42, prompt_tokens: 7, created: 1 }
    }

    fn log_of(records: &[Record]) -> Vec<u8> {
        let mut bytes = new_log(&header(), &[], 0);
        records.iter().for_each(|r| bytes.extend(record_frame(r)));
        bytes
    }

    #[test]
    fn records_read_back_in_order() {
        let rs = [Record { from: 0, tokens: vec![1, 2, 3], rng_step: 3 }, Record { from: 3, tokens: vec![4], rng_step: 4 }];
        let saved = parse(&log_of(&rs)).unwrap();
        assert_eq!((saved.header, saved.tokens, saved.rng_step, saved.torn), (header(), vec![1, 2, 3, 4], 4, false));
        let resumed = parse(&new_log(&header(), &[9, 8], 2)).unwrap();
        assert_eq!((resumed.tokens, resumed.rng_step), (vec![9, 8], 2));
    }

    #[test]
    fn a_torn_or_corrupt_last_record_is_ignored_at_every_cut() {
        let rs = [Record { from: 0, tokens: vec![1, 2], rng_step: 2 }, Record { from: 2, tokens: vec![3, 4], rng_step: 4 }];
        let full = log_of(&rs);
        let first_end = log_of(&rs[..1]).len();
        let header_end = log_of(&[]).len();
        for cut in 0..full.len() {
            let got = parse(&full[..cut]);
            match cut {
                c if c < header_end => assert!(got.is_none(), "cut {c}: no intact header"),
                c => {
                    let s = got.unwrap();
                    let want: &[u32] = if c < first_end { &[] } else { &[1, 2] };
                    assert_eq!(s.tokens, want, "cut {c}");
                    assert_eq!(s.torn, c != header_end && c != first_end, "cut {c}");
                }
            }
        }
        // A flipped byte in the last record's payload: that record is dropped.
        let mut bad = full.clone();
        *bad.last_mut().unwrap() ^= 0x20;
        let s = parse(&bad).unwrap();
        assert_eq!((s.tokens, s.torn), (vec![1, 2], true));
        // A record that does not continue the tokens (a gap after a failed write) ends the log.
        let gap = log_of(&[rs[0].clone(), Record { from: 5, tokens: vec![9], rng_step: 6 }]);
        assert_eq!(parse(&gap).unwrap().tokens, vec![1, 2]);
        assert!(parse(b"not a log").is_none());
    }
}
