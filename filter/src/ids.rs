//! Token ids: their canonical bytes, and a scanner that writes them straight from a flat JSON
//! array (`[1, 22, 333]`), the bulk of `/generate` `input_ids` and `/v1/completions` integer
//! `prompt` bodies.
//!
//! Canonical form: each id's decimal digits (no sign, no leading zero: JSON's own digits)
//! followed by `,`, so `[1, 22,333]` is `1,22,333,` whatever the spacing ([`decimal`] writes one
//! id for the serde path). A block of `k` ids ends after every `k`-th comma
//! (`blocks::hash_token_blocks`). Why text and not the ids' values: a compact array already *is*
//! its canonical bytes, so the scanner copies them instead of computing every id's value
//! (which needs each id's digits aligned and multiplied out, ~80 Wasm instructions per id).
//!
//! This module only *reads bytes*; it never decides a request on its own. `request.rs` splices
//! what [`scan`] produced into a serde parse of the rest of the body (see `parse_fast` there),
//! which keeps serde the single judge of what is valid JSON. The scanner's contract is therefore
//! one-sided: it accepts exactly the arrays serde reads as a list of `u32`s
//! (`[` ws int (ws `,` ws int)* ws `]`, ints without sign, fraction, exponent or leading zero,
//! at most `u32::MAX`, ws = space, tab, CR, LF) and returns `None` for anything else (including
//! `[]`), after which the caller uses serde alone. Never panics: every byte is read with `get`.
//!
//! Layout: a chunk step (`id_chunks.rs`) reads 64 bytes at a time while they are ids of up to
//! 9 digits separated by `,` or `, ` (Python's `json.dumps` default, what the OpenAI and
//! `requests` clients send), validating them with byte-class masks and copying them out with
//! the spaces dropped. Anything else (other whitespace, ids of 10 digits, the closing `]`, the
//! last 64 bytes of the body) takes one general step: whitespace, one id byte by byte, its
//! separator; then back to the chunk step. On the way the scan records where every block of
//! ids ends, so the hasher need not search for the commas again.
//!
//! Costs (Wasm, fuel of `cargo bench -p proxy-wasm-host --bench wasm`, docs/performance.md):
//! ~20 instructions per id with `,`, ~50 with `, `. O(array bytes), no allocation beyond growing
//! the caller's reusable `out` and `ends` (written 512 bytes at a time from a stack block, one
//! `memory.copy` each).
//! [`locate`] walks the body's top-level object only as far as the prompt key.

use crate::id_chunks;

/// The most canonical bytes one id takes: 10 digits (`u32::MAX`) and its comma.
pub const MAX_ID_BYTES: usize = 11;

/// The canonical bytes of id `t` (its decimal digits and `,`), written at the end of `buf`.
pub fn decimal(t: u32, buf: &mut [u8; MAX_ID_BYTES]) -> &[u8] {
    let mut at = MAX_ID_BYTES - 1;
    if let Some(c) = buf.get_mut(at) {
        *c = b',';
    }
    let mut v = t;
    loop {
        at -= 1;
        if let Some(c) = buf.get_mut(at) {
            *c = b'0' + (v % 10) as u8;
        }
        v /= 10;
        if v == 0 || at == 0 {
            break;
        }
    }
    buf.get(at..).unwrap_or_default()
}

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
    /// Whether the canonical bytes were cut at `cap`.
    pub cut: bool,
}

/// Reads the flat array of `u32` ids that starts at `b[at] == b'['`, appending its canonical
/// bytes to `out` up to `cap` bytes in all (the count goes on: the whole array must be valid),
/// and to `ends` (cleared first) the canonical length after every `block`-th id while it is
/// at most `cap`: where blocks of `block` ids end (none when `block` is 0). `None` (with `out`
/// and `ends` in any state) when the array is not exactly what serde reads as a non-empty list
/// of `u32`s: the caller then parses with serde alone.
pub fn scan(
    b: &[u8],
    at: usize,
    out: &mut Vec<u8>,
    cap: usize,
    block: usize,
    ends: &mut Vec<usize>,
) -> Option<Scanned> {
    if b.get(at) != Some(&b'[') {
        return None;
    }
    ends.clear();
    let mut w = Writer::new(out, cap);
    let mut count = 0usize;
    // The id count at which the next block ends.
    let mut next = if block == 0 { usize::MAX } else { block };
    let mut p = at + 1;
    loop {
        while let Some(c) = w.room().and_then(|d| id_chunks::step(b, p, d)) {
            while next <= count + c.ids {
                let end = w.total() + c.through(next - count);
                if end <= cap {
                    ends.push(end);
                }
                next = next.saturating_add(block);
            }
            w.wrote(c.len);
            count += c.ids;
            p += c.used;
        }
        // General step: whitespace, one id, whitespace, then `,` or the closing `]`.
        let q = skip_ws(b, p);
        let (_, e) = number(b, q)?;
        w.put(b.get(q..e)?);
        w.put(b",");
        count += 1;
        if count == next {
            if w.total() <= cap {
                ends.push(w.total());
            }
            next = next.saturating_add(block);
        }
        let r = skip_ws(b, e);
        match b.get(r) {
            // The chunk step starts at an id: the whitespace after the comma is skipped here.
            Some(b',') => p = skip_ws(b, r + 1),
            Some(b']') => {
                let cut = w.finish();
                return Some(Scanned {
                    end: r + 1,
                    count,
                    cut,
                });
            }
            _ => return None,
        }
    }
}

/// Canonical bytes on their way to `out`: a stack block the chunk step writes whole 64-byte
/// chunks into (only the first `len` bytes of each count), appended to `out` when full and
/// cut at `cap`.
struct Writer<'o> {
    block: [u8; WRITE_BLOCK],
    at: usize,
    /// Bytes flushed so far (also those cut at `cap`).
    flushed: usize,
    out: &'o mut Vec<u8>,
    cap: usize,
    cut: bool,
}

const WRITE_BLOCK: usize = 512;

impl<'o> Writer<'o> {
    fn new(out: &'o mut Vec<u8>, cap: usize) -> Self {
        Writer {
            block: [0; WRITE_BLOCK],
            at: 0,
            flushed: 0,
            out,
            cap,
            cut: false,
        }
    }

    /// Room for one chunk (flushing first when the block is nearly full). Always `Some`.
    #[inline(always)]
    fn room(&mut self) -> Option<&mut [u8; id_chunks::CHUNK]> {
        if self.at > WRITE_BLOCK - id_chunks::CHUNK {
            self.flush();
        }
        self.block
            .get_mut(self.at..)
            .and_then(|s| s.first_chunk_mut())
    }

    /// Canonical bytes written so far.
    #[inline(always)]
    fn total(&self) -> usize {
        self.flushed + self.at
    }

    /// The chunk just written into [`Self::room`] holds `len` canonical bytes.
    #[inline(always)]
    fn wrote(&mut self, len: usize) {
        self.at += len;
    }

    fn put(&mut self, bytes: &[u8]) {
        if self.at + bytes.len() > WRITE_BLOCK {
            self.flush();
        }
        if let Some(d) = self.block.get_mut(self.at..self.at + bytes.len()) {
            d.copy_from_slice(bytes);
            self.at += bytes.len();
        }
    }

    fn flush(&mut self) {
        let room = self.cap.saturating_sub(self.out.len());
        let n = self.at.min(room);
        self.cut |= n < self.at;
        self.out
            .extend_from_slice(self.block.get(..n).unwrap_or_default());
        self.flushed += self.at;
        self.at = 0;
    }

    /// Flushes what is left; whether anything was cut at `cap`.
    fn finish(&mut self) -> bool {
        self.flush();
        self.cut
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
        let r = scan(s.as_bytes(), 0, &mut out, usize::MAX, 0, &mut Vec::new())?;
        let text = std::str::from_utf8(&out).unwrap();
        assert!(text.ends_with(','), "{text}");
        let v = text[..text.len() - 1]
            .split(',')
            .map(|t| t.parse().unwrap())
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

    /// Every separator form, every digit count (the chunk step, the general step and the
    /// tail), against serde.
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
        let body = format!("[{}]", vec!["17"; 3000].join(", "));
        for cap in [0, 8, 9, 511, 512, 513, 4000, 9000, 9001] {
            let mut out = Vec::new();
            let r = scan(body.as_bytes(), 0, &mut out, cap, 0, &mut Vec::new()).unwrap();
            assert_eq!(r.count, 3000);
            assert_eq!(out, "17,".repeat(3000).as_bytes()[..cap.min(9000)], "{cap}");
            assert_eq!(r.cut, cap < 9000, "{cap}");
        }
    }

    #[test]
    fn decimal_is_the_canonical_form() {
        let mut buf = [0u8; MAX_ID_BYTES];
        for t in [
            0u32,
            7,
            10,
            99,
            100,
            151_643,
            999_999_999,
            1_000_000_000,
            u32::MAX,
        ] {
            assert_eq!(decimal(t, &mut buf), format!("{t},").as_bytes());
        }
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
