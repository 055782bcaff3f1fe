//! The body a PD model's prefill and decode workers receive (SGLang PD, see `config/pd.rs`):
//! the client's JSON with `"bootstrap_host":..,"bootstrap_port":..,"bootstrap_room":<random
//! 63-bit>` inserted right after the opening brace and any top-level `bootstrap_*` member the
//! client sent dropped; the rest of the body is copied verbatim, never re-serialised.
//!
//! Invariants: a client never chooses a bootstrap field (its own are dropped: with duplicate
//! keys JSON parsers disagree on which wins); a body that is not a JSON object is refused
//! ([`BadBody`]), never passed on half-rewritten. Costs: one pass over the body and one copy
//! into a buffer reused across requests (no allocation in steady state); a key with an escape
//! is decoded once (rare: allocates). The room comes from a per-VM splitmix64 stream seeded at
//! start: unique per request with overwhelming probability, not a secret (clients never reach
//! the bootstrap port).

/// The body fields the filter owns.
pub const BOOTSTRAP_KEYS: [&[u8]; 3] = [b"bootstrap_host", b"bootstrap_port", b"bootstrap_room"];

/// The body could not be rewritten (not a JSON object): answered 400, counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadBody;

/// Body rewriting state kept per VM (one buffer reused across requests).
pub struct Rewriter {
    out: Vec<u8>,
    rng: u64,
    /// Client-sent bootstrap members dropped by the last rewrite.
    dropped: u32,
}

impl Rewriter {
    pub fn new(seed: u64) -> Rewriter {
        Rewriter {
            out: Vec::with_capacity(64 * 1024),
            rng: seed,
            dropped: 0,
        }
    }

    /// Restarts the room stream from `seed`.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = seed;
    }

    /// A fresh room: 63 random bits (SGLang draws `random.randint(0, 2**63 - 1)`).
    pub fn room(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) >> 1
    }

    /// The last rewritten body.
    pub fn body(&self) -> &[u8] {
        &self.out
    }

    /// Client-sent bootstrap members the last rewrite dropped.
    pub fn dropped(&self) -> u32 {
        self.dropped
    }

    /// Rewrites `body` for one prefill worker (`fields`: its rendered bootstrap fields,
    /// `config::pd::Pd::fields`) with a fresh room.
    pub fn rewrite_with_room(&mut self, body: &[u8], fields: &[u8]) -> Result<(), BadBody> {
        let room = self.room();
        self.rewrite(body, fields, room)
    }

    /// Writes `body` with `fields` + `room` inserted after the opening brace into `self.out`,
    /// dropping top-level `bootstrap_*` members (counted in `self.dropped`).
    pub fn rewrite(&mut self, body: &[u8], fields: &[u8], room: u64) -> Result<(), BadBody> {
        self.out.clear();
        self.dropped = 0;
        let mut i = ws(body, 0);
        if body.get(i) != Some(&b'{') {
            return Err(BadBody);
        }
        self.out.extend_from_slice(&body[..=i]);
        self.out.extend_from_slice(fields);
        let mut num = [0u8; 20];
        self.out.extend_from_slice(itoa(room, &mut num));
        i += 1;
        let mut first = true;
        loop {
            i = ws(body, i);
            match body.get(i) {
                Some(b'}') if first => break,
                Some(b'"') => {}
                _ => return Err(BadBody),
            }
            let key_start = i;
            let key_end = skip_string(body, i).ok_or(BadBody)?;
            i = ws(body, key_end);
            if body.get(i) != Some(&b':') {
                return Err(BadBody);
            }
            i = ws(body, i + 1);
            let value_end = skip_value(body, i).ok_or(BadBody)?;
            if is_bootstrap_key(&body[key_start..key_end]) {
                self.dropped += 1;
            } else {
                self.out.push(b',');
                self.out.extend_from_slice(&body[key_start..value_end]);
            }
            i = ws(body, value_end);
            first = false;
            match body.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => break,
                _ => return Err(BadBody),
            }
        }
        // the closing brace and whatever follows it (the worker judges trailing bytes)
        self.out.extend_from_slice(&body[i..]);
        Ok(())
    }
}

fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `b[i]` is a quote: the index after the closing quote.
fn skip_string(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
}

/// The index after the JSON value starting at `b[i]` (structure only: scalars are taken up to
/// the next delimiter; the worker validates them).
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while let Some(c) = b.get(j) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// Is this quoted key (quotes included) one of [`BOOTSTRAP_KEYS`], escapes decoded?
fn is_bootstrap_key(quoted: &[u8]) -> bool {
    let inner = &quoted[1..quoted.len().saturating_sub(1).max(1)];
    if !inner.contains(&b'\\') {
        return BOOTSTRAP_KEYS.contains(&inner);
    }
    match serde_json::from_slice::<String>(quoted) {
        Ok(k) => BOOTSTRAP_KEYS.contains(&k.as_bytes()),
        // an undecodable key: the worker refuses the body anyway; drop it to be safe
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn rw(body: &str) -> Result<Value, BadBody> {
        let mut r = Rewriter::new(7);
        r.rewrite(
            body.as_bytes(),
            br#""bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":"#,
            42,
        )?;
        Ok(serde_json::from_slice(&r.out).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&r.out));
        }))
    }

    #[test]
    fn inserts_fields_after_the_brace_and_keeps_the_rest_verbatim() {
        let body =
            r#" {"model":"m","messages":[{"role":"user","content":"hi, {\"x\":1}"}],"n":1.5e3} "#;
        let mut r = Rewriter::new(1);
        r.rewrite(
            body.as_bytes(),
            br#""bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":"#,
            9,
        )
        .unwrap();
        let out = String::from_utf8(r.out.clone()).unwrap();
        assert_eq!(
            out,
            r#" {"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":9,"model":"m","messages":[{"role":"user","content":"hi, {\"x\":1}"}],"n":1.5e3} "#
        );
        let v = rw(r#"{}"#).unwrap();
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v.as_object().unwrap().len(), 3);
    }

    #[test]
    fn client_bootstrap_fields_never_pass() {
        let v = rw(r#"{"bootstrap_room":1,"prompt":"x","bootstrap_host":"evil","bootstrap_port":[1,{"a":"}"}]}"#).unwrap();
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v["bootstrap_host"], "10.0.0.1");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["prompt"], "x");
        assert_eq!(v.as_object().unwrap().len(), 4);
        // an escaped key decodes to the same name: dropped too
        let mut r = Rewriter::new(1);
        r.rewrite(
            br#"{"bootstrap\u005froom":5,"a":1}"#,
            b"\"bootstrap_room\":",
            3,
        )
        .unwrap();
        assert_eq!(r.dropped, 1);
        assert_eq!(r.out, br#"{"bootstrap_room":3,"a":1}"#);
        // nested bootstrap keys belong to the client's data: kept
        let v = rw(r#"{"extra":{"bootstrap_room":1}}"#).unwrap();
        assert_eq!(v["extra"]["bootstrap_room"], 1);
    }

    #[test]
    fn non_objects_are_refused() {
        for b in [
            "",
            "[]",
            "\"x\"",
            "{",
            "{\"a\"}",
            "{\"a\":1,}",
            "{\"a\":\"",
            "{\"a\":1 \"b\":2}",
            "{,}",
        ] {
            assert_eq!(rw(b), Err(BadBody), "{b:?}");
        }
    }

    #[test]
    fn rooms_are_63_bit_and_distinct() {
        let mut r = Rewriter::new(123);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let room = r.room();
            assert!(room < 1 << 63);
            assert!(seen.insert(room));
        }
    }
}
