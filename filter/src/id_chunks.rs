//! 64 bytes of token ids at a time: the chunk step of the id scanner (`ids.rs`).
//!
//! Why: an id array's canonical bytes (`ids.rs`) are its own bytes minus the spaces, so the
//! scanner only has to *check* the bytes and copy them; nothing depends on an id's value. Here
//! one pass over 64 bytes gives three byte-class masks (commas, spaces, zeros) as 64-bit words,
//! and a handful of shifts and ANDs on them checks the grammar of every id in the chunk at once.
//!
//! Contract: [`step`] reads `b[p..p + 64]`, which must start an id, and takes the ids up to the
//! chunk's last comma (and the one space after it, if inside the chunk) when the chunk is
//! exactly ids of 1 to 9 digits without a leading zero, separated by `,` or `, `: every byte a
//! digit, `,` or ` `; every comma right after a digit; every space right after a comma; no `0`
//! starting an id of two or more digits; no run of 10 digits (which could exceed `u32::MAX`).
//! The partial id after the last comma is read again by the next step. Anything else (a `]`,
//! other whitespace, a 10-digit id, fewer than 64 bytes left) is `None` and the scanner's
//! general step reads on, so this step only ever takes a shortcut through what that step would
//! accept. Never reads outside `b`, never panics.
//!
//! Where: on `wasm32` built with `simd128` (the shipped `.wasm`: `.cargo/config.toml`) the byte
//! classes and the copy that drops spaces are Wasm SIMD (a swizzle per 8 bytes from a 2 KB
//! table). Elsewhere [`lanes`] is a byte loop computing the same masks, used by native builds
//! and by the unit tests, so that the mask logic runs against serde on every generated input.
//!
//! Costs (wasm, wasmtime fuel of `cargo bench -p proxy-wasm-host --bench wasm -- generate`,
//! ids below 128,000 as in a Llama-3-sized vocabulary): see docs/performance.md; correctness in
//! the real `.wasm`: `harness/tests/token_ids.rs`.

/// Bytes per step.
pub const CHUNK: usize = 64;

/// What one step took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Input bytes consumed (through the last comma and its space).
    pub used: usize,
    /// Canonical bytes written at the start of the destination (the rest is scratch).
    pub len: usize,
    /// Ids taken.
    pub ids: usize,
    /// The chunk's commas and spaces (bit `i` for byte `i`): where the ids end.
    pub commas: u64,
    pub spaces: u64,
}

impl Chunk {
    /// The canonical length of this chunk's first `n` ids (1 to `ids`), i.e. the offset just
    /// past its `n`-th comma in the canonical bytes written.
    #[inline(always)]
    pub fn through(&self, n: usize) -> usize {
        let mut m = self.commas;
        for _ in 1..n {
            m &= m.wrapping_sub(1);
        }
        let at = m.trailing_zeros().min(63);
        (at + 1 - (self.spaces & ((1u64 << at) - 1)).count_ones()) as usize
    }
}

/// Byte classes of a chunk, bit `i` for byte `i`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Masks {
    commas: u64,
    spaces: u64,
    /// `'0'` bytes.
    zeros: u64,
}

/// The ids of the 64-byte chunk at `b[p..]` (see the module docs), their canonical bytes
/// written at the start of `dst`.
#[inline(always)]
pub fn step(b: &[u8], p: usize, dst: &mut [u8; CHUNK]) -> Option<Chunk> {
    let src = b.get(p..)?.first_chunk::<CHUNK>()?;
    let m = lanes::classes(src)?; // every byte a digit, `,` or ` `
    let sep = m.commas | m.spaces;
    let digits = !sep;
    // Bytes right after a separator, and byte 0 (an id start by contract).
    let after_sep = (sep << 1) | 1;
    // Bit i of `run2` / `run8`: bytes i..i+2 / i..i+8 are all digits.
    let run2 = digits & (digits >> 1);
    let run4 = run2 & (run2 >> 2);
    let run8 = run4 & (run4 >> 4);
    let bad = (m.commas & after_sep) // `,,`, ` ,`, or a comma first: an empty id
        | (m.spaces & !(m.commas << 1)) // a space that does not follow a comma
        | (m.zeros & after_sep & (digits >> 1)) // `0` starting a longer id
        | (run8 & (run2 >> 8)); // 10 digits in a row
    if bad != 0 || m.commas == 0 {
        return None;
    }
    let last = 63 - m.commas.leading_zeros(); // the last comma: ids end there
    let through_last = u64::MAX >> (63 - last);
    let used = last as usize + 1 + ((m.spaces >> last) >> 1 & 1) as usize;
    let len = last as usize + 1 - (m.spaces & through_last).count_ones() as usize;
    lanes::copy(src, m.spaces, dst);
    Some(Chunk {
        used,
        len,
        ids: m.commas.count_ones() as usize,
        commas: m.commas,
        spaces: m.spaces,
    })
}

/// For each 8-bit mask of bytes to drop, swizzle indices that gather the other bytes of an
/// 8-byte group to its front (indices of 0x80 and above give zero lanes).
#[cfg(any(test, all(target_arch = "wasm32", target_feature = "simd128")))]
const DROP: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut m = 0;
    while m < 256 {
        let (mut w, mut out, mut j) = (0x8080_8080_8080_8080u64, 0, 0);
        while j < 8 {
            if m >> j & 1 == 0 {
                w = (w & !(0xFF << (8 * out))) | ((j as u64) << (8 * out));
                out += 1;
            }
            j += 1;
        }
        t[m] = w;
        m += 1;
    }
    t
};

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod lanes {
    use super::{Masks, CHUNK, DROP};
    use core::arch::wasm32::*;

    #[inline(always)]
    fn load(src: &[u8; CHUNK], k: usize) -> v128 {
        // SAFETY: `k < 4`, so `src[16k..16k + 16]` is readable; no alignment is required.
        unsafe { v128_load(src.as_ptr().add(16 * k).cast()) }
    }

    /// The chunk's commas, spaces and zeros; `None` unless every byte is a digit, `,` or ` `.
    #[inline(always)]
    pub fn classes(src: &[u8; CHUNK]) -> Option<Masks> {
        let mut ok = u8x16_splat(0xFF);
        let mut m = Masks::default();
        for k in 0..4 {
            let v = load(src, k);
            let digit = u8x16_lt(u8x16_sub(v, u8x16_splat(b'0')), u8x16_splat(10));
            let comma = u8x16_eq(v, u8x16_splat(b','));
            let space = u8x16_eq(v, u8x16_splat(b' '));
            ok = v128_and(ok, v128_or(digit, v128_or(comma, space)));
            let bits = |x: v128| u64::from(u8x16_bitmask(x)) << (16 * k);
            m.commas |= bits(comma);
            m.spaces |= bits(space);
            m.zeros |= bits(u8x16_eq(v, u8x16_splat(b'0')));
        }
        u8x16_all_true(ok).then_some(m)
    }

    /// `src` without its `spaces` bytes at the start of `dst` (the rest of `dst` is scratch).
    #[inline(always)]
    pub fn copy(src: &[u8; CHUNK], spaces: u64, dst: &mut [u8; CHUNK]) {
        if spaces == 0 {
            dst.copy_from_slice(src);
            return;
        }
        let mut o = 0usize;
        for k in 0..4 {
            let lo = (spaces >> (16 * k)) as u8;
            let hi = (spaces >> (16 * k + 8)) as u8;
            let idx = u64x2(
                DROP[usize::from(lo)],
                DROP[usize::from(hi)].wrapping_add(0x0808_0808_0808_0808),
            );
            let r = u8x16_swizzle(load(src, k), idx);
            // SAFETY: before the g-th of these 8 stores `o <= 8g <= 56`, so each 8-byte store
            // lands inside `dst`.
            unsafe {
                v128_store64_lane::<0>(r, dst.as_mut_ptr().add(o).cast());
                o += 8 - lo.count_ones() as usize;
                v128_store64_lane::<1>(r, dst.as_mut_ptr().add(o).cast());
                o += 8 - hi.count_ones() as usize;
            }
        }
    }
}

/// The same classes and copy one byte at a time.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod lanes {
    use super::{Masks, CHUNK};

    #[inline(always)]
    pub fn classes(src: &[u8; CHUNK]) -> Option<Masks> {
        let mut m = Masks::default();
        for (i, &c) in src.iter().enumerate() {
            let bit = 1u64 << i;
            match c {
                b',' => m.commas |= bit,
                b' ' => m.spaces |= bit,
                b'0' => m.zeros |= bit,
                b'1'..=b'9' => {}
                _ => return None,
            }
        }
        Some(m)
    }

    #[inline(always)]
    pub fn copy(src: &[u8; CHUNK], spaces: u64, dst: &mut [u8; CHUNK]) {
        if spaces == 0 {
            dst.copy_from_slice(src);
            return;
        }
        let mut o = 0;
        for (i, &c) in src.iter().enumerate() {
            if spaces >> i & 1 == 0 {
                if let Some(d) = dst.get_mut(o) {
                    *d = c;
                }
                o += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step at the start of `s` padded to 64 bytes with `1,`: (canonical, used, ids).
    fn at0(s: &str) -> Option<(String, usize, usize)> {
        let mut padded = s.to_string() + &"1,".repeat(CHUNK);
        padded.truncate(CHUNK.max(s.len()));
        let mut dst = [0u8; CHUNK];
        let c = step(padded.as_bytes(), 0, &mut dst)?;
        Some((
            String::from_utf8(dst[..c.len].to_vec()).unwrap(),
            c.used,
            c.ids,
        ))
    }

    #[test]
    fn takes_the_ids_up_to_the_last_comma() {
        let s = "1,22,333,".to_string() + &"4444,".repeat(10) + "12345";
        assert_eq!(s.len(), 64);
        assert_eq!(
            at0(&s),
            Some((s[..59].to_string(), 59, 13)),
            "the partial id after the last comma is left"
        );
        let s = "151643, 9, 70, ".repeat(4) + "1234";
        assert_eq!(at0(&s), Some(("151643,9,70,".repeat(4), 60, 12)));
        let s = "123456789,".repeat(6) + "1234";
        assert_eq!(at0(&s), Some(("123456789,".repeat(6), 60, 6)));
        let s = "12345, ".repeat(9) + "1";
        assert_eq!(at0(&s), Some(("12345,".repeat(9), 63, 9)));
        let s = "1,".repeat(32);
        assert_eq!(
            at0(&s),
            Some((s.clone(), 64, 32)),
            "a comma in the last byte"
        );
        let s = "12, ".repeat(16);
        assert_eq!(
            at0(&s),
            Some(("12,".repeat(16), 64, 16)),
            "a space in the last byte"
        );
        assert_eq!(
            at0("0,1,"),
            Some(("0,1,".to_string() + &"1,".repeat(30), 64, 32)),
            "a lone 0 is an id"
        );
    }

    #[test]
    fn refuses_what_the_general_step_must_judge() {
        for s in [
            "01,2,",
            "1,02,",
            "1, 02,",
            "1234567890,1,",
            "1,1234567890,",
            "1 ,2,",
            "1,  2,",
            "1,\t2,",
            "1,2]",
            ",1,2,",
            " 1,2,",
            "1,,2,",
            "-1,2,",
            "1.5,2,",
            "1,2e3,",
        ] {
            assert_eq!(at0(s), None, "{s}");
        }
        let long_tail = "1,".repeat(27) + "1234567890";
        assert_eq!(at0(&long_tail), None, "10 digits anywhere in the chunk");
        assert_eq!(
            step(b"1,2,3", 0, &mut [0; CHUNK]),
            None,
            "fewer than 64 bytes"
        );
    }

    #[test]
    fn the_drop_table_gathers_kept_bytes() {
        for (m, idx) in DROP.iter().enumerate() {
            let kept: Vec<u8> = (0..8u8).filter(|j| m >> j & 1 == 0).collect();
            let got = idx.to_le_bytes();
            assert_eq!(&got[..kept.len()], &kept[..], "{m:08b}");
            assert!(got[kept.len()..].iter().all(|&i| i >= 0x80), "{m:08b}");
        }
    }
}
