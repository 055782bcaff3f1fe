//! Fixed-size little-endian records keyed by worker id, the layout of the per-model shared-data
//! values of `load.rs` (load vector) and `poll.rs` (polled loads). A record starts with the
//! worker id (u32); the rest is u32 fields. Records are found by id, trying the worker's position
//! in the current config first, so the common case is O(1) and a config reload that adds, removes
//! or reorders workers still finds each worker's record.

/// The u32 at byte `at`, or 0 past the end (a foreign or truncated value reads as zeros).
pub fn rd(b: &[u8], at: usize) -> u32 {
    match b.get(at..at + 4) {
        Some(s) => u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        None => 0,
    }
}

/// Writes the u32 at byte `at` (ignored past the end).
pub fn wr(b: &mut [u8], at: usize, v: u32) {
    if let Some(s) = b.get_mut(at..at + 4) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}

/// Byte offset of worker `id`'s record among records of `rec` bytes, trying position `hint`.
pub fn find(b: &[u8], rec: usize, id: u32, hint: usize) -> Option<usize> {
    let n = b.len() / rec;
    if hint < n && rd(b, hint * rec) == id {
        return Some(hint * rec);
    }
    (0..n).map(|i| i * rec).find(|&o| rd(b, o) == id)
}
