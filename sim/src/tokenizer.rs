//! The simulator's deterministic tokenizer (deliberately unrelated to the router's hashing).
//!
//! * Text is cut into 4-byte chunks of its UTF-8 bytes; token id = the chunk read as a
//!   little-endian `u32` (a short last chunk is zero-padded). This is lossless (different texts
//!   give different token sequences) and gives exactly 4 bytes per token, the usual rule of thumb
//!   for English BPE tokenizers.
//! * Special tokens use Llama-3's ids (`<|begin_of_text|>` = 128000, headers, `<|eot_id|>` =
//!   128009). Their byte patterns (`00 F4 01 00` ...) are not valid UTF-8, so they never collide
//!   with a text chunk.
//! * Chat prompts use a Llama-3-style template: `BOS`, then per message
//!   `START_HEADER role END_HEADER content EOT`, then `START_HEADER assistant END_HEADER`. Each
//!   text segment (role, content) is chunked on its own, as special tokens split real tokenizers'
//!   input. Content-part arrays contribute their `text` parts concatenated in order.
//! * Generated tokens are 4-byte words (" the", " and", ...), so an assistant answer sent back
//!   in the next turn of a conversation tokenizes to exactly the tokens that were generated (as
//!   with a real tokenizer), and multi-turn chats hit the cache through the previous answer.

/// `<|begin_of_text|>`.
pub const BOS: u32 = 128_000;
/// `<|start_header_id|>`.
pub const START_HEADER: u32 = 128_006;
/// `<|end_header_id|>`.
pub const END_HEADER: u32 = 128_007;
/// `<|eot_id|>`, also the EOS token reported as `matched_stop`.
pub const EOT: u32 = 128_009;

/// Appends the 4-byte-chunk tokens of `text`.
pub fn push_text(text: &str, out: &mut Vec<u32>) {
    let b = text.as_bytes();
    out.reserve(b.len().div_ceil(4));
    let mut chunks = b.chunks_exact(4);
    for c in &mut chunks {
        out.push(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    }
    let r = chunks.remainder();
    if !r.is_empty() {
        let mut w = [0u8; 4];
        w[..r.len()].copy_from_slice(r);
        out.push(u32::from_le_bytes(w));
    }
}

/// Tokens of a plain text prompt (`/v1/completions`, `/generate`): BOS + chunks.
pub fn text_prompt(text: &str) -> Vec<u32> {
    let mut v = vec![BOS];
    push_text(text, &mut v);
    v
}

/// Tokens of a chat conversation: `(role, content)` pairs.
pub fn chat_prompt<'a, I: IntoIterator<Item = (&'a str, &'a str)>>(messages: I) -> Vec<u32> {
    let mut v = vec![BOS];
    for (role, content) in messages {
        v.push(START_HEADER);
        push_text(role, &mut v);
        v.push(END_HEADER);
        push_text(content, &mut v);
        v.push(EOT);
    }
    v.push(START_HEADER);
    push_text("assistant", &mut v);
    v.push(END_HEADER);
    v
}

/// Output vocabulary: 16 four-byte words (one token each).
pub const WORDS: [&str; 16] = [
    " the", " and", " for", " you", " are", " not", " but", " can", " was", " all", " one", " has",
    " new", " may", " now", " use",
];

/// Token id of output word `i`.
pub fn word_token(i: usize) -> u32 {
    let b = WORDS[i % WORDS.len()].as_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Text of an output token (EOS and unknown ids decode to "").
pub fn decode_token(t: u32) -> &'static str {
    WORDS
        .iter()
        .find(|w| {
            let b = w.as_bytes();
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) == t
        })
        .copied()
        .unwrap_or("")
}

/// splitmix64 step.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Deterministic hash of a token sequence.
pub fn hash_tokens(tokens: &[u32]) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64 ^ tokens.len() as u64;
    for &t in tokens {
        h = mix(h ^ t as u64);
    }
    h
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// EOS sampled (`matched_stop` = [`EOT`]).
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// The deterministic "greedy" continuation of `prompt`.
///
/// The model's natural answer length is `8 + h % 248` tokens (EOS included), `h` a hash of the
/// prompt. Without `ignore_eos` generation stops there when it is within `max_new`
/// (finish_reason `stop`); otherwise exactly `max_new` word tokens are produced (`length`).
pub fn plan_output(prompt: &[u32], max_new: usize, ignore_eos: bool) -> (Vec<u32>, Finish) {
    let h = hash_tokens(prompt);
    let natural = 8 + (h % 248) as usize;
    let stop = !ignore_eos && natural <= max_new;
    let n = if stop { natural } else { max_new };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if stop && i + 1 == n {
            out.push(EOT);
        } else {
            out.push(word_token(
                (mix(h ^ i as u64) % WORDS.len() as u64) as usize,
            ));
        }
    }
    (out, if stop { Finish::Stop } else { Finish::Length })
}

/// Text of output tokens.
pub fn detokenize(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 4);
    for &t in tokens {
        s.push_str(decode_token(t));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_byte_chunks() {
        let mut v = Vec::new();
        push_text("abcdefghij", &mut v);
        assert_eq!(v.len(), 3);
        assert_eq!(v[0], u32::from_le_bytes(*b"abcd"));
        assert_eq!(v[2], u32::from_le_bytes([b'i', b'j', 0, 0]));
        // prefixes share tokens
        let mut w = Vec::new();
        push_text("abcdefgh and more", &mut w);
        assert_eq!(&w[..2], &v[..2]);
    }

    #[test]
    fn chat_template_and_answer_roundtrip() {
        let p1 = chat_prompt([("system", "You are helpful."), ("user", "Hi")]);
        let (out, _) = plan_output(&p1, 20, true);
        let answer = detokenize(&out);
        assert_eq!(answer.len(), 80);
        let p2 = chat_prompt([
            ("system", "You are helpful."),
            ("user", "Hi"),
            ("assistant", answer.as_str()),
            ("user", "more"),
        ]);
        // the second turn starts with turn one's prompt and its generated tokens
        assert_eq!(&p2[..p1.len()], &p1[..]);
        assert_eq!(&p2[p1.len()..p1.len() + out.len()], &out[..]);
    }

    #[test]
    fn plan_is_deterministic_and_bounded() {
        let p = text_prompt("hello world");
        let (a, fa) = plan_output(&p, 1000, false);
        let (b, fb) = plan_output(&p, 1000, false);
        assert_eq!(a, b);
        assert_eq!(fa, Finish::Stop);
        assert_eq!(fb, Finish::Stop);
        assert_eq!(*a.last().unwrap(), EOT);
        assert!(a.len() >= 8 && a.len() < 256);
        let (c, fc) = plan_output(&p, 5, false);
        assert_eq!((c.len(), fc), (5, Finish::Length));
        let (d, fd) = plan_output(&p, 300, true);
        assert_eq!((d.len(), fd), (300, Finish::Length));
        assert!(!d.contains(&EOT));
        assert_eq!(plan_output(&p, 0, true).0.len(), 0);
    }
}
