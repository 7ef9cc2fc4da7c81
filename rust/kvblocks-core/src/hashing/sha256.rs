//! SHA-256 over a message padded in place in the caller's buffer, so the hot path
//! hashes a block without the `Digest` API's copies into its own buffers.

use sha2::digest::generic_array::GenericArray;

/// The most bytes SHA-256 padding writes past a message: `0x80`, up to 63 zeros and
/// the 8-byte length.
pub(super) const SHA256_PAD: usize = 72;

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
pub(super) const SHA256_IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// SHA-256 of `buf[..len]`, padding the message in place (FIPS 180-4, 5.1.1) and
/// running the compression function straight over `buf`: the `Digest` API would copy
/// the message through its block buffer and pad in a second one. `None` if `buf` is
/// shorter than `len + SHA256_PAD`.
pub(super) fn sha256_in_place(buf: &mut [u8], len: usize) -> Option<[u8; 32]> {
    let end = sha256_pad(buf, len)?;
    let mut state = SHA256_IV;
    compress_blocks(&mut state, buf.get(..end)?);
    Some(state_bytes(state))
}

/// Pads the message `buf[..len]` in place (FIPS 180-4, 5.1.1); returns where the
/// padded message ends. `None` if `buf` is shorter than the padded message (at most
/// `len + SHA256_PAD` bytes), having written part of the padding.
pub(super) fn sha256_pad(buf: &mut [u8], len: usize) -> Option<usize> {
    let end = (len + 9).div_ceil(64) * 64;
    // Zeroing a fixed 64 bytes (more than the at most 63 needed; the length then
    // overwrites the excess) compiles to a few vector stores instead of a memset call.
    buf.get_mut(len..len + 65)?.copy_from_slice(&PAD_START);
    let bits = (len as u64) * 8;
    buf.get_mut(end - 8..end)?
        .copy_from_slice(&bits.to_be_bytes());
    Some(end)
}

/// Runs the compression function over `data`, whose length is a multiple of 64, in
/// one call: a call per 64-byte block costs ~4 ns of state shuffling each.
pub(super) fn compress_blocks(state: &mut [u32; 8], data: &[u8]) {
    debug_assert!(data.len() % 64 == 0);
    let blocks = data.len() / 64;
    // SAFETY: GenericArray<u8, U64> is #[repr(transparent)] over 64 bytes with
    // alignment 1 (sha2 relies on the same layout, casting back to [u8; 64]), and
    // `blocks * 64 <= data.len()` bytes are read from `data`, borrowed for the call.
    let blocks = unsafe {
        std::slice::from_raw_parts(
            data.as_ptr()
                .cast::<GenericArray<u8, sha2::digest::consts::U64>>(),
            blocks,
        )
    };
    sha2::compress256(state, blocks);
}

/// The digest: the final state, big-endian.
pub(super) fn state_bytes(state: [u32; 8]) -> [u8; 32] {
    let mut digest = [0u8; 32];
    for (out, word) in digest.chunks_exact_mut(4).zip(state) {
        out.copy_from_slice(&word.to_be_bytes());
    }
    digest
}

/// The `0x80` that ends every message, then zeros.
const PAD_START: [u8; 65] = {
    let mut pad = [0u8; 65];
    pad[0] = 0x80;
    pad
};

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    #[test]
    fn sha256_in_place_pads_every_length() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 37 % 251) as u8).collect();
        let mut buf = vec![0xa5; 300 + SHA256_PAD];
        for len in 0..=300 {
            buf[..len].copy_from_slice(&data[..len]);
            let got = sha256_in_place(&mut buf, len).unwrap();
            assert_eq!(got[..], Sha256::digest(&data[..len])[..], "length {len}");
            // Leave garbage behind, as the hot path does.
            buf.fill(0x5a);
        }
        assert_eq!(sha256_in_place(&mut [0; 65], 1), None);
    }
}
