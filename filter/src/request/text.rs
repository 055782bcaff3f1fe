//! The text fast path of request parsing: [`parse_text`] reads the common chat and completions
//! body (string `content` / `prompt`, at most one-letter escapes in what the router reads)
//! straight from its bytes, making the same sink calls as the serde pass (`super::run`) and so
//! the same [`Parsed`], canonical bytes and message bounds.
//!
//! Invariant: it accepts only bodies that are valid JSON in a strict subset of the grammar
//! serde_json reads (ASCII keys without escapes; strings without control characters and with
//! only the one-letter escapes, never `\u`; `model`, `lora_path` and `cache_salt` without
//! escapes; numbers of the JSON grammar; nesting at most [`MAX_DEPTH`] deep in skipped values),
//! on which serde_json succeeds. The rendered strings (`role`, `content`, `prompt`) are written
//! to the sink decoded as serde decodes them (`\n` a newline, `\"` a quote, ...), in pieces
//! between the escapes, whose lengths add up as one write would (`Sink::put` cuts at the same
//! byte). Everything else, including every body serde would reject, is declined
//! (`None`) and the caller parses it with serde, so a malformed body keeps serde's error and
//! counter. It also declines every shape whose serde handling is more than "write this string":
//! content-part arrays, `name` / `tool_calls` / `tool_call_id`, `tools`, `tool_choice`,
//! `chat_template_kwargs`, `response_format`, list prompts, a second `messages` / `prompt`.
//!
//! Costs: one pass over the body; strings are checked 16 bytes at a time for a quote,
//! backslash, control or non-ASCII byte (one Wasm SIMD check in the shipped `.wasm`, two 8-byte
//! words of ALU operations natively), UTF-8 validated only when a kept string has a non-ASCII
//! byte; an escape in a rendered string costs one more sink write; no allocation (the sink's buffers are reused), no
//! recursion beyond [`MAX_DEPTH`] frames.

use super::{Endpoint, Limit, Parsed, PromptKind, Sink, MSG, ROLE_END};
use std::borrow::Cow;

/// Deepest nesting of a skipped value (`stream_options: {..}` is 1). Far below serde_json's own
/// limit of 128, so that limit never decides a body this path accepts.
const MAX_DEPTH: usize = 16;

/// Parses a chat or completions body with a text prompt; `None` for anything else (see the
/// module docs): the caller then runs serde.
pub fn parse_text<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    canon: &mut Vec<u8>,
    bounds: &mut Vec<usize>,
    limit: Limit,
) -> Option<Parsed<'a>> {
    if endpoint == Endpoint::Generate {
        return None;
    }
    let mut sink = Sink::new(canon, bounds, None, limit);
    let mut r = Reader { b: body, p: 0 };
    let mut p = Parsed::default();
    r.ws();
    r.eat(b'{')?;
    r.ws();
    if !r.eat_if(b'}') {
        loop {
            let key = r.key()?;
            r.ws();
            r.eat(b':')?;
            r.ws();
            match (key, endpoint) {
                (b"model", _) => p.model = r.opt_str()?,
                (b"lora_path", _) => p.lora = r.opt_str()?,
                (b"cache_salt", _) => p.cache_salt = r.opt_str()?,
                (b"messages", Endpoint::Chat) => {
                    if p.kind != PromptKind::None {
                        return None; // serde: duplicate field
                    }
                    r.messages(&mut sink)?;
                    p.kind = PromptKind::Text;
                }
                (b"tools" | b"tool_choice" | b"chat_template_kwargs" | b"response_format", _)
                    if endpoint == Endpoint::Chat =>
                {
                    return None;
                }
                (b"prompt", Endpoint::Completions) => {
                    if p.kind != PromptKind::None {
                        return None; // serde: more than one prompt field
                    }
                    r.rendered(&mut sink)?;
                    p.kind = PromptKind::Text;
                }
                _ => r.skip(0)?,
            }
            if !r.more(b'}')? {
                break;
            }
        }
    }
    r.ws();
    if r.p != body.len() {
        return None;
    }
    p.truncated = sink.truncated;
    p.tokens = sink.tokens;
    p.text_bytes = sink.text_bytes;
    p.media_parts = sink.media_parts;
    Some(p)
}

/// A cursor over the body; every read is bounds-checked (`None` past the end).
struct Reader<'a> {
    b: &'a [u8],
    p: usize,
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
const ONES: u64 = 0x0101_0101_0101_0101;
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
const HIGH: u64 = 0x8080_8080_8080_8080;

/// High bit set in every byte of `w` that is zero (and possibly above one that is): exact as
/// "some byte is zero".
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn zero_bytes(w: u64) -> u64 {
    w.wrapping_sub(ONES) & !w & HIGH
}

/// How many bytes of `run` come before its first quote, backslash, control character or
/// non-ASCII byte (16: none): one Wasm SIMD check and a bit mask (the shipped `.wasm`,
/// `.cargo/config.toml`).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn plain_len(run: &[u8; 16]) -> usize {
    use core::arch::wasm32::*;
    // SAFETY: `run` is 16 readable bytes; `v128_load` needs no alignment.
    let v = unsafe { v128_load(run.as_ptr().cast()) };
    let special = v128_or(
        v128_or(
            u8x16_eq(v, u8x16_splat(b'"')),
            u8x16_eq(v, u8x16_splat(b'\\')),
        ),
        // Below 0x20 unsigned: control; below 0 signed: 0x80 and above.
        v128_or(u8x16_lt(v, u8x16_splat(0x20)), i8x16_lt(v, i8x16_splat(0))),
    );
    (u32::from(i8x16_bitmask(special)) | 1 << 16).trailing_zeros() as usize
}

/// The first quote, backslash, control character or non-ASCII byte of `run` (the bytes
/// [`plain_len`] stops at; `None`: none): per 16 bytes a subtraction and three compares (the
/// lanes of [`special_byte`]), one any-true branch for the four, bit masks only when it is taken.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn first_special_64(run: &[u8; 64]) -> Option<usize> {
    use core::arch::wasm32::*;
    let special = |i: usize| {
        // SAFETY: `i + 16 <= 64` bytes of `run` are readable; `v128_load` needs no alignment.
        let v = unsafe { v128_load(run.as_ptr().add(i).cast()) };
        v128_or(
            u8x16_gt(u8x16_sub(v, u8x16_splat(0x20)), u8x16_splat(0x5F)),
            v128_or(
                u8x16_eq(v, u8x16_splat(b'"')),
                u8x16_eq(v, u8x16_splat(b'\\')),
            ),
        )
    };
    let (a, b, c, d) = (special(0), special(16), special(32), special(48));
    if !v128_any_true(v128_or(v128_or(a, b), v128_or(c, d))) {
        return None;
    }
    [a, b, c, d]
        .into_iter()
        .enumerate()
        .find(|&(_, v)| v128_any_true(v))
        .map(|(i, v)| 16 * i + i8x16_bitmask(v).trailing_zeros() as usize)
}

/// [`first_special_64`] elsewhere: [`plain_len`] of each quarter.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn first_special_64(run: &[u8; 64]) -> Option<usize> {
    run.chunks_exact(16)
        .filter_map(|q| <&[u8; 16]>::try_from(q).ok())
        .enumerate()
        .find_map(|(i, q)| Some(16 * i + plain_len(q)).filter(|&n| n < 16 * (i + 1)))
}

/// The bytes a string scan stops at, as one lane of [`first_special_64`] tests them: below
/// 0x20 or from 0x80 (`b - 0x20` wraps to 0x60 or more), a quote or a backslash.
#[cfg(test)]
fn special_byte(b: u8) -> bool {
    b.wrapping_sub(0x20) > 0x5F || b == b'"' || b == b'\\'
}

/// [`plain_len`] elsewhere (native builds, unit tests): two 8-byte words, a few ALU operations
/// each. The lowest flagged byte of each test is exact (a borrow only runs upwards from a byte
/// that matched), which is all the count needs.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
#[inline(always)]
fn plain_len(run: &[u8; 16]) -> usize {
    let (Some(a), Some(b)) = (run.first_chunk::<8>(), run.last_chunk::<8>()) else {
        return 0;
    };
    let special = |w: &[u8; 8]| {
        let w = u64::from_le_bytes(*w);
        zero_bytes(w ^ (ONES * u64::from(b'"')))
            | zero_bytes(w ^ (ONES * u64::from(b'\\')))
            | (w.wrapping_sub(ONES * 0x20) & !w & HIGH)
            | (w & HIGH)
    };
    match special(a) {
        0 => 8 + (special(b).trailing_zeros() / 8).min(8) as usize,
        m => (m.trailing_zeros() / 8) as usize,
    }
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.p).copied()
    }
    /// JSON whitespace, as serde_json reads it.
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.p += 1;
        }
    }
    /// After an object member or an array element: `true` past a `,` (another follows),
    /// `false` past `close` (the container ended), `None` on anything else; the whitespace
    /// around them is consumed.
    fn more(&mut self, close: u8) -> Option<bool> {
        self.ws();
        if self.eat_if(b',') {
            self.ws();
            return Some(true);
        }
        self.eat(close)?;
        Some(false)
    }
    fn eat(&mut self, c: u8) -> Option<()> {
        self.eat_if(c).then_some(())
    }
    fn eat_if(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.p += 1;
            true
        } else {
            false
        }
    }
    fn lit(&mut self, word: &[u8]) -> Option<()> {
        let end = self.p.checked_add(word.len())?;
        (self.b.get(self.p..end)? == word).then(|| self.p = end)
    }

    /// Moves the cursor over plain string bytes, 64 then 16 at a time, to the first quote,
    /// backslash, control or non-ASCII byte, or to within 16 bytes of the body's end (the byte
    /// loops of the callers read those).
    #[inline(always)]
    fn skip_plain(&mut self) {
        // One 16-byte step first: most strings (keys, roles, models) end in it.
        let Some(Ok(run)) = self.b.get(self.p..self.p + 16).map(<&[u8; 16]>::try_from) else {
            return;
        };
        let n = plain_len(run);
        self.p += n;
        if n < 16 {
            return;
        }
        // Then 64 bytes a step while 64 are left: one branch per four vectors in a long run (a
        // prompt's text) instead of a bit mask, count and branch per vector.
        while let Some(run) = self.b.get(self.p..self.p + 64) {
            let Ok(run) = <&[u8; 64]>::try_from(run) else {
                break;
            };
            if let Some(n) = first_special_64(run) {
                self.p += n;
                return;
            }
            self.p += 64;
        }
        while let Some(run) = self.b.get(self.p..self.p + 16) {
            let Ok(run) = <&[u8; 16]>::try_from(run) else {
                return;
            };
            let n = plain_len(run);
            self.p += n;
            if n < 16 {
                return;
            }
        }
    }

    /// The bytes of a string starting at the cursor (its `"`), the cursor then past its closing
    /// quote, and whether it holds a non-ASCII byte. `None` on a control character, on a
    /// backslash unless `escapes` (then only the one-letter escapes other than `\u` pass, and
    /// the bytes returned are raw), or on an unterminated string.
    fn raw_str(&mut self, escapes: bool) -> Option<(&'a [u8], bool)> {
        self.eat(b'"')?;
        let start = self.p;
        let mut high = false;
        loop {
            self.skip_plain();
            let c = self.peek()?;
            self.p += 1;
            match c {
                b'"' => return Some((self.b.get(start..self.p - 1)?, high)),
                b'\\' if escapes => match self.peek()? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.p += 1,
                    _ => return None,
                },
                0..=0x1F | b'\\' => return None,
                0x80.. => high = true,
                _ => {}
            }
        }
    }
    /// A string the engine renders (`role`, `content`, `prompt`), written to `sink` as serde
    /// decodes it: the runs between escapes as they are, each one-letter escape as its byte;
    /// `None` on `\u`, another escape, a control character, invalid UTF-8 or no closing quote.
    /// On `None` the sink may hold part of the string: the caller's serde pass starts a new one.
    ///
    /// UTF-8 is checked on the raw bytes: the escapes are ASCII and decode to ASCII, so the raw
    /// string is valid exactly when the decoded one is.
    fn rendered(&mut self, sink: &mut Sink<'_>) -> Option<()> {
        self.eat(b'"')?;
        let start = self.p;
        let mut run = start; // start of the bytes not yet written
        let mut high = false;
        loop {
            self.skip_plain();
            let c = self.peek()?;
            self.p += 1;
            match c {
                b'"' => {
                    let raw = self.b.get(start..self.p - 1)?;
                    if high && std::str::from_utf8(raw).is_err() {
                        return None;
                    }
                    sink.put_text(self.b.get(run..self.p - 1)?);
                    return Some(());
                }
                b'\\' => {
                    let decoded = match self.peek()? {
                        b'"' => b'"',
                        b'\\' => b'\\',
                        b'/' => b'/',
                        b'b' => 0x08,
                        b'f' => 0x0C,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        _ => return None, // `\u` (serde decodes it) or not JSON
                    };
                    sink.put_text(self.b.get(run..self.p - 1)?);
                    sink.put_text(&[decoded]);
                    self.p += 1;
                    run = self.p;
                }
                0..=0x1F => return None,
                0x80.. => high = true,
                _ => {}
            }
        }
    }
    /// A string the router keeps as it is (`model`, ...): no escapes, valid UTF-8, borrowed
    /// from the body.
    fn str(&mut self) -> Option<&'a str> {
        match self.raw_str(false)? {
            (bytes, true) => std::str::from_utf8(bytes).ok(),
            // SAFETY: `raw_str` saw no byte >= 0x80 in `bytes`: ASCII, hence valid UTF-8.
            (bytes, false) => Some(unsafe { std::str::from_utf8_unchecked(bytes) }),
        }
    }
    /// A skipped string: escapes allowed, non-ASCII only as valid UTF-8 (serde_json does not
    /// check a skipped string's UTF-8; declining one it would take is safe, the converse not).
    fn skip_str(&mut self) -> Option<()> {
        match self.raw_str(true)? {
            (_, false) => Some(()),
            (bytes, true) => std::str::from_utf8(bytes).ok().map(|_| ()),
        }
    }
    /// An object key: ASCII, no escapes (an escaped key could spell a field we read).
    fn key(&mut self) -> Option<&'a [u8]> {
        match self.raw_str(false)? {
            (bytes, false) => Some(bytes),
            (_, true) => None,
        }
    }
    /// `model` / `lora_path` / `cache_salt`: a string or null.
    fn opt_str(&mut self) -> Option<Option<Cow<'a, str>>> {
        if self.peek()? == b'n' {
            self.lit(b"null")?;
            return Some(None);
        }
        Some(Some(Cow::Borrowed(self.str()?)))
    }

    /// `messages`: an array of message objects whose `role` is a string and whose `content`
    /// is a string or null; other keys are skipped, the ones serde writes raw are declined.
    fn messages(&mut self, sink: &mut Sink<'_>) -> Option<()> {
        self.eat(b'[')?;
        self.ws();
        if self.eat_if(b']') {
            return Some(());
        }
        loop {
            self.message(sink)?;
            if !self.more(b']')? {
                return Some(());
            }
        }
    }
    fn message(&mut self, sink: &mut Sink<'_>) -> Option<()> {
        self.eat(b'{')?;
        sink.put(&[MSG]);
        self.ws();
        if !self.eat_if(b'}') {
            loop {
                let key = self.key()?;
                self.ws();
                self.eat(b':')?;
                self.ws();
                match key {
                    b"role" => {
                        self.rendered(sink)?;
                        sink.put(&[ROLE_END]);
                    }
                    b"content" => {
                        if self.peek()? == b'n' {
                            self.lit(b"null")?;
                        } else {
                            self.rendered(sink)?;
                        }
                    }
                    b"name" | b"tool_calls" | b"tool_call_id" => return None,
                    _ => self.skip(1)?,
                }
                if !self.more(b'}')? {
                    break;
                }
            }
        }
        sink.bound();
        Some(())
    }

    /// Skips one value (the cursor at its first byte), checking it is valid JSON of the subset.
    fn skip(&mut self, depth: usize) -> Option<()> {
        match self.peek()? {
            b'"' => self.skip_str(),
            b'{' => {
                if depth >= MAX_DEPTH {
                    return None;
                }
                self.p += 1;
                self.ws();
                if self.eat_if(b'}') {
                    return Some(());
                }
                loop {
                    self.skip_str()?;
                    self.ws();
                    self.eat(b':')?;
                    self.ws();
                    self.skip(depth + 1)?;
                    if !self.more(b'}')? {
                        return Some(());
                    }
                }
            }
            b'[' => {
                if depth >= MAX_DEPTH {
                    return None;
                }
                self.p += 1;
                self.ws();
                if self.eat_if(b']') {
                    return Some(());
                }
                loop {
                    self.skip(depth + 1)?;
                    if !self.more(b']')? {
                        return Some(());
                    }
                }
            }
            b't' => self.lit(b"true"),
            b'f' => self.lit(b"false"),
            b'n' => self.lit(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }
    /// `-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`, at most 32 bytes.
    fn number(&mut self) -> Option<()> {
        let start = self.p;
        self.eat_if(b'-');
        match self.peek()? {
            b'0' => self.p += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat_if(b'.') {
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.p += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.p += 1;
            }
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        (self.p - start <= 32).then_some(())
    }
    fn digits(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.p += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{assert_same_parsed, parse_fast, parse_with_bounds, Endpoint, IdBuffers};
    use super::parse_text;
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    fn ws() -> impl Strategy<Value = &'static str> {
        prop_oneof![
            4 => Just(""),
            2 => Just(" "),
            1 => Just("\n\t"),
            1 => Just("\r "),
            1 => Just("\t"),
        ]
    }

    /// A JSON string's inside, written raw: plain, escaped (valid and not), unicode, control.
    fn inner() -> impl Strategy<Value = String> {
        prop_oneof![
            16 => "[a-zA-Z0-9 .,:{}\\[\\]]{0,40}",
            2 => "[a-z ]{0,6}\\\\[nt\"\\\\/bfru][a-fA-F0-9]{0,4}[a-z ]{0,6}",
            4 => escaped(),
            2 => "\\PC{0,12}",
            1 => "[a-z]{0,3}[\u{1}\u{1f}\u{7f}][a-z]{0,3}",
            1 => Just("x".repeat(100)),
        ]
    }

    /// Runs of one-letter escapes at every offset of the 16-byte SIMD steps, with non-ASCII
    /// letters among them: what the text path decodes into the canonical bytes.
    fn escaped() -> impl Strategy<Value = String> {
        "([a-zA-Z .é]{0,21}\\\\[nt\"\\\\/bfr]){1,5}[a-z ]{0,20}"
    }

    fn string() -> impl Strategy<Value = String> {
        inner().prop_map(|s| format!("\"{s}\""))
    }

    fn scalar() -> impl Strategy<Value = String> {
        prop_oneof![
            6 => string(),
            1 => Just("null".to_string()),
            2 => prop::sample::select(vec!["true", "false", "0", "-1", "0.25", "-0.5e3", "1E+9"])
                .prop_map(str::to_string),
            1 => prop::sample::select(vec![
                "nul", "01", "1.", "2e", "-", "1.5.2", "123456789012345678901234567890123456789",
                "\u{a0}0",
            ])
            .prop_map(str::to_string),
        ]
    }

    /// Any value: scalars, arrays and objects of them, nested a few levels.
    fn value() -> impl Strategy<Value = String> {
        scalar().prop_recursive(4, 24, 4, |v| {
            prop_oneof![
                (prop::collection::vec(v.clone(), 0..4), ws())
                    .prop_map(|(xs, w)| format!("[{w}{}{w}]", xs.join(","))),
                prop::collection::vec((string(), v), 0..4).prop_map(|kv| {
                    let kv: Vec<String> = kv.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", kv.join(", "))
                }),
            ]
        })
    }

    fn key(names: &'static [&'static str]) -> impl Strategy<Value = String> {
        prop_oneof![
            8 => prop::sample::select(names).prop_map(|k| format!("\"{k}\"")),
            1 => string(),
        ]
    }

    fn object(
        pairs: impl Strategy<Value = Vec<(String, String)>>,
    ) -> impl Strategy<Value = String> {
        (pairs, ws(), ws()).prop_map(|(kv, a, b)| {
            let kv: Vec<String> = kv
                .into_iter()
                .map(|(k, v)| format!("{a}{k}{b}:{a}{v}{b}"))
                .collect();
            format!("{{{}}}", kv.join(","))
        })
    }

    fn message() -> impl Strategy<Value = String> {
        const KEYS: &[&str] = &[
            "role",
            "content",
            "content",
            "role",
            "name",
            "tool_calls",
            "extra",
            "rol\\u0065",
        ];
        let text = || prop_oneof![4 => string(), 3 => escaped().prop_map(|s| format!("\"{s}\"")), 1 => value()];
        let field = (key(KEYS), text());
        prop_oneof![
            12 => object(prop::collection::vec(field, 0..4)),
            1 => value(),
        ]
    }

    fn body() -> impl Strategy<Value = String> {
        const KEYS: &[&str] = &[
            "model",
            "messages",
            "messages",
            "prompt",
            "prompt",
            "stream",
            "max_tokens",
            "cache_salt",
            "lora_path",
            "tools",
            "response_format",
            "mod\\u0065l",
            "input_ids",
            "stream_options",
            "stop",
        ];
        let messages = || {
            (prop::collection::vec(message(), 0..5), ws())
                .prop_map(|(ms, w)| format!("[{w}{}{w}]", ms.join(&format!(",{w}"))))
        };
        let field = key(KEYS).prop_flat_map(move |k| {
            let v = match k.as_str() {
                "\"messages\"" => prop_oneof![8 => messages(), 1 => value()].boxed(),
                "\"model\"" | "\"cache_salt\"" => prop_oneof![4 => string(), 1 => value()].boxed(),
                "\"prompt\"" => prop_oneof![
                    4 => string(),
                    3 => escaped().prop_map(|s| format!("\"{s}\"")),
                    1 => value()
                ]
                .boxed(),
                _ => value().boxed(),
            };
            (Just(k), v)
        });
        (object(prop::collection::vec(field, 0..6)), ws(), ws())
            .prop_map(|(o, a, b)| format!("{a}{o}{b}"))
    }

    /// Damage: a byte deleted, inserted or the body cut.
    fn damaged() -> impl Strategy<Value = Vec<u8>> {
        (
            body(),
            0usize..12,
            any::<prop::sample::Index>(),
            prop::sample::select(vec![
                b'"', b'\\', b',', b'}', b']', b'{', b'[', 0x80, 0xFF, 0, b' ',
            ]),
        )
            .prop_map(|(b, how, at, c)| {
                let mut b = b.into_bytes();
                let i = at.index(b.len() + 1);
                match how {
                    0 if i < b.len() => {
                        b.remove(i);
                    }
                    1 => b.insert(i, c),
                    2 => b.truncate(i),
                    _ => {}
                }
                b
            })
    }

    /// The differential property: on generated chat and completions bodies (escapes, unicode,
    /// odd whitespace, duplicate keys, wrong types, damaged bytes) the text path either declines
    /// or agrees with serde alone field by field, canonical bytes and bounds included; and
    /// `parse_fast` (text path, then ids, then serde) equals serde on every body, errors and
    /// their messages included. Deterministic seed; counts show both outcomes are exercised.
    #[test]
    fn text_path_declines_or_equals_serde() {
        let strat = (damaged(), any::<bool>(), 0usize..5);
        let mut runner = TestRunner::deterministic();
        let (mut taken, mut declined, mut oks, mut errs) = (0, 0, 0, 0);
        let mut taken_escaped = 0;
        let mut scratch = IdBuffers::for_blocks(4);
        let (mut ca, mut cb, mut ba, mut bb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for case in 0..16_000 {
            let (b, chat, li) = strat.new_tree(&mut runner).expect("tree").current();
            let ep = if chat {
                Endpoint::Chat
            } else {
                Endpoint::Completions
            };
            let limit = [1 << 20, 64, 7, 1000, 0][li];
            let ctx = || {
                format!(
                    "case {case} {ep:?} limit {limit}: {}",
                    String::from_utf8_lossy(&b)
                )
            };
            let want = parse_with_bounds(ep, &b, &mut ca, &mut ba, limit);
            let text = parse_text(ep, &b, &mut cb, &mut bb, limit.into());
            match (&want, &text) {
                (_, None) => declined += 1,
                (Ok(w), Some(g)) => {
                    assert_same_parsed(w, g, &ctx());
                    assert_eq!(ca, cb, "{}", ctx());
                    assert_eq!(ba, bb, "{}", ctx());
                    taken += 1;
                    // A decoded escape in the canonical bytes (a control byte or a quote).
                    if g.kind == super::super::PromptKind::Text
                        && cb
                            .iter()
                            .any(|&c| matches!(c, b'\n' | b'\t' | b'"' | b'\\' | 8 | 12 | b'\r'))
                    {
                        taken_escaped += 1;
                    }
                }
                (Err(e), Some(g)) => panic!("{}: serde {e:?}, text path {g:?}", ctx()),
            }
            let got = parse_fast(ep, &b, &mut cb, &mut bb, &mut scratch, limit);
            match (&want, &got) {
                (Ok(w), Ok(g)) => {
                    assert_eq!(
                        (&w.model, &w.cache_salt, w.kind),
                        (&g.model, &g.cache_salt, g.kind)
                    );
                    assert_eq!((w.text_bytes, w.truncated), (g.text_bytes, g.truncated));
                    assert_eq!((&ca, &ba), (&cb, &bb), "{}", ctx());
                    oks += 1;
                }
                (Err(w), Err(g)) => {
                    assert_eq!(w, g, "{}", ctx());
                    errs += 1;
                }
                _ => panic!("{}: serde {want:?}, fast {got:?}", ctx()),
            }
        }
        assert!(
            taken > 2_000 && declined > 2_000 && oks > 4_000 && errs > 2_000 && taken_escaped > 100,
            "taken {taken} ({taken_escaped} with escapes) declined {declined} ok {oks} err {errs}"
        );
    }

    /// Well-formed chat and completions bodies whose rendered strings (roles, contents, the
    /// prompt) carry one-letter escapes at every offset: the text path takes every one (none
    /// is handed to serde) and agrees with serde on all of it, canonical bytes and bounds.
    #[test]
    fn escaped_text_takes_the_text_path_and_equals_serde() {
        let content = || prop_oneof![1 => escaped(), 1 => "[a-z é]{0,30}"];
        let messages = prop::collection::vec(
            (
                prop::sample::select(vec!["system", "user", "assistant", "us\\ter"]),
                content(),
            ),
            1..5,
        );
        let strat = (messages, content(), any::<bool>(), 0usize..4);
        let mut runner = TestRunner::deterministic();
        let (mut ca, mut cb, mut ba, mut bb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for case in 0..4_000 {
            let (msgs, prompt, chat, li) = strat.new_tree(&mut runner).expect("tree").current();
            let limit = [1 << 20, 64, 7, 0][li];
            let (ep, b) = if chat {
                let m: Vec<String> = msgs
                    .iter()
                    .map(|(r, c)| format!(r#"{{"role":"{r}","content":"{c}"}}"#))
                    .collect();
                let b = format!(
                    r#"{{"model":"m","messages":[{}],"stream":true}}"#,
                    m.join(",")
                );
                (Endpoint::Chat, b)
            } else {
                let b = format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":9}}"#);
                (Endpoint::Completions, b)
            };
            let ctx = || format!("case {case} limit {limit}: {b}");
            let want = parse_with_bounds(ep, b.as_bytes(), &mut ca, &mut ba, limit)
                .unwrap_or_else(|e| panic!("{}: serde {e:?}", ctx()));
            let got = parse_text(ep, b.as_bytes(), &mut cb, &mut bb, limit.into())
                .unwrap_or_else(|| panic!("{}: declined", ctx()));
            assert_same_parsed(&want, &got, &ctx());
            assert_eq!((&ca, &ba), (&cb, &bb), "{}", ctx());
        }
    }

    /// `plain_len` is the position of the first special byte (quote, backslash, below 0x20,
    /// 0x80 and above) whatever bytes follow it, 16 when there is none.
    #[test]
    fn plain_len_finds_the_first_special_byte() {
        let special = |c: u8| c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c);
        let reference = |run: &[u8; 16]| run.iter().position(|&c| special(c)).unwrap_or(16);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for at in 0..=16 {
            for c in 0..=255u8 {
                for _ in 0..4 {
                    // Plain bytes before `at`, `c` at `at`, anything after it.
                    let mut run = [0u8; 16];
                    for (i, b) in run.iter_mut().enumerate() {
                        let r = next() as u8;
                        *b = if i < at { 0x20 + r % 0x5F } else { r };
                        if i < at && special(*b) {
                            *b = b'a';
                        }
                    }
                    if let Some(b) = run.get_mut(at) {
                        *b = c;
                    }
                    assert_eq!(super::plain_len(&run), reference(&run), "{run:?}");
                }
            }
        }
    }

    #[test]
    fn the_64_byte_step_stops_where_plain_len_does() {
        // The lane formula of the Wasm SIMD step, byte by byte.
        let special = |c: u8| c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c);
        for c in 0..=255u8 {
            assert_eq!(super::special_byte(c), special(c), "byte {c:#04x}");
        }
        // The step's first special byte, for one at each offset (or none) after plain ones.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for at in 0..=64 {
            for c in 0..=255u8 {
                let mut run = [0u8; 64];
                for (i, b) in run.iter_mut().enumerate() {
                    let r = next() as u8;
                    *b = if i < at { 0x20 + r % 0x5F } else { r };
                    if i < at && special(*b) {
                        *b = b'a';
                    }
                }
                if let Some(b) = run.get_mut(at) {
                    *b = c;
                }
                let reference = run.iter().position(|&c| special(c));
                assert_eq!(super::first_special_64(&run), reference, "{run:?}");
            }
        }
    }

    #[test]
    fn a_plain_chat_body_takes_the_text_path() {
        let b = br#"{"model": "m", "messages": [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "h\u00e9llo w\u00f6rld"}], "max_tokens": 16,
            "stream": true, "stream_options": {"include_usage": true}, "temperature": 0.7,
            "stop": ["\n\n", "END"]}"#;
        let (mut c, mut bd) = (Vec::new(), Vec::new());
        // `\u00e9` in the content: declined (serde unescapes it).
        assert!(parse_text(Endpoint::Chat, b, &mut c, &mut bd, (1 << 20).into()).is_none());
        let plain = String::from_utf8_lossy(b)
            .replace("\\u00e9", "é")
            .replace("\\u00f6", "ö");
        let p = parse_text(
            Endpoint::Chat,
            plain.as_bytes(),
            &mut c,
            &mut bd,
            (1 << 20).into(),
        );
        let p = p.expect("the text path reads a plain chat body");
        assert_eq!(p.model.as_deref(), Some("m"));
        assert_eq!(
            c,
            "\x1esystem\x1fbe brief\x1euser\x1fhéllo wörld".as_bytes()
        );
        assert_eq!(bd, vec![16, c.len()]);
        let p = parse_text(
            Endpoint::Completions,
            br#"{"model":"m","prompt":"once upon","cache_salt":"s"}"#,
            &mut c,
            &mut bd,
            (1 << 20).into(),
        )
        .expect("the text path reads a completions body");
        assert_eq!(
            (p.cache_salt.as_deref(), c.as_slice()),
            (Some("s"), &b"once upon"[..])
        );
    }
}
