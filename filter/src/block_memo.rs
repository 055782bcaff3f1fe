//! The previous text prompt's block hashes, reused for the blocks the next prompt shares with it.
//!
//! Why: a block hash chains every byte before it (`blocks.rs`), so hashing a prompt costs one
//! xxh3 per 64-byte block however much of it the previous request on this VM already sent. The
//! common case the router exists for is exactly that: requests that open with the same system
//! prompt, tools or conversation. Comparing bytes is several times cheaper than hashing them
//! (16 bytes per Wasm SIMD step against an xxh3 per 64 bytes), so the shared full blocks are
//! copied from the previous prompt and only the rest is hashed.
//!
//! Invariant: [`BlockMemo::hash`] returns exactly what `blocks::hash_blocks` returns for the
//! same arguments (tested against it). A hash is reused only for a block that is full in both
//! prompts, lies wholly within their common prefix, and was made with the same seed (model,
//! LoRA adapter, tenant, salt, key) and block size; a block's hash depends on nothing else.
//!
//! Costs: per text prompt, a compare of the common prefix (it stops at the first differing 16
//! bytes), the hashes of the blocks past it, and a copy of the prompt (at most
//! [`MEMO_BYTES`]) and its hashes for the next one. Memory: at most [`MEMO_BYTES`] plus the
//! hashes of that many bytes, per VM.

use crate::blocks::hash_blocks_from;

/// Most prompt bytes remembered (blocks past them are always hashed).
pub const MEMO_BYTES: usize = 64 * 1024;

/// The last text prompt this VM hashed: its seed, block size, bytes and block hashes.
pub struct BlockMemo {
    seed: u64,
    block: usize,
    bytes: Vec<u8>,
    hashes: Vec<u64>,
    cap: usize,
}

impl Default for BlockMemo {
    fn default() -> Self {
        BlockMemo::with_cap(MEMO_BYTES)
    }
}

impl BlockMemo {
    /// A memo keeping at most `cap` bytes (the tests use small ones).
    pub fn with_cap(cap: usize) -> BlockMemo {
        BlockMemo {
            seed: 0,
            block: 0,
            bytes: Vec::new(),
            hashes: Vec::new(),
            cap,
        }
    }

    /// `blocks::hash_blocks(seed, data, block_bytes, max_blocks, out)`, reusing the previous
    /// prompt's hashes of the full blocks both share; then remembers this prompt.
    pub fn hash(
        &mut self,
        seed: u64,
        data: &[u8],
        block_bytes: usize,
        max_blocks: usize,
        out: &mut Vec<u64>,
    ) -> bool {
        out.clear();
        if block_bytes == 0 {
            return false;
        }
        let reuse = if self.seed == seed && self.block == block_bytes {
            (common_prefix(&self.bytes, data) / block_bytes)
                .min(self.hashes.len())
                .min(max_blocks)
        } else {
            0
        };
        out.extend_from_slice(self.hashes.get(..reuse).unwrap_or_default());
        let truncated = hash_blocks_from(seed, data, block_bytes, max_blocks, out);
        self.seed = seed;
        self.block = block_bytes;
        self.bytes.clear();
        self.bytes
            .extend_from_slice(data.get(..data.len().min(self.cap)).unwrap_or_default());
        self.hashes.clear();
        let kept = (self.cap / block_bytes).min(out.len()); // the full blocks of the kept bytes
        self.hashes
            .extend_from_slice(out.get(..kept).unwrap_or_default());
        truncated
    }
}

/// How many leading bytes `a` and `b` share: 16 bytes per step, then byte by byte.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        if !same16(x, y) {
            break;
        }
        i += 16;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Whether two 16-byte slices are equal: one Wasm SIMD compare in the shipped `.wasm`.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn same16(x: &[u8], y: &[u8]) -> bool {
    use core::arch::wasm32::*;
    if x.len() < 16 || y.len() < 16 {
        return false;
    }
    // SAFETY: both slices hold at least 16 bytes (checked above); no alignment is required.
    let (vx, vy) = unsafe { (v128_load(x.as_ptr().cast()), v128_load(y.as_ptr().cast())) };
    i8x16_all_true(i8x16_eq(vx, vy))
}

/// [`same16`] elsewhere: two 128-bit integers.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
#[inline(always)]
fn same16(x: &[u8], y: &[u8]) -> bool {
    match (x.first_chunk::<16>(), y.first_chunk::<16>()) {
        (Some(x), Some(y)) => u128::from_ne_bytes(*x) == u128::from_ne_bytes(*y),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::hash_blocks;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b'a' + (x % 4) as u8 // few letters: long common prefixes happen by chance too
            })
            .collect()
    }

    #[test]
    fn common_prefix_counts_shared_bytes() {
        let a = bytes(300, 1);
        for cut in [0, 1, 15, 16, 17, 31, 32, 33, 100, 299] {
            let mut b = a.clone();
            b[cut] ^= 0x40;
            assert_eq!(common_prefix(&a, &b), cut);
            assert_eq!(common_prefix(&a[..cut], &a), cut);
        }
        assert_eq!(common_prefix(&a, &a), 300);
        assert_eq!(common_prefix(&[], &a), 0);
    }

    /// Sequences of prompts sharing prefixes of every length (within and across blocks, at
    /// and past the memo's cap), changing seed, block size and block limit now and then: the
    /// memo's hashes and truncation flag always equal a fresh `hash_blocks`, and blocks are
    /// reused (fewer hashed) when a prompt shares a long prefix with the one before.
    #[test]
    fn equals_hash_blocks_on_related_prompts() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for cap in [0, 40, 64, 1000, MEMO_BYTES] {
            let mut memo = BlockMemo::with_cap(cap);
            let mut prev = bytes(500, 7);
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for case in 0..3000 {
                let seed = [1, 2][(next(20) == 0) as usize];
                let block = [16, 16, 16, 7, 64][next(5) as usize];
                let max_blocks = [100, 100, 3, 40][next(4) as usize];
                // Keep a prefix of the previous prompt, then new bytes.
                let keep = next(prev.len() as u64 + 1) as usize;
                let mut data = prev[..keep].to_vec();
                data.extend(bytes(next(300) as usize, case));
                let t1 = memo.hash(seed, &data, block, max_blocks, &mut got);
                let t2 = hash_blocks(seed, &data, block, max_blocks, &mut want);
                assert_eq!((t1, &got), (t2, &want), "cap {cap} case {case}");
                prev = data;
            }
        }
    }
}
