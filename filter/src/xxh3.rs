//! xxh3-64 with a seed, as `xxhash_rust::xxh3::xxh3_64_with_seed` computes it, with inputs of
//! 17 to 128 bytes (every full block at the default sizes: 64-byte text blocks, 16-token id
//! blocks of ~100 canonical bytes) hashed here.
//!
//! Why: xxh3 mixes such an input as two to eight 16-byte windows, each through a 64x64→128-bit
//! multiply. Wasm has no such instruction, so LLVM calls the `__multi3` libcall (a full
//! 128x128 product returned through linear memory) once per window. Here the windows are
//! multiplied inline from 32-bit halves.
//!
//! Invariant: the output equals `xxhash_rust`'s for every input and seed (the index, the peers
//! and the rendezvous keys of every replica must agree whatever build computed a hash; tested
//! below against the crate). Other lengths go to the crate. Native builds multiply through
//! `u128`, which is one instruction there.

use xxhash_rust::xxh3::xxh3_64_with_seed as reference;

/// The first 128 bytes of xxh3's default secret (`kSecret` in the xxHash specification), as
/// little-endian 64-bit words: the part an input of up to 128 bytes reads.
const SECRET: [u64; 16] = [
    0xBE4B_A423_396C_FEB8,
    0x1CAD_21F7_2C81_017C,
    0xDB97_9083_E96D_D4DE,
    0x1F67_B3B7_A4A4_4072,
    0x78E5_C0CC_4EE6_79CB,
    0x2172_FFCC_7DD0_5A82,
    0x8E24_43F7_7446_08B8,
    0x4C26_3A81_E690_35E0,
    0xCB00_C391_BB52_283C,
    0xA32E_531B_8B65_D088,
    0x4EF9_0DA2_9748_6471,
    0xD8AC_DEA9_46EF_1938,
    0x3F34_9CE3_3F76_FAA8,
    0x1D4F_0BC7_C7BB_DCF9,
    0x3159_B4CD_4BE0_518A,
    0x6473_78D9_C97E_9FC8,
];

const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;

/// xxh3-64 of `data` with `seed`.
#[inline]
pub fn xxh3_64_with_seed(data: &[u8], seed: u64) -> u64 {
    match <&[u8; 64]>::try_from(data) {
        Ok(block) => block64(block, seed),
        Err(_) if (17..=128).contains(&data.len()) => mid(data, seed),
        Err(_) => reference(data, seed),
    }
}

/// [`block64`] with Wasm SIMD: each 16-byte window is one load and one XOR with its secret
/// words (seed added to the first, subtracted from the second), and two windows' 128-bit
/// products are folded at once ([`fold2`]).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline]
fn block64(data: &[u8; 64], seed: u64) -> u64 {
    use core::arch::wasm32::*;
    let s = u64x2(seed, seed.wrapping_neg());
    let window = |at: usize, k: usize| {
        // SAFETY: `at <= 48`, so `data[at..at + 16]` is readable; no alignment is required.
        let w = unsafe { v128_load(data.as_ptr().add(at).cast()) };
        let key = u64x2(SECRET[k], SECRET[k + 1]);
        v128_xor(w, i64x2_add(key, s))
    };
    let r = i64x2_add(
        fold2(window(0, 0), window(48, 2)),
        fold2(window(16, 4), window(32, 6)),
    );
    let acc = 64u64
        .wrapping_mul(PRIME64_1)
        .wrapping_add(u64x2_extract_lane::<0>(r))
        .wrapping_add(u64x2_extract_lane::<1>(r));
    avalanche(acc)
}

/// [`mid`] with Wasm SIMD, as [`block64`]: the windows in pairs through [`fold2`].
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline]
fn mid(data: &[u8], seed: u64) -> u64 {
    use core::arch::wasm32::*;
    let len = data.len();
    if !(17..=128).contains(&len) {
        return reference(data, seed);
    }
    let s = u64x2(seed, seed.wrapping_neg());
    let window = |at: usize, k: usize| {
        debug_assert!(at + 16 <= len);
        // SAFETY: every window below starts at most at `len - 16` (`len >= 17`), so
        // `data[at..at + 16]` is readable; no alignment is required.
        let w = unsafe { v128_load(data.as_ptr().add(at).cast()) };
        let key = u64x2(SECRET[k], SECRET[k + 1]);
        v128_xor(w, i64x2_add(key, s))
    };
    let mut r = fold2(window(0, 0), window(len - 16, 2));
    if len > 32 {
        r = i64x2_add(r, fold2(window(16, 4), window(len - 32, 6)));
        if len > 64 {
            r = i64x2_add(r, fold2(window(32, 8), window(len - 48, 10)));
            if len > 96 {
                r = i64x2_add(r, fold2(window(48, 12), window(len - 64, 14)));
            }
        }
    }
    let acc = (len as u64)
        .wrapping_mul(PRIME64_1)
        .wrapping_add(u64x2_extract_lane::<0>(r))
        .wrapping_add(u64x2_extract_lane::<1>(r));
    avalanche(acc)
}

/// Two windows' [`fold`]s at once: `w0 = [a0, b0]`, `w1 = [a1, b1]` give
/// `[fold(a0, b0), fold(a1, b1)]`. The four 32x32→64 partial products of both windows are
/// four `extmul`s (Wasm has no 64x64→128 multiply); the carries of the two additions come from
/// unsigned compares (a signed compare with the sign bits flipped).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn fold2(w0: core::arch::wasm32::v128, w1: core::arch::wasm32::v128) -> core::arch::wasm32::v128 {
    use core::arch::wasm32::*;
    // As u32 lanes: w0 = [a0l, a0h, b0l, b0h], w1 = [a1l, a1h, b1l, b1h].
    let x = i32x4_shuffle::<0, 4, 1, 5>(w0, w1); // [a0l, a1l, a0h, a1h]
    let y = i32x4_shuffle::<2, 6, 3, 7>(w0, w1); // [b0l, b1l, b0h, b1h]
    let z = i32x4_shuffle::<3, 7, 2, 6>(w0, w1); // [b0h, b1h, b0l, b1l]
    let ll = u64x2_extmul_low_u32x4(x, y); // al * bl
    let hh = u64x2_extmul_high_u32x4(x, y); // ah * bh
    let lh = u64x2_extmul_low_u32x4(x, z); // al * bh
    let hl = u64x2_extmul_high_u32x4(x, z); // ah * bl
    let flip = u64x2_splat(1 << 63);
    let below = |a: v128, b: v128| i64x2_lt(v128_xor(a, flip), v128_xor(b, flip)); // a < b, unsigned
    let mid = i64x2_add(lh, hl);
    let c1 = below(mid, lh); // all ones when the sum wrapped: worth 2^96
    let low = i64x2_add(ll, i64x2_shl(mid, 32));
    let c2 = below(low, ll); // worth 2^64
    let high = i64x2_sub(
        i64x2_add(
            i64x2_add(hh, u64x2_shr(mid, 32)),
            v128_and(c1, u64x2_splat(1 << 32)),
        ),
        c2,
    );
    v128_xor(low, high)
}

/// xxh3's 17-to-128-byte path at 64 bytes: the windows at 0 and 48 with secret words 0-3, the
/// windows at 16 and 32 with words 4-7, summed, then avalanched.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
#[inline]
fn block64(data: &[u8; 64], seed: u64) -> u64 {
    let (w, _) = data.as_chunks::<8>();
    let word = |i: usize| w.get(i).map_or(0, |c| u64::from_le_bytes(*c));
    let [s0, s1, s2, s3, s4, s5, s6, s7, ..] = SECRET;
    let mix = |at: usize, k0: u64, k1: u64| {
        fold(
            word(at) ^ k0.wrapping_add(seed),
            word(at + 1) ^ k1.wrapping_sub(seed),
        )
    };
    let acc = 64u64
        .wrapping_mul(PRIME64_1)
        .wrapping_add(mix(0, s0, s1))
        .wrapping_add(mix(6, s2, s3))
        .wrapping_add(mix(2, s4, s5))
        .wrapping_add(mix(4, s6, s7));
    avalanche(acc)
}

/// xxh3's 17-to-128-byte path: pairs of 16-byte windows from both ends (as many pairs as the
/// length needs), each window with its two secret words, summed, then avalanched.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
#[inline]
fn mid(data: &[u8], seed: u64) -> u64 {
    let len = data.len();
    if !(17..=128).contains(&len) {
        return reference(data, seed);
    }
    let word = |i: usize| {
        debug_assert!(i + 8 <= len);
        // SAFETY: every window below starts at most at `len - 16` and reads 16 bytes, so
        // `i + 8 <= len` for each of its two words (`len >= 17` checked above).
        u64::from_le(unsafe { data.as_ptr().add(i).cast::<u64>().read_unaligned() })
    };
    let key = |k: usize| SECRET.get(k).copied().unwrap_or(0);
    let mix = |at: usize, k: usize| {
        fold(
            word(at) ^ key(k).wrapping_add(seed),
            word(at + 8) ^ key(k + 1).wrapping_sub(seed),
        )
    };
    let mut acc = (len as u64).wrapping_mul(PRIME64_1);
    if len > 32 {
        if len > 64 {
            if len > 96 {
                acc = acc
                    .wrapping_add(mix(48, 12))
                    .wrapping_add(mix(len - 64, 14));
            }
            acc = acc.wrapping_add(mix(32, 8)).wrapping_add(mix(len - 48, 10));
        }
        acc = acc.wrapping_add(mix(16, 4)).wrapping_add(mix(len - 32, 6));
    }
    acc = acc.wrapping_add(mix(0, 0)).wrapping_add(mix(len - 16, 2));
    avalanche(acc)
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

/// The 128-bit product of `a` and `b`, its two halves xor-ed.
#[cfg(not(target_arch = "wasm32"))]
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    p as u64 ^ (p >> 64) as u64
}

#[cfg(all(target_arch = "wasm32", not(target_feature = "simd128")))]
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    fold_halves(a, b)
}

/// [`fold`] from four 32x32→64 multiplies (what Wasm has). Written with explicit carries: LLVM
/// recognises the textbook form (high part from the shifted cross sums) as a 128-bit multiply
/// and turns it back into the `__multi3` call this module exists to avoid.
#[cfg(any(test, all(target_arch = "wasm32", not(target_feature = "simd128"))))]
#[inline(always)]
fn fold_halves(a: u64, b: u64) -> u64 {
    const LOW: u64 = 0xFFFF_FFFF;
    let (al, ah, bl, bh) = (a & LOW, a >> 32, b & LOW, b >> 32);
    let (mid, c1) = (al * bh).overflowing_add(ah * bl); // c1 is worth 2^96
    let (low, c2) = (al * bl).overflowing_add(mid << 32);
    let high = ah * bh + (mid >> 32) + (u64::from(c1) << 32) + u64::from(c2);
    low ^ high
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn every_length_and_seed_matches_the_crate() {
        for len in 0..=300 {
            for seed in [0, 1, u64::MAX, 0x9E37_79B9_7F4A_7C15, len as u64 * 7919] {
                let d = bytes(len, seed ^ 0x55);
                assert_eq!(
                    xxh3_64_with_seed(&d, seed),
                    reference(&d, seed),
                    "{len} {seed}"
                );
            }
        }
    }

    #[test]
    fn halves_equal_the_wide_product() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let edges = [0, 1, 0xFFFF_FFFF, 1 << 32, u64::MAX, u64::MAX - 1];
        for &a in &edges {
            for &b in &edges {
                assert_eq!(fold_halves(a, b), fold(a, b), "{a} {b}");
            }
        }
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (a, b) = (x, x.rotate_left(29) ^ 0xDEAD_BEEF);
            assert_eq!(fold_halves(a, b), fold(a, b));
        }
    }

    /// [`fold2`]'s lane operations on plain arrays, step for step (its shuffles, `extmul`s,
    /// unsigned compares and masks), checked against the 128-bit product: the arithmetic of the
    /// Wasm SIMD path. That the intrinsics do what these steps model is checked in the real
    /// `.wasm` (`harness/tests/hashes.rs`: its hashes equal the native build's).
    fn fold2_model(w0: [u64; 2], w1: [u64; 2]) -> [u64; 2] {
        let lanes = |w: [u64; 2]| {
            [
                w[0] as u32,
                (w[0] >> 32) as u32,
                w[1] as u32,
                (w[1] >> 32) as u32,
            ]
        };
        let (p, q) = (lanes(w0), lanes(w1));
        let cat = [p[0], p[1], p[2], p[3], q[0], q[1], q[2], q[3]];
        let shuf = |i: [usize; 4]| i.map(|k| cat[k]);
        let (x, y, z) = (shuf([0, 4, 1, 5]), shuf([2, 6, 3, 7]), shuf([3, 7, 2, 6]));
        let lo = |a: [u32; 4], b: [u32; 4]| {
            [
                u64::from(a[0]) * u64::from(b[0]),
                u64::from(a[1]) * u64::from(b[1]),
            ]
        };
        let hi = |a: [u32; 4], b: [u32; 4]| {
            [
                u64::from(a[2]) * u64::from(b[2]),
                u64::from(a[3]) * u64::from(b[3]),
            ]
        };
        let (ll, hh, lh, hl) = (lo(x, y), hi(x, y), lo(x, z), hi(x, z));
        let below = |a: u64, b: u64| {
            if ((a ^ 1 << 63) as i64) < ((b ^ 1 << 63) as i64) {
                u64::MAX
            } else {
                0
            }
        };
        core::array::from_fn(|i| {
            let mid = lh[i].wrapping_add(hl[i]);
            let c1 = below(mid, lh[i]);
            let low = ll[i].wrapping_add(mid << 32);
            let c2 = below(low, ll[i]);
            let high = hh[i]
                .wrapping_add(mid >> 32)
                .wrapping_add(c1 & 1 << 32)
                .wrapping_sub(c2);
            low ^ high
        })
    }

    #[test]
    fn two_windows_fold_like_the_wide_product() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let edges = [0, 1, 0xFFFF_FFFF, 1 << 32, u64::MAX, u64::MAX - 1, 1 << 63];
        for &a in &edges {
            for &b in &edges {
                let (c, d) = (next(), next());
                assert_eq!(
                    fold2_model([a, b], [c, d]),
                    [fold(a, b), fold(c, d)],
                    "{a} {b}"
                );
            }
        }
        for _ in 0..100_000 {
            let (a, b, c, d) = (next(), next(), next(), next());
            assert_eq!(fold2_model([a, b], [c, d]), [fold(a, b), fold(c, d)]);
        }
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_inputs_match_the_crate(d in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..160), seed: u64) {
            proptest::prop_assert_eq!(xxh3_64_with_seed(&d, seed), reference(&d, seed));
        }
    }
}
