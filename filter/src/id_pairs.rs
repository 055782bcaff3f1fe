//! Two token ids per 16-byte load: the vector step of the id scanner (`ids.rs`).
//!
//! Why: the scanner's SWAR loop reads one id per 8-byte word and pays ~107 Wasm instructions per
//! id (wasmtime fuel), most of it on the digit test, the separator and the value of *one* id.
//! Here one 16-byte load gives byte-class masks (digits, commas, spaces, zeros) for two ids and
//! their separators at once; bit scans of the comma mask find both ids, and one swizzle, one
//! multiply-add and two dot products turn both into values.
//!
//! Contract: [`pair`] reads `b[p..p + 16]` and accepts exactly `A sep B sep` inside those
//! 16 bytes, where `A` and `B` are 1 to 8 digits not starting with `0` and `sep` is `,` or
//! `, ` (the space is taken only when it is inside the 16 bytes). It returns both values and
//! the index after the second separator. Anything else (a `0` id, 9+ digits, other whitespace,
//! the closing `]`, fewer than 16 bytes left) is `None` and the caller's scalar steps read on,
//! so this step only ever takes a shortcut through what they would accept. Never reads outside
//! `b`, never panics.
//!
//! Where: on `wasm32` built with `simd128` (the shipped `.wasm`: `.cargo/config.toml`) the lanes
//! are Wasm SIMD. Elsewhere [`lanes`] is a scalar model of the same operations, used by the
//! native unit tests so that the mask logic runs against serde on every generated input; native
//! builds (the dynamic module, benches) keep the SWAR loop ([`ENABLED`]), which is cheaper
//! there than the model.
//!
//! Costs (wasm, wasmtime fuel of `cargo bench -p proxy-wasm-host --bench wasm -- generate`):
//! a `/generate` request costs ~102 Wasm instructions per token with this step against ~127
//! with the SWAR loop alone, in both `,` and `, ` bodies; hashing and the index take ~27 of
//! them. Variants that shortened the chain from one load to the next position (four ids per
//! 32 bytes; two interleaved cursors) gained no time: cranelift's code is throughput-bound.
//! Correctness in the real `.wasm`: `harness/tests/token_ids.rs`.

/// Whether `ids::scan` takes this step: with Wasm SIMD, and in the unit tests (scalar model).
pub const ENABLED: bool = cfg!(any(
    test,
    all(target_arch = "wasm32", target_feature = "simd128")
));

/// Swizzle indices that right-align an id of `n` digits (index `n % 8`) into 8 byte lanes: the
/// first `8 - n` lanes get an index of at least 16 (a zero lane), the others the digits in order.
/// A second id's indices add its start to every byte; the marker bytes stay at or above 16.
const ALIGN: [u64; 8] = {
    let mut t = [0u64; 8];
    let mut k = 0;
    while k < 8 {
        let n = if k == 0 { 8 } else { k };
        let mut j = 0;
        let mut w = 0u64;
        while j < 8 {
            let byte = if j < 8 - n {
                0x80
            } else {
                (j - (8 - n)) as u64
            };
            w |= byte << (8 * j);
            j += 1;
        }
        t[k] = w;
        k += 1;
    }
    t
};

/// One byte in every lane of a `u64`.
const ONES: u64 = 0x0101_0101_0101_0101;

/// Two ids `A sep B sep` at `b[p..]` (see the module docs): both values as one little-endian
/// `u64` (`A` in the low half) and the index after `B`'s separator.
#[inline(always)]
pub fn pair(b: &[u8], p: usize) -> Option<(u64, usize)> {
    let w = b.get(p..)?.first_chunk::<16>()?;
    let (dv, m) = lanes::classes(w);
    let mut commas = Commas::new(&m);
    let (a, b_) = (commas.id(0)?, commas.id_after()?);
    if !commas.all_digits(&m) {
        return None;
    }
    Some((
        lanes::values(dv, align(a), align(b_)),
        p + commas.end() as usize,
    ))
}

/// Swizzle indices for the id at bytes `start..comma`.
#[inline(always)]
fn align((start, comma): (u32, u32)) -> u64 {
    ALIGN[((comma - start) & 7) as usize] + u64::from(start) * ONES
}

/// Walks the comma mask: each id runs from its start (0, or after the previous `,` or `, `) to
/// the next comma, 1 to 8 bytes. The position only depends on the comma and space masks (bit
/// scans), so the next load does not wait for the digit checks, which only decide whether the
/// ids are taken. Every shift is by less than 32 (mask bits at 16 and above are 0).
struct Commas {
    rest: u32,
    spaces: u32,
    /// One past the last separator taken (the next id's start).
    next: u32,
    /// Bytes that must be digits, and the ids' first bytes (which must not be `0`).
    want: u32,
    starts: u32,
}

impl Commas {
    #[inline(always)]
    fn new(m: &Classes) -> Self {
        Commas {
            rest: m.commas,
            spaces: m.spaces,
            next: 0,
            want: 0,
            starts: 0,
        }
    }

    /// The id starting at `start`: `(start, comma)`, `None` unless it is 1 to 8 bytes.
    #[inline(always)]
    fn id(&mut self, start: u32) -> Option<(u32, u32)> {
        let comma = self.rest.trailing_zeros();
        if self.rest == 0 || comma.wrapping_sub(start).wrapping_sub(1) >= 8 {
            return None;
        }
        self.rest &= self.rest - 1;
        self.next = comma + 1 + ((self.spaces >> (comma + 1)) & 1);
        self.want |= ((1u32 << comma) - 1) & !((1u32 << start) - 1);
        self.starts |= 1 << start;
        Some((start, comma))
    }

    /// The id after the last separator taken.
    #[inline(always)]
    fn id_after(&mut self) -> Option<(u32, u32)> {
        self.id(self.next)
    }

    /// Whether every id taken is all digits and none starts with `0`.
    #[inline(always)]
    fn all_digits(&self, m: &Classes) -> bool {
        m.digits & self.want == self.want && m.zeros & self.starts == 0
    }

    #[inline(always)]
    fn end(&self) -> u32 {
        self.next
    }
}

/// Byte classes of 16 bytes, bit `i` for byte `i`.
pub struct Classes {
    digits: u32,
    commas: u32,
    spaces: u32,
    /// `'0'` bytes: an id may not start with one here (a lone `0` takes the scalar step).
    zeros: u32,
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod lanes {
    use super::Classes;
    use core::arch::wasm32::*;

    /// The bytes minus `'0'` (digit values in digit lanes) and their classes.
    #[inline(always)]
    pub fn classes(w: &[u8; 16]) -> (v128, Classes) {
        // SAFETY: `w` is 16 readable bytes; `v128_load` has no alignment requirement.
        let v = unsafe { v128_load(w.as_ptr().cast()) };
        let dv = u8x16_sub(v, u8x16_splat(b'0'));
        let mask = |x: v128| u32::from(u8x16_bitmask(x));
        let m = Classes {
            digits: mask(u8x16_lt(dv, u8x16_splat(10))),
            commas: mask(u8x16_eq(v, u8x16_splat(b','))),
            spaces: mask(u8x16_eq(v, u8x16_splat(b' '))),
            zeros: mask(u8x16_eq(dv, u8x16_splat(0))),
        };
        (dv, m)
    }

    /// The two ids the swizzle indices select (right-aligned 8-digit lanes, most significant
    /// digit first): pairs, then quads, then octets.
    #[inline(always)]
    pub fn values(dv: v128, idx_a: u64, idx_b: u64) -> u64 {
        let x = u8x16_swizzle(dv, u64x2(idx_a, idx_b));
        let t = u16x8_add(
            u16x8_mul(v128_and(x, u16x8_splat(0xFF)), u16x8_splat(10)),
            u16x8_shr(x, 8),
        );
        let q = i32x4_dot_i16x8(t, u32x4_splat(0x0001_0064)); // [100, 1] per i16 pair
                                                              // Quads are below 10^4: they fit i16 lanes again, and one more dot product with
                                                              // [10^4, 1] makes the octets (below 10^8, an i32) without a 64-bit multiply.
        let r = i32x4_dot_i16x8(i16x8_narrow_i32x4(q, q), u32x4_splat(0x0001_2710));
        u64x2_extract_lane::<0>(r)
    }
}

/// A scalar model of the Wasm SIMD lanes above, operation for operation.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod lanes {
    use super::Classes;

    #[inline(always)]
    pub fn classes(w: &[u8; 16]) -> ([u8; 16], Classes) {
        let dv = w.map(|c| c.wrapping_sub(b'0'));
        let mask =
            |f: &dyn Fn(usize) -> bool| (0..16).filter(|&i| f(i)).fold(0u32, |m, i| m | 1 << i);
        let m = Classes {
            digits: mask(&|i| dv[i] < 10),
            commas: mask(&|i| w[i] == b','),
            spaces: mask(&|i| w[i] == b' '),
            zeros: mask(&|i| dv[i] == 0),
        };
        (dv, m)
    }

    #[inline(always)]
    pub fn values(dv: [u8; 16], idx_a: u64, idx_b: u64) -> u64 {
        let idx: [u8; 16] = (u128::from(idx_a) | u128::from(idx_b) << 64).to_le_bytes();
        let x = idx.map(|i| dv.get(usize::from(i)).copied().unwrap_or(0));
        let t: [u16; 8] = core::array::from_fn(|k| {
            let w = u16::from_le_bytes([x[2 * k], x[2 * k + 1]]);
            (w & 0xFF).wrapping_mul(10).wrapping_add(w >> 8)
        });
        let q: [u32; 4] = core::array::from_fn(|k| {
            (i32::from(t[2 * k] as i16) * 100 + i32::from(t[2 * k + 1] as i16)) as u32
        });
        let narrow = |v: u32| (v as i32).clamp(i32::from(i16::MIN), i32::from(i16::MAX));
        let r = |k: usize| (narrow(q[2 * k]) * 10_000 + narrow(q[2 * k + 1])) as u32;
        u64::from(r(0)) | u64::from(r(1)) << 32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at0(s: &str) -> Option<(u32, u32, usize)> {
        let padded = format!("{s:x<16}");
        pair(padded.as_bytes(), 0).map(|(two, q)| (two as u32, (two >> 32) as u32, q))
    }

    #[test]
    fn reads_two_ids_and_their_separators() {
        assert_eq!(at0("1,2,"), Some((1, 2, 4)));
        assert_eq!(
            at0("12345678,8765432,"),
            None,
            "needs the second comma inside 16 bytes"
        );
        assert_eq!(at0("12345678,876543,"), Some((12_345_678, 876_543, 16)));
        assert_eq!(at0("151643, 9, 7"), Some((151_643, 9, 11)));
        assert_eq!(at0("7,15, 33"), Some((7, 15, 6)));
        assert_eq!(at0("99999999, 10000000,"), None);
        assert_eq!(
            at0("99999999,10000000,"),
            None,
            "the second comma is byte 17"
        );
        assert_eq!(at0("9999999,1000000,"), Some((9_999_999, 1_000_000, 16)));
    }

    #[test]
    fn refuses_what_the_scalar_steps_must_judge() {
        for s in [
            "0,1,",
            "1,0,",
            "01,2,",
            "1,02,",
            "123456789,1,",
            "1,123456789,",
            "1 ,2,",
            "1,  2,",
            "1,\t2,",
            "1,2]",
            "1,2",
            "1]",
            ",1,2,",
            " 1,2,",
            "1,,2,",
            "-1,2,",
            "1.5,2,",
            "1,2e3,",
        ] {
            assert_eq!(at0(s), None, "{s}");
        }
        assert_eq!(pair(b"1,2,3,4,5,6,7,8", 0), None, "fewer than 16 bytes");
    }

    #[test]
    fn every_digit_count_in_both_places() {
        let vals = [7u32, 42, 901, 1234, 56789, 151_643, 1_000_001, 98_765_432];
        for a in vals {
            for b in vals {
                for sep in [",", ", "] {
                    let s = format!("{a}{sep}{b},");
                    if s.len() > 16 {
                        assert_eq!(at0(&s), None, "{s}");
                        continue;
                    }
                    assert_eq!(at0(&s), Some((a, b, s.len())), "{s}");
                }
            }
        }
    }
}
