//! The buffer writer of the fixed-layout serialisers, which stores each token id
//! as one whole 8-byte word instead of a copy of variable length.

/// How many leading bytes of a token's 8-byte word are its encoding. At most 5 by
/// construction, which the unchecked stores of [`Cursor::put_words`] rely on.
#[derive(Debug, Clone, Copy)]
#[repr(u8)]
pub(super) enum WordLen {
    One = 1,
    Two = 2,
    Three = 3,
    Five = 5,
}

/// The bytes [`Cursor::put_words`] needs for `n` tokens: token i's word starts at most
/// 5 * i bytes in (every [`WordLen`] is at most 5) and is 8 long, so all of them lie in
/// the first `5 * n + 3` bytes.
const fn words_room(n: usize) -> usize {
    5 * n + 3
}

/// Appends `tokens` to `out` as [`Cursor::put_words`] writes them, sizing `out` for it.
pub(super) fn append_words(
    out: &mut Vec<u8>,
    tokens: &[i64],
    encode: impl Fn(i64) -> ([u8; 8], WordLen),
) {
    let start = out.len();
    out.resize(start + words_room(tokens.len()), 0);
    let mut w = Cursor::new(out.get_mut(start..).unwrap_or_default());
    // Sized just above, so the words fit.
    let _ = w.put_words(tokens, encode);
    let end = start + w.pos();
    out.truncate(end);
}

/// Writes into a buffer sized in advance, so the hot path has no growth checks. The
/// writers check the buffer's size before writing; a write that would not fit is
/// dropped (the bounds check stays, but never fails).
pub(super) struct Cursor<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    #[inline]
    pub(super) fn put(&mut self, bytes: &[u8]) {
        self.put_at(self.pos, bytes);
        self.pos += bytes.len();
    }

    /// Writes one encoding per token, `encode` giving each as the first `len` bytes of
    /// an 8-byte word. Every word is stored whole, the next one overwriting its slack:
    /// one fixed-size store per token instead of a copy of variable length.
    /// `None`, writing nothing, if fewer than [`words_room`] bytes are left.
    #[inline]
    pub(super) fn put_words(
        &mut self,
        tokens: &[i64],
        encode: impl Fn(i64) -> ([u8; 8], WordLen),
    ) -> Option<()> {
        let end = self.pos + words_room(tokens.len());
        let region = self.buf.get_mut(self.pos..end)?;
        // Bounds-checking each store (the offset is data-dependent, so the compiler
        // cannot hoist the check) took a 16-token block from ~9 to ~17 ns.
        let base = region.as_mut_ptr();
        let mut offset = 0;
        for &t in tokens {
            let (word, len) = encode(t);
            // SAFETY: before token i is written, `offset` is the sum of i WordLens,
            // each at most 5, so `offset + 8 <= 5 * i + 8 <= 5 * n + 3 = region.len()`:
            // the store is inside `region`, and `write_unaligned` needs no alignment.
            unsafe { base.add(offset).cast::<[u8; 8]>().write_unaligned(word) };
            offset += len as usize;
        }
        self.pos += offset;
        Some(())
    }

    /// Overwrites bytes already written (a length filled in afterwards).
    #[inline]
    pub(super) fn put_at(&mut self, at: usize, bytes: &[u8]) {
        if let Some(slot) = self.buf.get_mut(at..at + bytes.len()) {
            slot.copy_from_slice(bytes);
        }
    }
}
