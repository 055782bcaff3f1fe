//! The token-id fast path of request parsing: [`parse_fast`] scans a token prompt's id array
//! with `ids.rs` and lets serde parse the rest of the body, with the same result as
//! [`super::parse_with_bounds`] for every body. The serde pass and its sink live in the parent.

use super::{parse_with_bounds, run, Endpoint, Limit, ParseError, Parsed, Splice};
use crate::ids;
use std::borrow::Cow;

/// Reusable buffers of [`parse_fast`] (grown to the largest request seen, never shrunk): the
/// scanned ids, where their blocks end, and the body with the id array replaced by
/// [`PLACEHOLDER`].
#[derive(Debug, Default)]
pub struct IdBuffers {
    ids: Vec<u8>,
    body: Vec<u8>,
    /// Ids per block whose ends the scan records (0: none); see [`IdBuffers::block_ends`].
    block: usize,
    ends: Vec<usize>,
    /// Whether `ends` belong to the last [`parse_fast`] result.
    ends_valid: bool,
}

impl IdBuffers {
    /// Buffers whose scans also record where blocks of `block` ids end (0: never).
    pub fn for_blocks(block: usize) -> IdBuffers {
        IdBuffers {
            block,
            ..IdBuffers::default()
        }
    }

    /// Where the canonical token prompt of the last [`parse_fast`] call ends its blocks of
    /// `block` ids (offsets into its canonical bytes, possibly past a truncated end): `Some`
    /// only when the scan read the prompt and recorded ends for that block size. Saves the
    /// hasher its own search for every `block`-th comma (`blocks::hash_token_blocks`).
    pub fn block_ends(&self, block: usize) -> Option<&[usize]> {
        (self.ends_valid && block == self.block && block > 0).then_some(&self.ends)
    }
}

/// The scanned array's stand-in in the serde pass (`super::MARKER`) as digits and as a JSON array.
const MARKER_DIGITS: &[u8] = b"4294967295";
const PLACEHOLDER: &[u8] = b"[4294967295]";

/// [`parse_with_bounds`] with the text and token-id fast paths: same result for every body (same
/// canonical bytes, counts and model, an error exactly when serde errs, with serde's own
/// message), faster for plain chat / completions text bodies (`request/text.rs`) and for
/// `input_ids` / integer `prompt` bodies.
///
/// How: [`ids::locate`] finds the prompt's flat id array (the value of the first prompt key, or
/// that value's first element for a batch) and [`ids::scan`] reads it into `scratch.ids`. Serde
/// then parses a copy of the body in which that array is replaced by `[4294967295]`, a marker
/// that occurs nowhere else in the copy (checked), and the sink writes the scanned ids where it
/// meets the marker. So serde still judges every byte outside the array, and inside it the
/// scanner accepts only what serde reads as a `u32` list. The result is kept only when serde
/// accepted the copy *and* met the marker as a token id: the marker's array is then the
/// prompt (or its first element) in both bodies, parsed in the same state, so both parses make
/// the same sink calls. Anything else (no array found, the scanner refused, the copy failed, the
/// marker ended up elsewhere) parses the original body with serde alone.
///
/// Costs: the scan (a check and a copy per 64-byte chunk with Wasm SIMD, `id_chunks.rs`,
/// instead of ~500 Wasm instructions per id through serde), then serde over the body minus
/// the array; one copy of the body minus the array; no allocation once `scratch` has grown.
pub fn parse_fast<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    canon: &mut Vec<u8>,
    bounds: &mut Vec<usize>,
    scratch: &mut IdBuffers,
    limit: impl Into<Limit>,
) -> Result<Parsed<'a>, ParseError> {
    let limit = limit.into();
    scratch.ends_valid = false;
    if let Some(p) = super::text::parse_text(endpoint, body, canon, bounds, limit) {
        return Ok(p);
    }
    if let Some(p) = fast(endpoint, body, canon, bounds, scratch, limit) {
        return Ok(p);
    }
    parse_with_bounds(endpoint, body, canon, bounds, limit)
}

pub(super) fn fast<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    canon: &mut Vec<u8>,
    bounds: &mut Vec<usize>,
    scratch: &mut IdBuffers,
    limit: Limit,
) -> Option<Parsed<'a>> {
    let keys: &[&[u8]] = match endpoint {
        Endpoint::Generate => &[b"input_ids", b"text"],
        Endpoint::Completions => &[b"prompt"],
        Endpoint::Chat => return None,
    };
    scratch.ends_valid = false;
    let at = ids::locate(body, keys)?;
    scratch.ids.clear();
    let scanned = ids::scan(
        body,
        at,
        &mut scratch.ids,
        limit.tokens,
        scratch.block,
        &mut scratch.ends,
    )?;
    let (head, tail) = (body.get(..at)?, body.get(scanned.end..)?);
    let has_marker = |s: &[u8]| s.windows(MARKER_DIGITS.len()).any(|w| w == MARKER_DIGITS);
    if has_marker(head) || has_marker(tail) {
        return None;
    }
    scratch.body.clear();
    scratch.body.extend_from_slice(head);
    scratch.body.extend_from_slice(PLACEHOLDER);
    scratch.body.extend_from_slice(tail);
    let splice = Splice {
        bytes: &scratch.ids,
        count: scanned.count,
        cut: scanned.cut,
    };
    let (p, spliced_at) = run(endpoint, &scratch.body, canon, bounds, limit, Some(splice)).ok()?;
    // The scanned ends count from the splice: valid as canonical offsets when it opens `canon`
    // (a token prompt is the only prompt field, so it always does).
    scratch.ends_valid = spliced_at? == 0;
    // `model` / `lora` borrow from the copy: point them at the same bytes of `body`.
    let from = &scratch.body;
    Some(Parsed {
        model: rebase(p.model, from, body, at, scanned.end)?,
        lora: rebase(p.lora, from, body, at, scanned.end)?,
        cache_salt: rebase(p.cache_salt, from, body, at, scanned.end)?,
        kind: p.kind,
        tokens: p.tokens,
        text_bytes: p.text_bytes,
        media_parts: p.media_parts,
        truncated: p.truncated,
    })
}

/// A string borrowed from the copy `from` (`body` with `body[at..end]` replaced by
/// [`PLACEHOLDER`]) as the same bytes borrowed from `body`. `None` if it is not in the copy or
/// overlaps the placeholder (it cannot: strings never contain the placeholder's `[`).
fn rebase<'a>(
    v: Option<Cow<'_, str>>,
    from: &[u8],
    body: &'a [u8],
    at: usize,
    end: usize,
) -> Option<Option<Cow<'a, str>>> {
    let s = match v {
        None => return Some(None),
        Some(Cow::Owned(s)) => return Some(Some(Cow::Owned(s))),
        Some(Cow::Borrowed(s)) => s,
    };
    let off = (s.as_ptr() as usize).checked_sub(from.as_ptr() as usize)?;
    let off = if off + s.len() <= at {
        off
    } else if off >= at + PLACEHOLDER.len() {
        off - at - PLACEHOLDER.len() + end
    } else {
        return None;
    };
    let bytes = body.get(off..off.checked_add(s.len())?)?;
    std::str::from_utf8(bytes)
        .ok()
        .map(|t| Some(Cow::Borrowed(t)))
}
