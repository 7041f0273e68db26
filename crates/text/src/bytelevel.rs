//! GPT-2 byte-level alphabet: each of the 256 byte values is written as one printable char
//! (`bytes_to_unicode` in GPT-2's encoder.py). Token texts of a byte-level vocabulary are
//! strings over this alphabet.

use std::sync::OnceLock;

/// The char standing for each byte.
fn byte_to_char() -> &'static [char; 256] {
    static MAP: OnceLock<[char; 256]> = OnceLock::new();
    MAP.get_or_init(|| {
        let printable = |b: u32| {
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        };
        let mut map = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..256u32 {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            map[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
        }
        map
    })
}

/// The byte a char stands for, if it is in the alphabet. The alphabet's chars all lie below
/// U+0144, so the inverse map is a small table.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    static INV: OnceLock<[Option<u8>; 0x144]> = OnceLock::new();
    let inv = INV.get_or_init(|| {
        let mut inv = [None; 0x144];
        for (b, &c) in byte_to_char().iter().enumerate() {
            inv[c as usize] = Some(b as u8);
        }
        inv
    });
    inv.get(c as usize).copied().flatten()
}

/// Appends the bytes a byte-level token text stands for. A char outside the alphabet (rare:
/// tokens a converter added without byte-encoding them) is copied as its own UTF-8.
pub(crate) fn decode_into(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_round_trips_every_byte() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char()[b as usize]), Some(b));
        }
        assert_eq!(byte_to_char()[b' ' as usize], 'Ġ');
        assert_eq!(byte_to_char()[b'\n' as usize], 'Ċ');
    }
}
