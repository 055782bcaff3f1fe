//! Request understanding: which endpoint, which model, and the prompt's canonical bytes.
//!
//! The body is parsed once with serde visitors that write the prompt straight into a reusable
//! buffer; no JSON tree is built and nothing but `model` / `lora_path` / `cache_salt` is kept.
//! Fields we do not need are skipped with `IgnoredAny` (still validated, so malformed JSON is
//! always detected).
//!
//! Canonical form (chat): first a header of what chat templates render before the messages,
//! `0x1C key raw-json` for `tools`, `tool_choice` and `chat_template_kwargs` in the body's order
//! (tools usually go into the system prompt; the kwargs and `tool_choice` can change the whole
//! rendering), placed in front of the messages whatever the field order; then for every message,
//! in order, `0x1E role 0x1F` followed by its content: string content as is; content-part arrays
//! part by part, text parts as their text and other fields as `0x1D key raw-json` (so an image
//! contributes its URL); `name`, `tool_calls` and `tool_call_id` as `0x1C key raw-json`; last,
//! `0x1C response_format raw-json` (not rendered, but it changes the answer, so two requests
//! differing only there never share a whole-prompt entry; it follows the last message boundary,
//! so the conversation's prefix is unaffected). Each message's bytes depend only on that
//! message, so turn N+1 of a conversation (which resends turns 1..N) starts with turn N's
//! header and messages exactly: the prefix property the index relies on. Sampling parameters
//! never enter the prompt bytes.
//!
//! Token estimate: only rendered text counts (`text_bytes`: roles, content, text parts, tool
//! calls, tools), each non-text part is counted once (`media_parts`, charged a fixed amount by
//! the router) and raw JSON sizes (names, URLs, unknown parts) never are.
//!
//! Token prompts (`input_ids`, integer `prompt`) are written in the canonical form of `ids.rs`
//! (each id's decimal digits and `,`), at most [`ids::MAX_ID_BYTES`] bytes per id. Batched
//! prompts (a list of strings or of token lists) are routed by their first element.
//!
//! [`parse_fast`] (what the router calls) reads the common chat / completions text body with the
//! hand-written reader in `request/text.rs`, and a token prompt's id array with the scanner in
//! `ids.rs` (serde parsing the rest); it returns exactly what [`parse_with_bounds`] returns for
//! every body (tested on valid and damaged ones), falling back to serde on anything unusual.

use crate::ids;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

mod fast;
mod path;
mod text;

pub use fast::{parse_fast, IdBuffers};
pub use path::{normalize_path, Endpoint, MAX_CLASSIFIED_PATH};

/// What kind of prompt was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptKind {
    #[default]
    None,
    Text,
    Tokens,
}

/// The fields of a request body the router needs; borrowed from the body where possible.
#[derive(Debug, Default)]
pub struct Parsed<'a> {
    pub model: Option<Cow<'a, str>>,
    pub lora: Option<Cow<'a, str>>,
    /// `cache_salt` (vLLM's OpenAI request field): seeds the block hashes (`blocks::salted_seed`).
    /// A value that is not a string (or null) makes the body malformed.
    pub cache_salt: Option<Cow<'a, str>>,
    pub kind: PromptKind,
    /// Token count for token prompts (text prompts estimate tokens from bytes).
    pub tokens: usize,
    /// Bytes of prompt text the engine renders (content, text parts, roles, tool calls, tools):
    /// what a text prompt's token estimate is based on. Counted in full even past the limit.
    pub text_bytes: usize,
    /// Non-text content parts (images, audio, video, unknown parts): each is charged a fixed
    /// number of tokens, whatever its JSON size.
    pub media_parts: usize,
    /// True when the prompt exceeded the byte limit and was cut (it is still routed).
    pub truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

/// The most canonical bytes kept per prompt: for text, and for token ids (whose canonical text
/// takes up to [`ids::MAX_ID_BYTES`] bytes per id). A plain `usize` is the same for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub text: usize,
    pub tokens: usize,
}

impl From<usize> for Limit {
    fn from(n: usize) -> Limit {
        Limit { text: n, tokens: n }
    }
}

/// Parses `body` for `endpoint`, writing the canonical prompt into `canon` (cleared first, at
/// most `limit` bytes). Never panics; any malformed input is a `ParseError`.
pub fn parse<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    canon: &mut Vec<u8>,
    limit: impl Into<Limit>,
) -> Result<Parsed<'a>, ParseError> {
    parse_with_bounds(endpoint, body, canon, &mut Vec::new(), limit)
}

/// [`parse`], also recording in `bounds` (cleared first) the canonical length after each chat
/// message. A conversation's next turn resends every message, so the previous turn's prompt ends
/// exactly at one of these boundaries: the index probes them to match whole previous turns.
pub fn parse_with_bounds<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    canon: &mut Vec<u8>,
    bounds: &mut Vec<usize>,
    limit: impl Into<Limit>,
) -> Result<Parsed<'a>, ParseError> {
    run(endpoint, body, canon, bounds, limit.into(), None).map(|(p, _)| p)
}

/// The id that stands for the scanned array in the serde pass ([`fast`]).
const MARKER: u32 = u32::MAX;

/// The serde parse; `splice` (the fast path) stands for the id array [`MARKER`] replaced. Also
/// says where in `canon` the splice was written, if it was.
fn run<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    canon: &mut Vec<u8>,
    bounds: &mut Vec<usize>,
    limit: Limit,
    splice: Option<Splice<'_>>,
) -> Result<(Parsed<'a>, Option<usize>), ParseError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let mut sink = Sink::new(canon, bounds, splice, limit);
    let mut parsed = BodySeed {
        endpoint,
        sink: &mut sink,
    }
    .deserialize(&mut de)
    .map_err(|e| ParseError(e.to_string()))?;
    de.end().map_err(|e| ParseError(e.to_string()))?;
    parsed.truncated = sink.truncated;
    parsed.tokens = sink.tokens;
    parsed.text_bytes = sink.text_bytes;
    parsed.media_parts = sink.media_parts;
    Ok((parsed, sink.spliced_at))
}

/// Ids already scanned (canonical bytes, possibly cut at the limit), how many there were, and
/// whether the bytes were cut.
struct Splice<'i> {
    bytes: &'i [u8],
    count: usize,
    cut: bool,
}

/// Most message boundaries kept per request: the first two (rendezvous key) and the deepest
/// ones (whole-turn matches probe at most [`crate::index::BOUNDARY_PROBES`] of them). A body of
/// millions of `{}` messages must not grow the VM's reusable buffer for the VM's life.
pub const MAX_BOUNDS: usize = 256;

/// The canonical-bytes writer, bounded by `limit` (text) and `token_limit` (token ids).
struct Sink<'o> {
    out: &'o mut Vec<u8>,
    bounds: &'o mut Vec<usize>,
    /// Fast path only: written in place of the [`MARKER`] id (then `None`).
    splice: Option<Splice<'o>>,
    /// Where in `out` the splice was written.
    spliced_at: Option<usize>,
    limit: usize,
    token_limit: usize,
    truncated: bool,
    tokens: usize,
    text_bytes: usize,
    media_parts: usize,
    /// End of the chat header (tools, template kwargs) in `out`: messages follow it.
    head_end: usize,
}

impl<'o> Sink<'o> {
    /// An empty sink over `out` and `bounds` (both cleared), writing at most `limit`.
    fn new(
        out: &'o mut Vec<u8>,
        bounds: &'o mut Vec<usize>,
        splice: Option<Splice<'o>>,
        limit: Limit,
    ) -> Sink<'o> {
        out.clear();
        bounds.clear();
        Sink {
            out,
            bounds,
            splice,
            spliced_at: None,
            limit: limit.text,
            token_limit: limit.tokens,
            truncated: false,
            tokens: 0,
            text_bytes: 0,
            media_parts: 0,
            head_end: 0,
        }
    }
    fn put(&mut self, bytes: &[u8]) {
        self.put_within(bytes, self.limit);
    }
    fn put_within(&mut self, bytes: &[u8], limit: usize) {
        let room = limit.saturating_sub(self.out.len());
        if bytes.len() > room {
            self.truncated = true;
            self.out.extend_from_slice(&bytes[..room]);
        } else {
            self.out.extend_from_slice(bytes);
        }
    }
    /// Prompt text the engine renders: counted for the token estimate.
    fn put_text(&mut self, bytes: &[u8]) {
        self.text_bytes = self.text_bytes.saturating_add(bytes.len());
        self.put(bytes);
    }
    fn token(&mut self, t: u32) {
        if t == MARKER {
            if let Some(s) = self.splice.take() {
                self.spliced_at = Some(self.out.len());
                self.tokens += s.count;
                self.put_within(s.bytes, self.token_limit);
                // The scan stops storing at the limit: what it dropped was cut here too.
                self.truncated |= s.cut;
                return;
            }
        }
        self.tokens += 1;
        let mut buf = [0u8; ids::MAX_ID_BYTES];
        self.put_within(ids::decimal(t, &mut buf), self.token_limit);
    }
    /// Ends a chat message: records its boundary, keeping the list bounded (see [`MAX_BOUNDS`]).
    fn bound(&mut self) {
        let end = self.out.len();
        if self.bounds.last() == Some(&end) {
            return; // an empty or truncated message: same boundary
        }
        if self.bounds.len() >= MAX_BOUNDS {
            // Keep the first two and the deepest half: amortised O(1) per message.
            self.bounds.drain(2..MAX_BOUNDS / 2);
        }
        self.bounds.push(end);
    }
    /// Appends `0x1C key raw` to the chat header, which precedes the messages whatever the
    /// field order of the body: a field after `messages` is inserted in front of them (one
    /// in-place rotation, no allocation), cutting the messages' tail if the limit requires it.
    fn head(&mut self, key: &str, raw: &str) {
        let at = self.head_end; // the messages written so far are `out[at..]`
        let want = 1 + key.len() + raw.len();
        let len = want.min(self.limit.saturating_sub(at));
        if len < want {
            self.truncated = true;
        }
        if len == 0 {
            return;
        }
        let keep = self.limit - len; // >= at, since len <= limit - at
        if self.out.len() > keep {
            self.truncated = true;
            self.out.truncate(keep);
        }
        let mut left = len;
        for piece in [&[META][..], key.as_bytes(), raw.as_bytes()] {
            let n = piece.len().min(left);
            self.out.extend_from_slice(&piece[..n]);
            left -= n;
        }
        if let Some(moved) = self.out.get_mut(at..) {
            moved.rotate_right(len);
        }
        let n = self.out.len();
        for b in self.bounds.iter_mut() {
            *b = (*b + len).min(n);
        }
        self.bounds.dedup();
        self.head_end = at + len;
    }
}

const MSG: u8 = 0x1E;
const ROLE_END: u8 = 0x1F;
const PART: u8 = 0x1D;
const META: u8 = 0x1C;

/// Field names we react to; everything else is skipped without allocating.
enum Field {
    Model,
    Lora,
    CacheSalt,
    Messages,
    Prompt,
    Text,
    InputIds,
    /// Rendered by chat templates before the messages (tools usually into the system prompt).
    Head(&'static str),
    /// Not rendered into the prompt but constrains the answer: after the messages.
    ResponseFormat,
    Other,
}

impl<'de> de::Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    "model" => Field::Model,
                    "lora_path" => Field::Lora,
                    "cache_salt" => Field::CacheSalt,
                    "messages" => Field::Messages,
                    "prompt" => Field::Prompt,
                    "text" => Field::Text,
                    "input_ids" => Field::InputIds,
                    "tools" => Field::Head("tools"),
                    "tool_choice" => Field::Head("tool_choice"),
                    "chat_template_kwargs" => Field::Head("chat_template_kwargs"),
                    "response_format" => Field::ResponseFormat,
                    _ => Field::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

struct BodySeed<'s, 'o> {
    endpoint: Endpoint,
    sink: &'s mut Sink<'o>,
}

impl<'de> DeserializeSeed<'de> for BodySeed<'_, '_> {
    type Value = Parsed<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Parsed<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_, '_> {
    type Value = Parsed<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parsed<'de>, A::Error> {
        let mut p = Parsed::default();
        let mut trailer: Option<&'de RawValue> = None;
        while let Some(field) = map.next_key::<Field>()? {
            match (field, self.endpoint) {
                (Field::Model, _) => p.model = map.next_value::<Option<Str<'de>>>()?.map(|s| s.0),
                (Field::Lora, _) => p.lora = map.next_value::<Option<Str<'de>>>()?.map(|s| s.0),
                (Field::CacheSalt, _) => {
                    p.cache_salt = map.next_value::<Option<Str<'de>>>()?.map(|s| s.0)
                }
                (Field::Messages, Endpoint::Chat) => {
                    if p.kind != PromptKind::None {
                        return Err(de::Error::duplicate_field("messages"));
                    }
                    map.next_value_seed(Messages(self.sink))?;
                    p.kind = PromptKind::Text;
                }
                (Field::Head(key), Endpoint::Chat) => {
                    let raw = map.next_value::<&'de RawValue>()?;
                    if key == "tools" {
                        self.sink.text_bytes = self.sink.text_bytes.saturating_add(raw.get().len());
                    }
                    self.sink.head(key, raw.get());
                }
                (Field::ResponseFormat, Endpoint::Chat) => {
                    trailer = Some(map.next_value::<&'de RawValue>()?);
                }
                (Field::Prompt, Endpoint::Completions)
                | (Field::Text, Endpoint::Generate)
                | (Field::InputIds, Endpoint::Generate) => {
                    if p.kind != PromptKind::None {
                        return Err(de::Error::custom("more than one prompt field"));
                    }
                    p.kind = map.next_value_seed(Prompt(self.sink))?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if let Some(raw) = trailer {
            if p.kind == PromptKind::Text {
                self.sink.put(&[META]);
                self.sink.put(b"response_format");
                self.sink.put(raw.get().as_bytes());
            }
        }
        Ok(p)
    }
}

/// A string borrowed from the body when it has no escapes. (serde's own `Cow<str>` impl always
/// copies into a `String`: one heap allocation per model name and per message key.)
struct Str<'de>(Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// Writes a string's bytes into the sink (borrowed or unescaped, never kept).
struct Text<'s, 'o>(&'s mut Sink<'o>);

impl<'de> DeserializeSeed<'de> for Text<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for Text<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.put_text(v.as_bytes());
        Ok(())
    }
}

/// `prompt` / `text` / `input_ids`: string, list of strings, list of ints, list of lists.
struct Prompt<'s, 'o>(&'s mut Sink<'o>);

impl<'de> DeserializeSeed<'de> for Prompt<'_, '_> {
    type Value = PromptKind;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<PromptKind, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Prompt<'_, '_> {
    type Value = PromptKind;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a list of strings, a list of token ids or a list of lists")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptKind, E> {
        self.0.put_text(v.as_bytes());
        Ok(PromptKind::Text)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptKind, A::Error> {
        let kind = match seq.next_element_seed(First(&mut *self.0))? {
            None => return Ok(PromptKind::None),
            Some(Shape::TokenId) => {
                // Flat token list: the rest are token ids too.
                while let Some(t) = seq.next_element::<u32>()? {
                    self.0.token(t);
                }
                return Ok(PromptKind::Tokens);
            }
            Some(Shape::Text) => PromptKind::Text,
            Some(Shape::TokenList(n)) if n > 0 => PromptKind::Tokens,
            Some(Shape::TokenList(_)) => PromptKind::None,
        };
        // Batch: route by the first element; the rest are validated and skipped.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(kind)
    }
}

/// Shape of a prompt list, decided by its first element.
enum Shape {
    Text,
    TokenId,
    TokenList(usize),
}

/// The first element of a prompt list decides its shape.
struct First<'s, 'o>(&'s mut Sink<'o>);

impl<'de> DeserializeSeed<'de> for First<'_, '_> {
    type Value = Shape;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for First<'_, '_> {
    type Value = Shape;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id or a list of token ids")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Shape, E> {
        let t = u32::try_from(v).map_err(|_| E::custom("token id out of range"))?;
        self.0.token(t);
        Ok(Shape::TokenId)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Shape, E> {
        let t = u32::try_from(v).map_err(|_| E::custom("token id out of range"))?;
        self.0.token(t);
        Ok(Shape::TokenId)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Shape, E> {
        self.0.put_text(v.as_bytes());
        Ok(Shape::Text)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        let mut n = 0usize;
        while let Some(t) = seq.next_element::<u32>()? {
            self.0.token(t);
            n += 1;
        }
        Ok(Shape::TokenList(n))
    }
}

/// `messages`: an array of message objects.
struct Messages<'s, 'o>(&'s mut Sink<'o>);

impl<'de> DeserializeSeed<'de> for Messages<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Messages<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Message(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

struct Message<'s, 'o>(&'s mut Sink<'o>);

impl<'de> DeserializeSeed<'de> for Message<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Message<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.0.put(&[MSG]);
        while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
            match &*key {
                "role" => {
                    map.next_value_seed(Text(&mut *self.0))?;
                    self.0.put(&[ROLE_END]);
                }
                "content" => map.next_value_seed(Content(&mut *self.0))?,
                "name" | "tool_calls" | "tool_call_id" => {
                    let raw = map.next_value::<&'de RawValue>()?;
                    self.0.put(&[META]);
                    self.0.put(key.as_bytes());
                    if &*key == "tool_calls" {
                        self.0.put_text(raw.get().as_bytes()); // rendered as the call's text
                    } else {
                        self.0.put(raw.get().as_bytes());
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        self.0.bound();
        Ok(())
    }
}

/// Message content: a string, null, or an array of content parts.
struct Content<'s, 'o>(&'s mut Sink<'o>);

impl<'de> DeserializeSeed<'de> for Content<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Content<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, null or a list of content parts")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.put_text(v.as_bytes());
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Part(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

struct Part<'s, 'o>(&'s mut Sink<'o>);

impl<'de> DeserializeSeed<'de> for Part<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Part<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a content part object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut media = false;
        while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
            match &*key {
                "text" => map.next_value_seed(Text(&mut *self.0))?,
                "type" => {
                    map.next_value::<IgnoredAny>()?;
                }
                _ => {
                    // An image, audio or video part (or an unknown one): hashed by its raw JSON
                    // (the URL or data names the content), charged a fixed amount, not its size.
                    let raw = map.next_value::<&'de RawValue>()?;
                    self.0.put(&[PART]);
                    self.0.put(key.as_bytes());
                    self.0.put(raw.get().as_bytes());
                    media = true;
                }
            }
        }
        self.0.media_parts += usize::from(media);
        Ok(())
    }
}

/// Test helper: two parses of one body agree on every field the router reads (`ctx` names the
/// case in a failure).
#[cfg(test)]
pub(crate) fn assert_same_parsed(w: &Parsed, g: &Parsed, ctx: &str) {
    assert_eq!(w.model, g.model, "{ctx}");
    assert_eq!(w.lora, g.lora, "{ctx}");
    assert_eq!(w.cache_salt, g.cache_salt, "{ctx}");
    assert_eq!(w.kind, g.kind, "{ctx}");
    assert_eq!(w.tokens, g.tokens, "{ctx}");
    assert_eq!(w.text_bytes, g.text_bytes, "{ctx}");
    assert_eq!(w.media_parts, g.media_parts, "{ctx}");
    assert_eq!(w.truncated, g.truncated, "{ctx}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(
        ep: Endpoint,
        body: &str,
    ) -> Result<(Vec<u8>, PromptKind, Option<String>), ParseError> {
        let mut buf = Vec::new();
        let p = parse(ep, body.as_bytes(), &mut buf, 1 << 20)?;
        Ok((buf, p.kind, p.model.map(|m| m.into_owned())))
    }

    fn tokens(v: &[u32]) -> Vec<u8> {
        v.iter()
            .flat_map(|t| format!("{t},").into_bytes())
            .collect()
    }

    #[test]
    fn model_and_keys_borrow_unless_escaped() {
        let mut buf = Vec::new();
        let body = br#"{"model":"llama","messages":[{"role":"user","content":"hi"}]}"#;
        let p = parse(Endpoint::Chat, body, &mut buf, 1 << 20).unwrap();
        assert!(matches!(p.model, Some(Cow::Borrowed("llama"))));
        let body = br#"{"model":"ll\u0061ma","messages":[{"r\u006fle":"user","content":"hi"}]}"#;
        let mut esc = Vec::new();
        let p = parse(Endpoint::Chat, body, &mut esc, 1 << 20).unwrap();
        assert_eq!(p.model.as_deref(), Some("llama"));
        assert_eq!(esc, buf, "escaped keys canonicalise like plain ones");
    }

    #[test]
    fn classify_paths() {
        assert_eq!(
            Endpoint::classify(b"POST", b"/v1/chat/completions?x=1"),
            Some(Endpoint::Chat)
        );
        assert_eq!(
            Endpoint::classify(b"POST", b"/v1/completions"),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::classify(b"PUT", b"/generate"),
            Some(Endpoint::Generate)
        );
        assert_eq!(Endpoint::classify(b"GET", b"/v1/chat/completions"), None);
        assert_eq!(Endpoint::classify(b"GET", b"/v1/models"), None);
        assert_eq!(Endpoint::classify(b"POST", b"/v1/chat/completionsx"), None);
    }

    #[test]
    fn classify_normalized_paths() {
        for (path, want) in [
            (&b"/v1/chat/%63ompletions"[..], Some(Endpoint::Chat)),
            (b"/v1/chat%2Fcompletions", Some(Endpoint::Chat)),
            (b"/v1/chat%2fcompletions?stream=1", Some(Endpoint::Chat)),
            (b"//v1/completions", Some(Endpoint::Completions)),
            (b"/v1//completions/", None),
            (b"/v1/./completions", Some(Endpoint::Completions)),
            (b"/x/../v1/completions", Some(Endpoint::Completions)),
            (b"/../../generate", Some(Endpoint::Generate)),
            (b"/%67enerate", Some(Endpoint::Generate)),
            (b"/v1/models", None),
            (b"/v1/chat/completions%", None),
            (b"/v1/chat/completions%zz", None),
            (b"", None),
            (b"%", None),
        ] {
            assert_eq!(
                Endpoint::classify(b"POST", path),
                want,
                "{}",
                String::from_utf8_lossy(path)
            );
        }
        let long = format!("/{}/v1/completions", "a".repeat(100));
        assert_eq!(Endpoint::classify(b"POST", long.as_bytes()), None);
        let slashes = format!("{}v1/completions", "/".repeat(1000));
        assert_eq!(
            Endpoint::classify(b"POST", slashes.as_bytes()),
            Some(Endpoint::Completions)
        );
    }

    #[test]
    fn chat_string_and_parts() {
        let (a, k, m) = canon(
            Endpoint::Chat,
            r#"{"model":"llama","temperature":0.5,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"http://x/img.png"}},{"type":"text","text":" there"}]}],"stream":true}"#,
        )
        .unwrap();
        assert_eq!(k, PromptKind::Text);
        assert_eq!(m.as_deref(), Some("llama"));
        let mut want = b"\x1esystem\x1fbe brief\x1euser\x1fhi\x1dimage_url".to_vec();
        want.extend_from_slice(br#"{"url":"http://x/img.png"}"#);
        want.extend_from_slice(b" there");
        assert_eq!(a, want);
    }

    #[test]
    fn chat_prefix_property_across_turns() {
        let t1 = r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q1 \"quoted\"\n"}],"model":"m"}"#;
        let t2 = r#"{"model":"m","max_tokens":9,"messages":[{"role":"system","content":"S"},{"role":"user","content":"q1 \"quoted\"\n"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#;
        let (a, _, _) = canon(Endpoint::Chat, t1).unwrap();
        let (b, _, _) = canon(Endpoint::Chat, t2).unwrap();
        assert!(b.starts_with(&a) && b.len() > a.len());
    }

    #[test]
    fn sampling_params_do_not_change_prompt() {
        let (a, _, _) = canon(
            Endpoint::Chat,
            r#"{"messages":[{"role":"user","content":"x"}],"temperature":1}"#,
        )
        .unwrap();
        let (b, _, _) = canon(
            Endpoint::Chat,
            r#"{"top_p":0.1,"messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn chat_tool_calls_and_null_content() {
        let (a, _, _) = canon(
            Endpoint::Chat,
            r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","content":"r"}]}"#,
        )
        .unwrap();
        assert_eq!(
            a,
            b"\x1eassistant\x1f\x1ctool_calls[{\"id\":\"1\"}]\x1etool\x1f\x1ctool_call_id\"1\"r"
                .to_vec()
        );
    }

    #[test]
    fn completions_prompt_shapes() {
        let (a, k, _) = canon(Endpoint::Completions, r#"{"prompt":"hello"}"#).unwrap();
        assert_eq!((a, k), (b"hello".to_vec(), PromptKind::Text));
        let (a, k, _) = canon(Endpoint::Completions, r#"{"prompt":["first","second"]}"#).unwrap();
        assert_eq!((a, k), (b"first".to_vec(), PromptKind::Text));
        let (a, k, _) = canon(Endpoint::Completions, r#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!((a, k), (tokens(&[1, 2, 3]), PromptKind::Tokens));
        let (a, k, _) = canon(Endpoint::Completions, r#"{"prompt":[[7,8],[9]]}"#).unwrap();
        assert_eq!((a, k), (tokens(&[7, 8]), PromptKind::Tokens));
        let (a, k, _) = canon(Endpoint::Completions, r#"{"prompt":[[7],[9]]}"#).unwrap();
        assert_eq!((a, k), (tokens(&[7]), PromptKind::Tokens));
        let (a, k, _) = canon(Endpoint::Completions, r#"{"prompt":[]}"#).unwrap();
        assert_eq!((a, k), (vec![], PromptKind::None));
        // Messages are not a completions prompt.
        let (a, k, _) = canon(
            Endpoint::Completions,
            r#"{"messages":[{"role":"u","content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!((a, k), (vec![], PromptKind::None));
    }

    #[test]
    fn generate_text_and_ids() {
        let (a, k, _) = canon(
            Endpoint::Generate,
            r#"{"text":"abc","sampling_params":{"max_new_tokens":4}}"#,
        )
        .unwrap();
        assert_eq!((a, k), (b"abc".to_vec(), PromptKind::Text));
        let (a, k, _) = canon(
            Endpoint::Generate,
            r#"{"input_ids":[5,6],"lora_path":"ad"}"#,
        )
        .unwrap();
        assert_eq!((a, k), (tokens(&[5, 6]), PromptKind::Tokens));
        let mut buf = Vec::new();
        let p = parse(
            Endpoint::Generate,
            br#"{"input_ids":[5],"lora_path":"ad"}"#,
            &mut buf,
            99,
        )
        .unwrap();
        assert_eq!(p.lora.as_deref(), Some("ad"));
        assert_eq!(p.tokens, 1);
    }

    #[test]
    fn cache_salt_is_read_on_every_endpoint_and_must_be_a_string() {
        let cases = [
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"hi"}],"#,
            ),
            (Endpoint::Completions, r#"{"prompt":"hi","#),
            (Endpoint::Generate, r#"{"input_ids":[5,6],"#),
        ];
        let mut scratch = IdBuffers::default();
        for (ep, head) in cases {
            let (mut c, mut b) = (Vec::new(), Vec::new());
            let body = format!(r#"{head}"cache_salt":"t\u0065nant"}}"#);
            let p = parse_fast(ep, body.as_bytes(), &mut c, &mut b, &mut scratch, 1 << 20);
            assert_eq!(p.unwrap().cache_salt.as_deref(), Some("tenant"), "{ep:?}");
            let none = format!(r#"{head}"cache_salt":null}}"#);
            let p = parse(ep, none.as_bytes(), &mut c, 1 << 20).unwrap();
            assert_eq!(p.cache_salt, None);
            for bad in ["5", "[\"a\"]", "{}", "true"] {
                let body = format!(r#"{head}"cache_salt":{bad}}}"#);
                assert!(
                    parse(ep, body.as_bytes(), &mut c, 1 << 20).is_err(),
                    "{bad}"
                );
            }
        }
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        let bad: &[&[u8]] = &[
            b"",
            b"{",
            b"[]",
            b"null",
            b"{\"messages\": 5}",
            b"{\"messages\": [5]}",
            b"{\"messages\": [{\"content\": 5}]}",
            b"{\"messages\": [{\"role\": \"u\", \"content\": [{\"text\": 1}]}]}",
            b"{\"model\": 7, \"messages\": []}",
            b"{\"prompt\": [-1]}",
            b"{\"prompt\": [1, \"x\"]}",
            b"{\"prompt\": [4294967296]}",
            b"{\"prompt\": [1.5]}",
            b"{\"prompt\": {}}",
            b"{\"prompt\": \"a\"} trailing",
            b"{\"messages\": [{\"role\": \"u\", \"content\": \"\xff\xfe\"}]}",
        ];
        for b in bad {
            let ep = if b.windows(6).any(|w| w == b"prompt") {
                Endpoint::Completions
            } else {
                Endpoint::Chat
            };
            let mut buf = Vec::new();
            assert!(
                parse(ep, b, &mut buf, 1 << 20).is_err(),
                "{:?}",
                String::from_utf8_lossy(b)
            );
        }
    }

    #[test]
    fn deep_nesting_never_overflows_the_stack() {
        // Deeply nested *ignored* fields are valid JSON: skipped iteratively, still routed.
        let mut s = String::from("{\"x\":");
        s.push_str(&"[".repeat(100_000));
        s.push_str(&"]".repeat(100_000));
        s.push_str(",\"messages\":[{\"role\":\"u\",\"content\":\"hi\"}]}");
        let mut buf = Vec::new();
        let p = parse(Endpoint::Chat, s.as_bytes(), &mut buf, 1 << 20).unwrap();
        assert_eq!(p.kind, PromptKind::Text);
        // Unbalanced deep nesting is an error, not a crash.
        assert!(parse(Endpoint::Chat, &s.as_bytes()[..150_000], &mut buf, 1 << 20).is_err());
        // Nesting where we expect structure is a type error.
        let deep_content = format!(
            "{{\"messages\":[{{\"role\":\"u\",\"content\":{}{}}}]}}",
            "[".repeat(50_000),
            "]".repeat(50_000)
        );
        assert!(parse(Endpoint::Chat, deep_content.as_bytes(), &mut buf, 1 << 20).is_err());
    }

    #[test]
    fn huge_arrays_are_bounded_by_limit() {
        let ids: Vec<String> = (0..200_000).map(|i| (i % 50_000).to_string()).collect();
        let body = format!("{{\"input_ids\":[{}]}}", ids.join(","));
        let mut buf = Vec::new();
        let p = parse(Endpoint::Generate, body.as_bytes(), &mut buf, 4096).unwrap();
        assert!(p.truncated);
        assert_eq!(buf.len(), 4096);
        assert_eq!(p.tokens, 200_000);
        let body = format!("{{\"prompt\":\"{}\"}}", "a".repeat(100_000));
        let p = parse(Endpoint::Completions, body.as_bytes(), &mut buf, 1000).unwrap();
        assert!(p.truncated && buf.len() == 1000);
        // Text and token ids have their own limits, on both paths.
        let limit = Limit {
            text: 100,
            tokens: 1000,
        };
        let ids = format!("{{\"prompt\":[{}]}}", vec!["12345"; 150].join(", "));
        let text = format!("{{\"prompt\":\"{}\"}}", "a".repeat(500));
        let (mut bounds, mut scratch) = (Vec::new(), IdBuffers::for_blocks(16));
        for (body, want) in [(&ids, 900), (&text, 100)] {
            let p = parse(Endpoint::Completions, body.as_bytes(), &mut buf, limit).unwrap();
            assert_eq!((buf.len(), p.truncated), (want, want == 100), "{body:.40}");
            let f = parse_fast(
                Endpoint::Completions,
                body.as_bytes(),
                &mut buf,
                &mut bounds,
                &mut scratch,
                limit,
            );
            assert_eq!(
                (buf.len(), f.unwrap().truncated),
                (want, want == 100),
                "{body:.40}"
            );
        }
    }

    #[test]
    fn escapes_are_unescaped_into_canonical_bytes() {
        let (a, _, _) = canon(Endpoint::Completions, r#"{"prompt":"a\nb\u00e9"}"#).unwrap();
        assert_eq!(a, "a\nbé".as_bytes());
    }

    #[test]
    fn tools_and_template_inputs_are_part_of_the_prompt() {
        let msgs = r#""messages":[{"role":"user","content":"what is the weather"}]"#;
        let plain = canon(Endpoint::Chat, &format!("{{{msgs}}}")).unwrap().0;
        let tools = r#""tools":[{"type":"function","function":{"name":"get_weather"}}]"#;
        let a = canon(Endpoint::Chat, &format!("{{{tools},{msgs}}}"))
            .unwrap()
            .0;
        let b = canon(Endpoint::Chat, &format!("{{{msgs},{tools}}}"))
            .unwrap()
            .0;
        assert_ne!(a, plain, "tools change the rendered prompt");
        assert_eq!(a, b, "field order does not matter");
        assert!(
            a.starts_with(b"\x1ctools"),
            "tools render before the messages"
        );
        assert!(a.ends_with(&plain));
        for extra in [
            r#""tool_choice":"required""#,
            r#""chat_template_kwargs":{"enable_thinking":false}"#,
            r#""response_format":{"type":"json_object"}"#,
        ] {
            let x = canon(Endpoint::Chat, &format!("{{{msgs},{extra}}}"))
                .unwrap()
                .0;
            let y = canon(Endpoint::Chat, &format!("{{{extra},{msgs}}}"))
                .unwrap()
                .0;
            assert_ne!(x, plain, "{extra}");
            assert_eq!(x, y, "{extra}");
        }
        // The response format goes after the messages: the conversation's prefix survives it.
        let rf = canon(
            Endpoint::Chat,
            &format!(r#"{{"response_format":{{"type":"json_object"}},{msgs}}}"#),
        )
        .unwrap()
        .0;
        assert!(rf.starts_with(&plain));
        // Message boundaries move with a header inserted in front of them.
        let (mut c, mut bd) = (Vec::new(), Vec::new());
        let body = format!("{{{msgs},{tools}}}");
        parse_with_bounds(Endpoint::Chat, body.as_bytes(), &mut c, &mut bd, 1 << 20).unwrap();
        assert_eq!(bd, vec![c.len()]);
        // Under a tight limit the result does not depend on field order either.
        let (mut x, mut y) = (Vec::new(), Vec::new());
        let (bx, by) = (format!("{{{msgs},{tools}}}"), format!("{{{tools},{msgs}}}"));
        let tx = parse(Endpoint::Chat, bx.as_bytes(), &mut x, 40)
            .unwrap()
            .truncated;
        parse(Endpoint::Chat, by.as_bytes(), &mut y, 40).unwrap();
        assert!(tx && x == y && x.len() == 40);
        // Completions have no chat template: tools are ignored there.
        let c1 = canon(Endpoint::Completions, r#"{"prompt":"p","tools":[1]}"#)
            .unwrap()
            .0;
        assert_eq!(c1, b"p");
    }

    #[test]
    fn token_estimate_counts_text_and_media_parts_not_json() {
        let mut buf = Vec::new();
        let junk = "x".repeat(1 << 20);
        let body = format!(
            r#"{{"messages":[{{"role":"user","name":"{junk}","content":[{{"type":"text","text":"hello"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{junk}"}}}},{{"type":"input_audio","input_audio":{{"data":"{junk}"}}}},{{"junk":"{junk}"}}]}}]}}"#
        );
        let p = parse(Endpoint::Chat, body.as_bytes(), &mut buf, 1 << 16).unwrap();
        assert_eq!(p.text_bytes, "user".len() + "hello".len());
        assert_eq!(p.media_parts, 3);
        // Text past the hashing limit still counts (the engine prefills it); the router caps it.
        let body = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(5000));
        let p = parse(Endpoint::Completions, body.as_bytes(), &mut buf, 100).unwrap();
        assert_eq!((p.text_bytes, buf.len()), (5000, 100));
    }

    #[test]
    fn message_bounds_are_bounded() {
        let mut body = String::from(r#"{"messages":["#);
        for i in 0..100_000 {
            if i > 0 {
                body.push(',');
            }
            body.push_str(r#"{"role":"u","content":"m"}"#);
        }
        body.push_str("]}");
        let (mut c, mut bd) = (Vec::new(), Vec::new());
        parse_with_bounds(Endpoint::Chat, body.as_bytes(), &mut c, &mut bd, 1 << 20).unwrap();
        assert!(
            bd.len() <= MAX_BOUNDS && bd.capacity() <= 2 * MAX_BOUNDS,
            "{}",
            bd.len()
        );
        assert_eq!(bd[..2], [4, 8], "the first two boundaries are kept");
        assert_eq!(*bd.last().unwrap(), c.len(), "the deepest is kept");
        assert!(bd.windows(2).all(|w| w[0] < w[1]));
        // Empty messages past the limit add nothing.
        let body = format!(r#"{{"messages":[{}]}}"#, vec!["{}"; 100_000].join(","));
        parse_with_bounds(Endpoint::Chat, body.as_bytes(), &mut c, &mut bd, 1000).unwrap();
        assert!(bd.len() <= MAX_BOUNDS);
    }

    #[test]
    fn message_bounds_mark_previous_turns() {
        let t1 = r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"}]}"#;
        let t2 = r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let (mut ba, mut bb) = (Vec::new(), Vec::new());
        parse_with_bounds(Endpoint::Chat, t1.as_bytes(), &mut a, &mut ba, 1 << 20).unwrap();
        parse_with_bounds(Endpoint::Chat, t2.as_bytes(), &mut b, &mut bb, 1 << 20).unwrap();
        assert_eq!(ba.len(), 2);
        assert_eq!(bb.len(), 4);
        assert_eq!(*ba.last().unwrap(), a.len());
        assert!(bb.contains(&a.len()), "turn 1 ends at a turn-2 boundary");
        // Completions have no message bounds.
        parse_with_bounds(
            Endpoint::Completions,
            br#"{"prompt":"x"}"#,
            &mut a,
            &mut ba,
            99,
        )
        .unwrap();
        assert!(ba.is_empty());
    }

    /// A small deterministic generator for [`fast_path_equals_serde`].
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn pick<'x>(&mut self, xs: &[&'x str]) -> &'x str {
            xs[self.below(xs.len() as u64) as usize]
        }
    }

    /// One token id as JSON text: mostly canonical, sometimes what serde refuses for a `u32`.
    fn id_text(r: &mut Rng) -> String {
        match r.below(400) {
            0 => r
                .pick(&[
                    "-1", "-0", "01", "00", "1.0", "1e3", "1E3", "2.5e-1", "\"7\"", "true", "null",
                    "[]", "[1]", "{}", "+1", ".5", "1.", "0x10", "--1",
                ])
                .into(),
            1..=4 => r
                .pick(&[
                    "4294967295",
                    "4294967296",
                    "99999999999",
                    "18446744073709551616",
                    "0",
                    "12345678",
                    "123456789",
                    "1234567890",
                ])
                .into(),
            5..=80 => r.below(10).to_string(),
            81..=300 => r.below(260_000).to_string(),
            301..=340 => r.below(100_000_000).to_string(),
            _ => (r.next() as u32).to_string(),
        }
    }

    fn ws(r: &mut Rng) -> &'static str {
        match r.below(10) {
            0..=5 => "",
            6 | 7 => " ",
            _ => ["\t", "\n", "\r\n ", "  "][r.below(4) as usize],
        }
    }

    /// A flat id list, often with separators or elements serde refuses.
    fn id_list(r: &mut Rng) -> String {
        let n = match r.below(8) {
            0 => 0,
            1 => r.below(3),
            2 => 60 + r.below(140), // crosses the scanner's 64-id blocks
            _ => r.below(40),
        };
        // Mostly one clean separator throughout (`,` or `, `, what clients send: the chunk
        // step's 64-byte runs), else random whitespace around every comma.
        let style = r.below(3);
        let mut s = format!("[{}", ws(r));
        for i in 0..n {
            if i > 0 {
                if style == 0 {
                    s += ws(r);
                }
                s += if r.below(200) == 0 {
                    r.pick(&["", ",,", ";", " ", ",  ", ", ,", ",\t"])
                } else {
                    ","
                };
                match style {
                    0 => s += ws(r),
                    1 => s += " ",
                    _ => {}
                }
            }
            s += &id_text(r);
        }
        s += ws(r);
        if r.below(100) == 0 {
            s += ",";
        }
        s + "]"
    }

    /// A prompt value: mostly id lists (flat or batched), sometimes text or junk.
    fn prompt_value(r: &mut Rng) -> String {
        match r.below(12) {
            0 => format!("[{},{}{}]", id_list(r), ws(r), id_list(r)),
            1 => format!("[{}{}{}]", ws(r), id_list(r), ws(r)),
            2 => r
                .pick(&[
                    "\"hello\"",
                    "[\"a\",\"b\"]",
                    "[]",
                    "[[]]",
                    "[[],[1]]",
                    "null",
                    "3",
                    "[[1,2],\"x\"]",
                    "[[1,[2]]]",
                    "[1,[2]]",
                    "[\"a\",1]",
                ])
                .into(),
            _ => id_list(r),
        }
    }

    /// A whole body: the prompt among other fields in any order, some of them odd.
    fn body(r: &mut Rng, key: &str) -> String {
        let mut fields = vec![format!("\"{key}\":{}{}", ws(r), prompt_value(r))];
        let extra = [
            r#""model":"llama""#,
            r#""model":"ll\u0061ma""#,
            r#""model":null"#,
            r#""model":7"#,
            r#""lora_path":"ad""#,
            r#""cache_salt":"s\u0061lt""#,
            r#""cache_salt":3"#,
            r#""sampling_params":{"max_new_tokens":16,"temperature":0.7,"stop":["]",",","\"}"]}"#,
            r#""stream":true"#,
            r#""rid":"4294967295""#,
            r#""x":[4294967295]"#,
            r#""input_ids":[1,2]"#,
            r#""prompt":[3]"#,
            r#""text":"t""#,
            r#""text":[]"#,
            r#""input_ids":[]"#,
            r#""n":[[[[[[[[1]]]]]]]]"#,
        ];
        for _ in 0..r.below(4) {
            fields.push(r.pick(&extra).to_string());
        }
        let n = fields.len();
        fields.swap(0, r.below(n as u64) as usize);
        let sep = [",", ", ", " ,\n"][r.below(3) as usize];
        format!("{}{{{}{}}}{}", ws(r), fields.join(sep), ws(r), ws(r))
    }

    /// Byte-level damage: truncation, a changed byte, an inserted or a removed one.
    fn mutate(r: &mut Rng, b: &mut Vec<u8>) {
        if b.is_empty() {
            return;
        }
        let i = r.below(b.len() as u64) as usize;
        let junk = b"[]{},:\"\\ 0123456789-+.eE\x00\xff";
        let c = junk[r.below(junk.len() as u64) as usize];
        match r.below(4) {
            0 => b.truncate(i),
            1 => b[i] = c,
            2 => b.insert(i, c),
            _ => {
                b.remove(i);
            }
        }
    }

    /// The fast path (`parse_fast`) against serde alone (`parse_with_bounds`) on many thousands of
    /// valid and damaged token bodies: the same result field by field, the same canonical bytes,
    /// and an error exactly when serde errs, with the same message.
    #[test]
    fn fast_path_equals_serde() {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut fast_hits, mut oks, mut errs) = (0, 0, 0);
        let mut scratch = IdBuffers::for_blocks(3);
        let (mut ca, mut cb, mut ba, mut bb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut ha, mut hb, mut ended) = (Vec::new(), Vec::new(), 0);
        for case in 0..60_000 {
            let (ep, key) = match r.below(4) {
                0 => (Endpoint::Generate, "input_ids"),
                1 => (Endpoint::Generate, "text"),
                2 => (Endpoint::Completions, "prompt"),
                _ => (Endpoint::Generate, "prompt"),
            };
            let mut b = body(&mut r, key).into_bytes();
            if r.below(4) == 0 {
                for _ in 0..1 + r.below(2) {
                    mutate(&mut r, &mut b);
                }
            }
            let limit = [1 << 20, 64, 7, 1000, 0][r.below(5) as usize];
            let want = parse_with_bounds(ep, &b, &mut ca, &mut ba, limit);
            let got = parse_fast(ep, &b, &mut cb, &mut bb, &mut scratch, limit);
            let ctx = || {
                format!(
                    "case {case} {ep:?} limit {limit}: {}",
                    String::from_utf8_lossy(&b)
                )
            };
            match (&want, &got) {
                (Ok(w), Ok(g)) => {
                    assert_same_parsed(w, g, &ctx());
                    assert_eq!(ca, cb, "{}", ctx());
                    assert_eq!(ba, bb, "{}", ctx());
                    // The block ends the scan recorded give the hasher's own blocks.
                    if let Some(ends) = scratch.block_ends(3) {
                        let cut = crate::blocks::hash_token_blocks(1, &ca, 3, 50, &mut ha);
                        let at = crate::blocks::hash_blocks_at(
                            1,
                            &cb,
                            ends.iter().copied(),
                            50,
                            &mut hb,
                        );
                        assert_eq!((ha.as_slice(), cut), (hb.as_slice(), at), "{}", ctx());
                        ended += 1;
                    }
                    oks += 1;
                }
                (Err(w), Err(g)) => {
                    assert_eq!(w, g, "{}", ctx());
                    errs += 1;
                }
                _ => panic!("{}: serde {want:?}, fast {got:?}", ctx()),
            }
            let (mut c, mut bd) = (Vec::new(), Vec::new());
            fast_hits += usize::from(
                fast::fast(ep, &b, &mut c, &mut bd, &mut scratch, limit.into()).is_some(),
            );
        }
        // The comparison means something only if both paths and both outcomes are common.
        assert!(
            fast_hits > 10_000 && oks > 25_000 && errs > 10_000 && ended > 10_000,
            "{fast_hits} {oks} {errs} {ended}"
        );
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        fn message() -> impl Strategy<Value = serde_json::Value> {
            // Any printable text (unicode included), up to 40 chars.
            let text = "\\PC{0,40}";
            prop_oneof![
                (text, text).prop_map(|(r, c)| serde_json::json!({"role": r, "content": c})),
                (text, proptest::collection::vec(text, 0..4)).prop_map(|(r, parts)| {
                    let parts: Vec<_> = parts
                        .into_iter()
                        .map(|t| serde_json::json!({"type": "text", "text": t}))
                        .collect();
                    serde_json::json!({"role": r, "content": parts})
                }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
                let mut buf = Vec::new();
                let (mut bounds, mut scratch) = (Vec::new(), IdBuffers::default());
                for ep in [Endpoint::Chat, Endpoint::Completions, Endpoint::Generate] {
                    let _ = parse(ep, &body, &mut buf, 4096);
                    prop_assert!(buf.len() <= 4096);
                    let _ = parse_fast(ep, &body, &mut buf, &mut bounds, &mut scratch, 4096);
                    prop_assert!(buf.len() <= 4096);
                }
            }

            #[test]
            fn conversation_turns_are_prefixes(msgs in proptest::collection::vec(message(), 1..8), k in 0usize..8) {
                let k = k.min(msgs.len());
                let short = serde_json::json!({"model": "m", "messages": &msgs[..k]}).to_string();
                let long = serde_json::json!({"messages": &msgs, "model": "m", "stream": true}).to_string();
                let (mut a, mut b) = (Vec::new(), Vec::new());
                parse(Endpoint::Chat, short.as_bytes(), &mut a, 1 << 20).unwrap();
                parse(Endpoint::Chat, long.as_bytes(), &mut b, 1 << 20).unwrap();
                prop_assert!(b.starts_with(&a));
            }

            #[test]
            fn token_prompts_roundtrip(ids in proptest::collection::vec(any::<u32>(), 1..300)) {
                let body = serde_json::json!({"input_ids": &ids}).to_string();
                let mut buf = Vec::new();
                let p = parse(Endpoint::Generate, body.as_bytes(), &mut buf, 1 << 20).unwrap();
                prop_assert_eq!(p.kind, PromptKind::Tokens);
                prop_assert_eq!(p.tokens, ids.len());
                prop_assert_eq!(&buf, &super::tokens(&ids));
                let (mut fast, mut bounds, mut scratch) = (Vec::new(), Vec::new(), IdBuffers::default());
                let f = parse_fast(Endpoint::Generate, body.as_bytes(), &mut fast, &mut bounds, &mut scratch, 1 << 20).unwrap();
                prop_assert_eq!((f.kind, f.tokens), (PromptKind::Tokens, ids.len()));
                prop_assert_eq!(fast, buf);
            }
        }
    }
}
