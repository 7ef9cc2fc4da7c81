//! Python's `repr()` of a `str`, so error messages quote user input as Python would.

use std::fmt::Write as _;

/// Python's `repr()` of a `str`, for error messages that quote user input.
///
/// Exact for every assigned code point of Unicode 14 (Python 3.11); unassigned code
/// points, which Python escapes, are written as they are.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_py_printable(c) => out.push(c),
            c => {
                let code = u32::from(c);
                // Writing to a String cannot fail.
                let _ = if code <= 0xff {
                    write!(out, "\\x{code:02x}")
                } else if code <= 0xffff {
                    write!(out, "\\u{code:04x}")
                } else {
                    write!(out, "\\U{code:08x}")
                };
            }
        }
    }
    out.push(quote);
    out
}

/// `str.isprintable()` for one character: not a control, format, separator (other
/// than the space), private-use or noncharacter code point.
fn is_py_printable(c: char) -> bool {
    const NOT_PRINTABLE: &[(u32, u32)] = &[
        (0x00, 0x1f),
        (0x7f, 0xa0),
        (0xad, 0xad),
        (0x600, 0x605),
        (0x61c, 0x61c),
        (0x6dd, 0x6dd),
        (0x70f, 0x70f),
        (0x890, 0x891),
        (0x8e2, 0x8e2),
        (0x1680, 0x1680),
        (0x180e, 0x180e),
        (0x2000, 0x200f),
        (0x2028, 0x202f),
        (0x205f, 0x2064),
        (0x2066, 0x206f),
        (0x3000, 0x3000),
        (0xe000, 0xf8ff),
        (0xfeff, 0xfeff),
        (0xfff9, 0xfffb),
        (0x110bd, 0x110bd),
        (0x110cd, 0x110cd),
        (0x13430, 0x13438),
        (0x1bca0, 0x1bca3),
        (0x1d173, 0x1d17a),
        (0xe0001, 0xe0001),
        (0xe0020, 0xe007f),
        (0xf0000, 0xffffd),
        (0x10_0000, 0x10_fffd),
    ];
    let code = u32::from(c);
    // Noncharacters (U+FDD0..U+FDEF and the last two code points of every plane) are
    // unassigned in every Unicode version.
    let noncharacter = (0xfdd0..=0xfdef).contains(&code) || code & 0xfffe == 0xfffe;
    !noncharacter
        && !NOT_PRINTABLE
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repr_matches_python() {
        // Expected values from Python's repr().
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("'\""), "'\\'\"'");
        assert_eq!(
            py_repr("a\\b\tc\n\r\x00\x7f"),
            "'a\\\\b\\tc\\n\\r\\x00\\x7f'"
        );
        assert_eq!(
            py_repr("ü\u{a0}\u{ad}\u{2028}é\u{e000}\u{1f600}"),
            "'ü\\xa0\\xad\\u2028é\\ue000😀'"
        );
        assert_eq!(py_repr("\u{10ffff}"), "'\\U0010ffff'");
    }
}
