//! A hand-written scanner for flat JSON arrays of token ids (`[1, 22, 333]`), the bulk of
//! `/generate` `input_ids` and `/v1/completions` integer `prompt` bodies.
//!
//! Why: through serde (`request.rs`) every id costs ~500 Wasm instructions (the generic
//! `SeqAccess` / `deserialize_u32` machinery: whitespace peeks, a comma state machine, a checked
//! multiply-add per digit with bounds checks on every byte, then a 4-byte `Vec` push). Here a
//! number of up to 7 digits is read with one 8-byte load: a SWAR test finds where the digits end
//! and three multiplies turn them into the value, whatever the digit count.
//!
//! This module only *reads bytes*; it never decides a request on its own. `request.rs` splices
//! what [`scan`] produced into a serde parse of the rest of the body (see `parse_fast` there),
//! which keeps serde the single judge of what is valid JSON. The scanner's contract is therefore
//! one-sided: it accepts exactly the arrays serde reads as a list of `u32`s
//! (`[` ws int (ws `,` ws int)* ws `]`, ints without sign, fraction, exponent or leading zero,
//! at most `u32::MAX`, ws = space, tab, CR, LF) and returns `None` for anything else (including
//! `[]`), after which the caller uses serde alone. Never panics: every byte is read with `get`.
//!
//! Layout: in the shipped `.wasm` (Wasm SIMD) a vector step reads two ids of 1 to 8 digits and
//! their `,` or `, ` separators per 16-byte load (`id_pairs.rs`) while it can. Then a fast loop
//! reads one id of 1 to 7 digits (no leading zero) and its separator per 8-byte load, for `,`
//! and for `, ` (Python's `json.dumps` default, what the OpenAI and `requests` clients send: the
//! space is in the same word and skipped there). Anything else (whitespace elsewhere, `0`, 8+
//! digits, the closing `]`, the last 7 bytes of the body) takes one general step (whitespace,
//! then one id through the same SWAR word or byte by byte, then its separator) and goes back to
//! the vector step. Native builds have no vector step (see `id_pairs::ENABLED`).
//!
//! Costs: the whole `/generate` request costs ~102 Wasm instructions per id with the vector
//! step and ~127 with the fast loop alone (~107 of them the loop), the same with `,` and `, `
//! (wasmtime fuel, 4096 ids of 1 to 6 digits, `harness/benches/wasm.rs`, docs/performance.md);
//! other whitespace (` ,`, `,\n  `) costs a general step per id on top. O(array bytes), no
//! allocation beyond growing the caller's reusable `out` (the ids are written as little-endian
//! `u32`s, 256 bytes at a time from a stack block, one `memory.copy` each). [`locate`] walks
//! the body's top-level object only as far as the prompt key.

use crate::id_pairs;

/// Whitespace as JSON (and serde_json) defines it.
fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_ws(b: &[u8], mut p: usize) -> usize {
    while b.get(p).is_some_and(|&c| is_ws(c)) {
        p += 1;
    }
    p
}

/// What [`scan`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scanned {
    /// One past the array's closing `]`.
    pub end: usize,
    /// Number of ids in the array (all of them, also those past `cap`).
    pub count: usize,
}

/// Ids per stack block before it is appended to `out`.
const BLOCK: usize = 64;

/// Per-byte constants of the SWAR digit test.
const ZEROS: u64 = 0x3030_3030_3030_3030;
const ADD46: u64 = 0x4646_4646_4646_4646;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// Reads the flat array of `u32` ids that starts at `b[at] == b'['`, appending each id to `out`
/// as 4 little-endian bytes while `out` is shorter than `cap` bytes (the count goes on: the
/// caller's canonical prompt is cut at its limit anyway, but the whole array must be valid).
/// `None` (with `out` in any state) when the array is not exactly what serde reads as a
/// non-empty list of `u32`s: the caller then parses with serde alone.
pub fn scan(b: &[u8], at: usize, out: &mut Vec<u8>, cap: usize) -> Option<Scanned> {
    if b.get(at) != Some(&b'[') {
        return None;
    }
    let mut block = [0u8; 4 * BLOCK];
    let mut count = 0usize;
    let mut p = at + 1;
    loop {
        // Vector step: two ids per 16-byte load (`id_pairs.rs`), where built with Wasm SIMD.
        if id_pairs::ENABLED {
            loop {
                // Pairs straight into the stack block while 8 bytes are left in it: no block
                // bookkeeping per pair.
                let (i0, mut i) = ((count % BLOCK) * 4, (count % BLOCK) * 4);
                let stopped = loop {
                    let Some(slot) = block.get_mut(i..).and_then(|s| s.first_chunk_mut::<8>())
                    else {
                        break false;
                    };
                    let Some((two, q)) = id_pairs::pair(b, p) else {
                        break true;
                    };
                    *slot = two.to_le_bytes();
                    i += 8;
                    p = q;
                };
                count += (i - i0) / 4;
                if stopped {
                    break;
                }
                if i == 4 * BLOCK {
                    if out.len() < cap {
                        out.extend_from_slice(&block);
                    }
                    continue;
                }
                // One id slot left: this pair straddles two blocks.
                let Some((two, q)) = id_pairs::pair(b, p) else {
                    break;
                };
                put2(&mut block, &mut count, out, cap, two);
                p = q;
            }
        }
        // Fast loop: one id of 1 to 7 digits at `p` followed by `,` or `, `, per round.
        while let Some(w) = b.get(p..).and_then(|s| s.first_chunk::<8>()) {
            let w = u64::from_le_bytes(*w);
            let Some((d, z)) = digits(w) else {
                break; // whitespace, `0` (alone or leading), 8+ digits, `]`, or a refusal
            };
            // The bytes after the digits are in `w` too: `,` is the common case, and `, `
            // (Python's `json.dumps` default, what the OpenAI and `requests` clients send)
            // skips its space here instead of going round through the general step. (For 7
            // digits only the separator is in `w`.)
            let sep = (w >> (z - 7)) as u16;
            if sep as u8 != b',' {
                break; // `]` or whitespace next: the general step reads this id again
            }
            put(&mut block, &mut count, out, cap, value(d, z));
            p += (z >> 3) as usize + 1 + usize::from(sep >> 8 == u16::from(b' '));
        }
        // General step: whitespace (then back to the fast loop), else one id and what follows
        // it up to its separator.
        let q = skip_ws(b, p);
        if q != p {
            p = q;
            continue;
        }
        let word = b.get(p..p + 8).and_then(|s| s.first_chunk::<8>());
        let (v, q) = match word.map(|w| u64::from_le_bytes(*w)).and_then(digits) {
            Some((d, z)) => (value(d, z), p + (z >> 3) as usize),
            None => number(b, p)?, // `0`, 8+ digits, the last bytes of the body
        };
        put(&mut block, &mut count, out, cap, v);
        let q = skip_ws(b, q);
        match b.get(q) {
            Some(b',') => p = q + 1,
            Some(b']') => {
                if out.len() < cap {
                    out.extend_from_slice(block.get(..4 * (count % BLOCK))?);
                }
                return Some(Scanned { end: q + 1, count });
            }
            _ => return None,
        }
    }
}

/// How many digits a word starts with, when 1 to 7 without a leading zero: `(d, z)` with `d`
/// the word minus `'0'` per byte and `z = 8n + 7` for `n` digits.
#[inline(always)]
fn digits(w: u64) -> Option<(u64, u32)> {
    // Per byte: `c - '0'` (high bit set when c < '0' or c >= 0xB0) or `c + 0x46` (high bit set
    // when '9' < c < 0xBA): the high bit flags a non-digit. Borrows and carries only move
    // upwards, out of digit bytes never, so the lowest flag is exactly the first non-digit.
    let d = w.wrapping_sub(ZEROS);
    if d & 0xFF == 0 {
        return None; // a leading `0`: `0` alone is read byte by byte, `01` refused
    }
    let t = (w.wrapping_add(ADD46) | d) & HIGH;
    let z = t.trailing_zeros(); // 8n + 7 for n leading digits; 64 when all 8 are
    (z.wrapping_sub(15) <= 48).then_some((d, z))
}

/// The value of the `n` leading digits of a word, given `d` (the word minus `'0'` per byte)
/// and `z = 8n + 7` (n from 1 to 7).
#[inline(always)]
fn value(d: u64, z: u32) -> u32 {
    // Left-align the n digits (zeros below are leading zeros), then combine pairs, quads and
    // octets: the value of up to 8 digits in 3 multiplies.
    let x = d << (71 - z); // 64 - 8n
    let x = x.wrapping_mul(10).wrapping_add(x >> 8);
    (((x & 0x0000_00FF_0000_00FF).wrapping_mul(0x000F_4240_0000_0064))
        .wrapping_add(((x >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(0x0000_2710_0000_0001))
        >> 32) as u32
}

/// Stores id number `count` in the stack block, appending the block to `out` when it is full
/// (while `out` is shorter than `cap`).
#[inline(always)]
fn put(block: &mut [u8; 4 * BLOCK], count: &mut usize, out: &mut Vec<u8>, cap: usize, v: u32) {
    let i = (*count % BLOCK) * 4;
    if let Some(slot) = block.get_mut(i..i + 4) {
        slot.copy_from_slice(&v.to_le_bytes());
    }
    *count += 1;
    if count.is_multiple_of(BLOCK) && out.len() < cap {
        out.extend_from_slice(block);
    }
}

/// Stores two ids (`two`: the first in the low half) like two [`put`]s, with one 8-byte store
/// when both fit the stack block.
#[inline(always)]
fn put2(block: &mut [u8; 4 * BLOCK], count: &mut usize, out: &mut Vec<u8>, cap: usize, two: u64) {
    let i = (*count % BLOCK) * 4;
    match block.get_mut(i..i + 8) {
        Some(slot) => {
            slot.copy_from_slice(&two.to_le_bytes());
            *count += 2;
            if count.is_multiple_of(BLOCK) && out.len() < cap {
                out.extend_from_slice(block);
            }
        }
        None => {
            put(block, count, out, cap, two as u32);
            put(block, count, out, cap, (two >> 32) as u32);
        }
    }
}

/// One canonical JSON integer at `b[p]` that fits a `u32`, byte by byte (the SWAR path's
/// fallback: 8+ digits, the last bytes of the body, or not a number at all). Returns the value
/// and the index after its last digit; `None` for no digit, a leading zero or overflow.
fn number(b: &[u8], p: usize) -> Option<(u32, usize)> {
    let first = *b.get(p)?;
    if !first.is_ascii_digit() {
        return None;
    }
    if first == b'0' {
        // serde_json rejects `01`; a lone `0` is fine.
        return match b.get(p + 1) {
            Some(c) if c.is_ascii_digit() => None,
            _ => Some((0, p + 1)),
        };
    }
    let mut v = 0u64;
    let mut q = p;
    while let Some(&c) = b.get(q) {
        if !c.is_ascii_digit() {
            break;
        }
        v = v * 10 + u64::from(c - b'0');
        if v > u64::from(u32::MAX) {
            return None;
        }
        q += 1;
    }
    Some((v as u32, q))
}

/// Where the flat id array of the prompt is, if the body looks like `{ ..., "key": [ids...]`
/// or `{ ..., "key": [[ids...], ...]` for one of `keys` (the first such key at the top level
/// decides): the index of that flat array's `[`. A purely lexical walk: keys with escapes,
/// values it cannot skip or any other surprise give `None` (serde alone then), and whatever it
/// finds is confirmed by the serde pass that `request.rs` runs over the rest of the body.
pub fn locate(b: &[u8], keys: &[&[u8]]) -> Option<usize> {
    let mut p = skip_ws(b, 0);
    if b.get(p) != Some(&b'{') {
        return None;
    }
    p += 1;
    loop {
        p = skip_ws(b, p);
        if b.get(p) != Some(&b'"') {
            return None;
        }
        let start = p + 1;
        let len = b
            .get(start..)?
            .iter()
            .position(|&c| c == b'"' || c == b'\\')?;
        let key = b.get(start..start + len)?;
        if b.get(start + len) != Some(&b'"') {
            return None; // an escaped key: leave it to serde
        }
        p = skip_ws(b, start + len + 1);
        if b.get(p) != Some(&b':') {
            return None;
        }
        p = skip_ws(b, p + 1);
        if keys.contains(&key) {
            if b.get(p) != Some(&b'[') {
                return None;
            }
            let inner = skip_ws(b, p + 1);
            return Some(if b.get(inner) == Some(&b'[') {
                inner
            } else {
                p
            });
        }
        p = skip_value(b, p)?;
        if b.get(p) != Some(&b',') {
            return None;
        }
        p += 1;
    }
}

/// Skips one value lexically (strings with their escapes, nested brackets counted, nothing
/// validated): the index of the `,` or `}` that follows it at the top level.
fn skip_value(b: &[u8], mut p: usize) -> Option<usize> {
    let mut depth = 0usize;
    loop {
        match *b.get(p)? {
            b'"' => {
                p += 1;
                loop {
                    match *b.get(p)? {
                        b'"' => break,
                        b'\\' => p += 2,
                        _ => p += 1,
                    }
                }
            }
            b'[' | b'{' => depth += 1,
            b']' | b'}' if depth > 0 => depth -= 1,
            b',' | b'}' if depth == 0 => return Some(p),
            b']' => return None,
            _ => {}
        }
        p += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &str) -> Option<(Vec<u32>, Scanned)> {
        let mut out = Vec::new();
        let r = scan(s.as_bytes(), 0, &mut out, usize::MAX)?;
        let v = out
            .chunks(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Some((v, r))
    }

    #[test]
    fn reads_canonical_arrays() {
        let s = "[1,22,333,4444,55555,666666,7777777,88888888,999999999,0]x";
        let (v, r) = ids(s).unwrap();
        assert_eq!(
            v,
            [1, 22, 333, 4444, 55555, 666666, 7777777, 88888888, 999999999, 0]
        );
        assert_eq!(r.end, s.len() - 1);
        assert_eq!(r.count, 10);
        let (v, _) = ids("[ 4294967295 ,\t0\r\n, 10 ]").unwrap();
        assert_eq!(v, [u32::MAX, 0, 10]);
        // Long arrays cross the stack block.
        let body = format!(
            "[{}]",
            (0..1000)
                .map(|i| (i * 7919).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        let (v, r) = ids(&body).unwrap();
        assert_eq!(v, (0..1000).map(|i| i * 7919).collect::<Vec<u32>>());
        assert_eq!(r.end, body.len());
    }

    /// Every separator form, every digit count (the fast loop, the general step's word read
    /// and the byte-by-byte tail), against serde.
    #[test]
    fn separators_and_digit_counts_match_serde() {
        let vals: Vec<u32> = (0..400u32)
            .map(|i| match i % 11 {
                10 => u32::MAX - i,
                k => 7u32.wrapping_pow(k).wrapping_add(i) % 10u32.pow(k.min(9)).max(10),
            })
            .collect();
        for sep in [",", ", ", " ,", " , ", ",\n  ", "\t,\r\n", ",  "] {
            for n in [1usize, 2, 3, 7, 8, 9, 64, 65, 400] {
                let want = &vals[..n];
                let text: Vec<String> = want.iter().map(u32::to_string).collect();
                for tail in ["]", " ]", "]}", "] ,\"x\":[1,2,3,4,5,6,7,8]}"] {
                    let s = format!("[{}{tail}", text.join(sep));
                    let (v, r) = ids(&s).unwrap_or_else(|| panic!("{s}"));
                    assert_eq!(v, want, "{s}");
                    assert_eq!(r.count, n);
                    assert_eq!(&s[r.end - 1..r.end], "]");
                    let serde: Vec<u32> = serde_json::from_str(&s[..r.end]).unwrap();
                    assert_eq!(serde, v);
                }
            }
        }
    }

    #[test]
    fn refuses_what_serde_refuses_as_u32s() {
        for s in [
            "[]",
            "[ ]",
            "[01]",
            "[1,]",
            "[,1]",
            "[-1]",
            "[-0]",
            "[1.0]",
            "[1e3]",
            "[1E3]",
            "[4294967296]",
            "[99999999999]",
            "[1 2]",
            "[\"1\"]",
            "[1",
            "[1,",
            "[[1]]",
            "[true]",
            "[1}",
            "[00]",
            "[12345678901234567890]",
        ] {
            assert!(ids(s).is_none(), "{s}");
        }
    }

    #[test]
    fn cap_bounds_the_output_not_the_count() {
        let body = format!("[{}]", vec!["7"; 300].join(","));
        let mut out = Vec::new();
        let r = scan(body.as_bytes(), 0, &mut out, 8).unwrap();
        assert_eq!(r.count, 300);
        assert!(out.len() >= 8 && out.len() <= 8 + 4 * BLOCK);
    }

    #[test]
    fn locates_the_prompt_array() {
        let k: &[&[u8]] = &[b"input_ids"];
        assert_eq!(locate(br#"{"input_ids":[1]}"#, k), Some(13));
        let b = r#" { "input_ids" : [ [1], [2] ] }"#;
        assert_eq!(locate(b.as_bytes(), k), b.find("[1]"));
        let b = r#"{"sampling_params":{"stop":["]",","]},"x":"\"","input_ids":[1]}"#;
        assert_eq!(locate(b.as_bytes(), k), b.find("[1]"));
        assert_eq!(locate(br#"{"in\u0070ut_ids":[1]}"#, k), None);
        assert_eq!(locate(br#"{"input_ids":"text"}"#, k), None);
        assert_eq!(locate(br#"{"model":"m"}"#, k), None);
        assert_eq!(locate(br#"["input_ids",[1]]"#, k), None);
    }
}
