//! Chained xxh3-64 block hashing and the checkpoint schedule.
//!
//! A prompt's canonical bytes (see `request.rs`) are cut into fixed-size blocks; block `i`'s hash
//! is `xxh3_64_with_seed(block_i, hash_{i-1})` and block 0 is seeded by the model (and LoRA
//! adapter), so a hash names the *whole prefix* ending at that block, and two models never share
//! an entry. The final partial block is hashed too: it can never collide with the full block a
//! longer prompt has at that position (different bytes), so it does not break the prefix property
//! and it lets short prompts be indexed.
//!
//! Token-id prompts reach this module in their canonical text form (`ids.rs`: each id's
//! decimal digits followed by `,`), and a block is exactly `k` ids: it ends after every `k`-th
//! comma ([`hash_token_blocks`]). So the same ids make the same blocks whatever the JSON
//! spacing, and a block covers whole tokens as the engine's cache does.

use crate::xxh3::xxh3_64_with_seed;
use xxhash_rust::xxh3::xxh3_64;

/// Seed domain separator so our chains never equal a plain xxh3 of the same bytes.
const CHAIN_DOMAIN: u64 = 0x7072_6566_6978_7274; // "prefixrt"

/// Domain separator of the tenant's part of the seed.
const TENANT_DOMAIN: u64 = 0x7465_6e61_6e74_2121; // "tenant!!"
/// Separates a request's `cache_salt` from every other seed input.
const SALT_DOMAIN: u64 = 0x6361_6368_6573_616c; // "cachesal"

/// Seed of block 0 for `model` (and optional LoRA adapter), unkeyed and tenant-less.
pub fn chain_seed(model: &[u8], lora: Option<&[u8]>) -> u64 {
    keyed_seed(0, model, lora, b"")
}

/// Seed of block 0 under the secret `key` (config `hash_key`, see [`crate::config`]) for
/// `model`, its LoRA adapter and the request's `tenant`. Every block hash chains from it, and a
/// block hash also picks the index bucket, so without the key a client cannot compute where its
/// prompts land (grinding prompts to evict a victim's entries needs it), and two tenants never
/// share a hash, an index entry or a rendezvous key. An empty tenant is the shared space.
pub fn keyed_seed(key: u64, model: &[u8], lora: Option<&[u8]>, tenant: &[u8]) -> u64 {
    let m = xxh3_64_with_seed(model, CHAIN_DOMAIN ^ key);
    let m = match lora {
        Some(l) if !l.is_empty() => xxh3_64_with_seed(l, m),
        _ => m,
    };
    if tenant.is_empty() {
        m
    } else {
        xxh3_64_with_seed(tenant, m ^ TENANT_DOMAIN)
    }
}

/// Block 0's seed for a request carrying `cache_salt` (vLLM's OpenAI request field: prompts
/// with different salts never share KV): `seed` chained with the salt, so prompts with different
/// salts share no block hash, index entry or rendezvous key. No salt (or an empty one): `seed`
/// unchanged, so requests without a salt hash exactly as before and pay nothing.
pub fn salted_seed(seed: u64, salt: Option<&[u8]>) -> u64 {
    match salt {
        Some(s) if !s.is_empty() => xxh3_64_with_seed(s, seed ^ SALT_DOMAIN),
        _ => seed,
    }
}

/// Hashes `data` in blocks of `block_bytes` into `out` (cleared first), at most `max_blocks`.
/// Returns `true` when the prompt was longer than `max_blocks` blocks and was truncated.
pub fn hash_blocks(
    seed: u64,
    data: &[u8],
    block_bytes: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
) -> bool {
    out.clear();
    hash_blocks_from(seed, data, block_bytes, max_blocks, out)
}

/// [`hash_blocks`] with the hashes of `data`'s first `out.len()` blocks already in `out` (the
/// caller knows them: `block_memo.rs`): hashes the blocks after them, chaining from the last.
pub fn hash_blocks_from(
    seed: u64,
    data: &[u8],
    block_bytes: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
) -> bool {
    if block_bytes == 0 {
        out.clear();
        return false;
    }
    let done = out.len();
    let mut prev = out.last().copied().unwrap_or(seed);
    let rest = data
        .get(done.saturating_mul(block_bytes)..)
        .unwrap_or_default();
    for chunk in rest
        .chunks(block_bytes)
        .take(max_blocks.saturating_sub(done))
    {
        prev = xxh3_64_with_seed(chunk, prev);
        out.push(prev);
    }
    data.len().div_ceil(block_bytes) > max_blocks
}

/// Hashes canonical token ids (`ids.rs`: digits, each id ended by `,`) in blocks of `ids` ids
/// into `out` (cleared first), at most `max_blocks`, like [`hash_blocks`]: chained, the final
/// partial block hashed too. Returns `true` when the prompt was longer than `max_blocks` blocks.
///
/// Cost: the commas are found 64 bytes at a time ([`commas64`]); a block's last comma is then
/// picked out of that mask.
pub fn hash_token_blocks(
    seed: u64,
    data: &[u8],
    ids: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
) -> bool {
    if ids == 0 {
        out.clear();
        return false;
    }
    let ends = BlockEnds { data, ids, at: 0 };
    hash_blocks_at(seed, data, ends, max_blocks, out)
}

/// [`hash_token_blocks`] with the block ends already known (`ends`: increasing offsets into
/// `data`, as the id scanner records them; those past `data`, cut at the limit, are ignored):
/// the same hashes, without the search.
pub fn hash_blocks_at(
    seed: u64,
    data: &[u8],
    ends: impl IntoIterator<Item = usize>,
    max_blocks: usize,
    out: &mut Vec<u64>,
) -> bool {
    out.clear();
    let (mut prev, mut start) = (seed, 0usize);
    for end in ends {
        if end > data.len() || end <= start {
            break;
        }
        if out.len() >= max_blocks {
            return true;
        }
        prev = xxh3_64_with_seed(data.get(start..end).unwrap_or_default(), prev);
        out.push(prev);
        start = end;
    }
    if start < data.len() {
        if out.len() >= max_blocks {
            return true;
        }
        out.push(xxh3_64_with_seed(
            data.get(start..).unwrap_or_default(),
            prev,
        ));
    }
    false
}

/// Where blocks of `ids` canonical ids end: just past every `ids`-th comma of `data` from `at`.
struct BlockEnds<'d> {
    data: &'d [u8],
    ids: usize,
    at: usize,
}

impl Iterator for BlockEnds<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let mut need = self.ids; // commas still to pass, the last one ending the block
        loop {
            let Some(mut m) = commas64(self.data, self.at) else {
                // The last bytes: one at a time.
                let (k, _) = self
                    .data
                    .get(self.at..)?
                    .iter()
                    .enumerate()
                    .filter(|&(_, &c)| c == b',')
                    .nth(need.checked_sub(1)?)?;
                self.at += k + 1;
                return Some(self.at);
            };
            let n = m.count_ones() as usize;
            if n < need {
                need -= n;
                self.at += 64;
                continue;
            }
            for _ in 1..need {
                m &= m - 1;
            }
            self.at += m.trailing_zeros() as usize + 1;
            return Some(self.at);
        }
    }
}

/// The commas of canonical id bytes `data[i..i + 64]` as a mask (bit `j` for byte `i + j`);
/// `None` when fewer than 64 bytes are left. In canonical bytes a comma (0x2C) is the only byte
/// with bit 4 clear (the digits are 0x30-0x39).
#[inline(always)]
fn commas64(data: &[u8], i: usize) -> Option<u64> {
    let c = data.get(i..)?.first_chunk::<64>()?;
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        use core::arch::wasm32::*;
        let mut digits = 0u64;
        for k in 0..4 {
            // SAFETY: `k < 4`, so `c[16k..16k + 16]` is readable; no alignment is required.
            let v = unsafe { v128_load(c.as_ptr().add(16 * k).cast()) };
            digits |= u64::from(u8x16_bitmask(u8x16_shl(v, 3))) << (16 * k);
        }
        Some(!digits)
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        let (words, _) = c.as_chunks::<8>();
        let mut m = 0u64;
        for (j, w) in words.iter().enumerate() {
            // Bit 0 of each byte: a comma; gathered into the top byte by one multiply.
            let x = (!u64::from_le_bytes(*w) >> 4) & 0x0101_0101_0101_0101;
            m |= (x.wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * j);
        }
        Some(m)
    }
}

/// A 64-bit digest of arbitrary bytes (used for the round-robin-free hashes of short keys).
pub fn digest(data: &[u8]) -> u64 {
    xxh3_64(data)
}

/// Block counts at which the index records a prompt: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ...
/// (every count up to 4, then two per doubling: `2^k` and `3·2^(k-1)`).
///
/// Why checkpoints instead of every block: a write costs two host calls under Envoy's global
/// shared-data lock, so indexing all 256 blocks of a 4k-token prompt would cost ~500 host calls.
/// With checkpoints a prompt of `n` blocks is recorded at `≤ 2·log2(n) + 2` positions.
/// Consecutive checkpoints differ by at most 1.5×, so while every checkpoint of a path is in the
/// index a matched prefix is under-estimated by at most a factor 3/2; a checkpoint lost to
/// eviction shortens the match further until the next record repairs it (see `index.rs`).
/// `nth_checkpoint(j)` is the (j+1)-th count.
pub fn nth_checkpoint(j: usize) -> usize {
    if j < 4 {
        return j + 1;
    }
    // j = 4 -> 6, 5 -> 8, 6 -> 12, 7 -> 16, ...
    let k = (j - 4) / 2 + 2; // 2^k is the lower power
    if k >= usize::BITS as usize - 2 {
        return usize::MAX;
    }
    if (j - 4).is_multiple_of(2) {
        3usize << (k - 1)
    } else {
        1usize << (k + 1)
    }
}

/// Number of checkpoints `<= n` blocks.
pub fn checkpoints_upto(n: usize) -> usize {
    let mut j = 0;
    while nth_checkpoint(j) <= n {
        j += 1;
    }
    j
}

/// Sub-checkpoints strictly between checkpoint `j` and the next one: the gap cut in quarters
/// (`a + s`, `a + 2s`, `a + 3s` for `a = nth_checkpoint(j)`, `s = gap / 4`; a gap of 2 or 3 blocks
/// has the one or two counts between), ascending, at most [`SUB_CHECKPOINTS`].
///
/// Why: a prompt's deepest checkpoint under-states what a worker holds by up to a third (a
/// worker that was sent 121 blocks of a 123-block follow-up matches at 96), and the cost then
/// prices that holder as holding less than it does. A prompt is also recorded at the
/// sub-checkpoints of its *top* gap (between its last checkpoint and its end: where a
/// conversation's next turn will look for it), so a follow-up matches within an eighth of its
/// previous prompt's end, for at most 3 more writes per prompt and 2 more probes per lookup.
pub fn sub_checkpoints(j: usize) -> impl Iterator<Item = usize> + Clone {
    let a = nth_checkpoint(j);
    let b = nth_checkpoint(j.saturating_add(1));
    let step = (b.saturating_sub(a) / 4).max(1);
    (1..=SUB_CHECKPOINTS)
        .map(move |i| a.saturating_add(i * step))
        .filter(move |&x| x < b)
}

/// Most sub-checkpoints in one gap.
pub const SUB_CHECKPOINTS: usize = 3;

/// True when a prompt of `n` blocks has a checkpoint at `n`.
pub fn is_checkpoint(n: usize) -> bool {
    n > 0 && nth_checkpoint(checkpoints_upto(n) - 1) == n
}

/// The sub-checkpoints an `n`-block prompt is recorded at: those of its top gap (above its last
/// checkpoint) that lie within it, ascending.
pub fn top_sub_checkpoints(n: usize) -> impl Iterator<Item = usize> + Clone {
    checkpoints_upto(n)
        .checked_sub(1)
        .into_iter()
        .flat_map(sub_checkpoints)
        .take_while(move |&x| x <= n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_salt_moves_the_seed_and_no_salt_keeps_it() {
        let seed = keyed_seed(0, b"m", None, b"");
        assert_eq!(salted_seed(seed, None), seed);
        assert_eq!(salted_seed(seed, Some(b"")), seed);
        let (a, b) = (salted_seed(seed, Some(b"a")), salted_seed(seed, Some(b"b")));
        assert!(a != seed && b != seed && a != b);
        // A salt is not a tenant: the same bytes in the other role give another seed.
        assert_ne!(a, keyed_seed(0, b"m", None, b"a"));
    }

    #[test]
    fn schedule_is_dense_then_geometric() {
        let s: Vec<usize> = (0..14).map(nth_checkpoint).collect();
        assert_eq!(s, vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]);
        assert_eq!(checkpoints_upto(0), 0);
        assert_eq!(checkpoints_upto(1), 1);
        assert_eq!(checkpoints_upto(5), 4);
        assert_eq!(checkpoints_upto(128), 14);
        // Ratio bound that the docs promise.
        for j in 0..60 {
            let (a, b) = (nth_checkpoint(j), nth_checkpoint(j + 1));
            assert!(b > a && (b as f64) / (a as f64) <= 2.0 && (j < 3 || 2 * b <= 3 * a));
        }
        // 2·log2(n)+2 bound.
        for n in [1usize, 10, 256, 4096, 1 << 20] {
            assert!(checkpoints_upto(n) as f64 <= 2.0 * (n as f64).log2() + 2.0);
        }
    }

    #[test]
    fn sub_checkpoints_quarter_each_gap() {
        let subs = |j: usize| sub_checkpoints(j).collect::<Vec<_>>();
        assert_eq!(subs(0), Vec::<usize>::new(), "1 to 2: nothing between");
        assert_eq!(subs(3), vec![5], "4 to 6");
        assert_eq!(subs(5), vec![9, 10, 11], "8 to 12");
        assert_eq!(subs(12), vec![104, 112, 120], "96 to 128");
        let top = |n: usize| top_sub_checkpoints(n).collect::<Vec<_>>();
        assert_eq!(top(0), Vec::<usize>::new());
        assert_eq!(
            (top(96), top(111), top(127)),
            (vec![], vec![104], vec![104, 112, 120])
        );
        assert!(is_checkpoint(96) && !is_checkpoint(0) && !is_checkpoint(104));
        for j in 0..60 {
            let (a, b) = (nth_checkpoint(j), nth_checkpoint(j + 1));
            let s = subs(j);
            assert!(s.len() <= SUB_CHECKPOINTS && s.iter().all(|&x| a < x && x < b));
            assert!(s.windows(2).all(|w| w[0] < w[1]));
            // The points cut the gap to at most a quarter of it (at least one block).
            let mut prev = a;
            for &x in s.iter().chain(std::iter::once(&b)) {
                assert!(x - prev <= ((b - a) / 4).max(1) + (b - a) % 4, "{j}: {s:?}");
                prev = x;
            }
        }
    }

    #[test]
    fn longer_prompt_extends_shorter_chain() {
        let seed = chain_seed(b"m", None);
        let short = b"The quick brown fox jumps over the lazy dog. ".repeat(5);
        let mut long = short.clone();
        long.extend_from_slice(b"And then some more text follows here.");
        let (mut a, mut b) = (Vec::new(), Vec::new());
        hash_blocks(seed, &short, 16, 1000, &mut a);
        hash_blocks(seed, &long, 16, 1000, &mut b);
        let full = short.len() / 16;
        assert_eq!(a[..full], b[..full]);
        // The partial last block of the short prompt differs from the full one in the long one.
        assert_ne!(a[full], b[full]);
    }

    #[test]
    fn models_and_adapters_never_share_chains() {
        let data = b"same prompt bytes";
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        hash_blocks(chain_seed(b"m1", None), data, 4, 100, &mut a);
        hash_blocks(chain_seed(b"m2", None), data, 4, 100, &mut b);
        hash_blocks(chain_seed(b"m1", Some(b"lora")), data, 4, 100, &mut c);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
        assert_eq!(chain_seed(b"m1", Some(b"")), chain_seed(b"m1", None));
    }

    #[test]
    fn keys_and_tenants_separate_every_hash() {
        let data = b"a prompt an attacker would like to collide with";
        let mut base = Vec::new();
        hash_blocks(keyed_seed(0, b"m", None, b""), data, 8, 100, &mut base);
        for (key, tenant) in [(1u64, &b""[..]), (0, b"t1"), (1, b"t1"), (1, b"t2")] {
            let mut h = Vec::new();
            hash_blocks(keyed_seed(key, b"m", None, tenant), data, 8, 100, &mut h);
            assert!(h.iter().zip(&base).all(|(x, y)| x != y), "{key} {tenant:?}");
        }
        assert_eq!(keyed_seed(0, b"m", None, b""), chain_seed(b"m", None));
    }

    /// Canonical ids `0,1,2,...` of `n` ids.
    fn canon(n: u32) -> Vec<u8> {
        (0..n)
            .flat_map(|i| format!("{},", i * 7919).into_bytes())
            .collect()
    }

    #[test]
    fn token_blocks_end_after_every_kth_id() {
        let seed = chain_seed(b"m", None);
        for n in [0u32, 1, 15, 16, 17, 31, 32, 33, 100, 1000] {
            for k in [1usize, 3, 16, 64] {
                let data = canon(n);
                let mut got = Vec::new();
                let cut = hash_token_blocks(seed, &data, k, 10_000, &mut got);
                // Model: split after every k-th comma, hash the chain.
                let (mut want, mut prev, mut start, mut seen) = (Vec::new(), seed, 0, 0);
                for (i, &c) in data.iter().enumerate() {
                    if c == b',' {
                        seen += 1;
                        if seen % k == 0 {
                            prev = xxh3_64_with_seed(&data[start..=i], prev);
                            want.push(prev);
                            start = i + 1;
                        }
                    }
                }
                if start < data.len() {
                    want.push(xxh3_64_with_seed(&data[start..], prev));
                }
                assert_eq!((got, cut), (want, false), "{n} ids, {k} per block");
            }
        }
    }

    #[test]
    fn token_blocks_are_bounded_and_report_truncation() {
        let data = canon(64);
        let mut out = Vec::new();
        assert!(!hash_token_blocks(1, &data, 16, 4, &mut out));
        assert_eq!(out.len(), 4);
        assert!(hash_token_blocks(1, &data, 16, 3, &mut out));
        assert_eq!(out.len(), 3);
        let mut cut = data.clone();
        cut.extend_from_slice(b"12");
        assert!(
            hash_token_blocks(1, &cut, 16, 4, &mut out),
            "a partial 5th block"
        );
        assert!(!hash_token_blocks(1, &[], 16, 4, &mut out));
        assert!(out.is_empty());
        assert!(!hash_token_blocks(1, &data, 0, 4, &mut out));
    }

    #[test]
    fn truncation_is_reported() {
        let mut out = Vec::new();
        assert!(!hash_blocks(1, &[0u8; 64], 16, 4, &mut out));
        assert_eq!(out.len(), 4);
        assert!(hash_blocks(1, &[0u8; 65], 16, 4, &mut out));
        assert_eq!(out.len(), 4);
        assert!(!hash_blocks(1, &[], 16, 4, &mut out));
        assert!(out.is_empty());
    }
}
