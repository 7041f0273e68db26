//! Streaming detokenization: token ids in, complete UTF-8 text out. A token can end in the
//! middle of a multi-byte character (byte-fallback and byte-level tokens do), so the bytes of an
//! unfinished character are held until the next token completes it. Bytes that can never become
//! valid UTF-8 are emitted as U+FFFD, once that is certain.

use crate::Tokenizer;

#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    pending: Vec<u8>,
    skip_special: bool,
}

impl IncrementalDecoder {
    /// `skip_special` drops control tokens (such as `<|im_end|>`) from the text.
    pub fn new(skip_special: bool) -> Self {
        IncrementalDecoder {
            pending: Vec::new(),
            skip_special,
        }
    }

    /// Adds one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        let bytes = tokenizer.piece(id, self.skip_special);
        self.push_bytes(bytes)
    }

    /// Adds raw bytes; returns the text that is now complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // Safe: from_utf8 vouched for this prefix.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        // Invalid for good: replace it and go on.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &after[n..];
                        }
                        // A character cut short at the end: wait for more bytes.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Ends the stream: held bytes that never completed become U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back, waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_partial_characters() {
        let mut d = IncrementalDecoder::new(false);
        let euro = "€".as_bytes(); // E2 82 AC
        assert_eq!(d.push_bytes(b"a"), "a");
        assert_eq!(d.push_bytes(&euro[..1]), "");
        assert_eq!(d.push_bytes(&euro[1..2]), "");
        assert_eq!(d.push_bytes(&euro[2..]), "€");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_one_replacement_each() {
        let mut d = IncrementalDecoder::new(false);
        // 0xFF can never start a character; E2 82 followed by 'x' can never complete.
        assert_eq!(d.push_bytes(&[0xFF, b'a']), "\u{FFFD}a");
        assert_eq!(d.push_bytes(&[0xE2, 0x82]), "");
        assert_eq!(d.push_bytes(b"x"), "\u{FFFD}x");
        assert_eq!(d.push_bytes(&[0xF0, 0x9F]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.pending_bytes(), 0);
    }
}
