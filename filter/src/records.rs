//! Fixed-size little-endian records keyed by worker id, the layout of the per-model shared-data
//! values of `load.rs` (leases), `poll.rs` (polled loads) and `hits.rs` (token counters). A
//! record starts with the worker id (u32); the rest is u32 fields.
//!
//! Records are placed by id through [`ById`], the configured workers sorted by id: one pass over
//! the records with a binary search each, O(m log n) for m records and n workers whatever order
//! the records are in. (Finding each worker by a linear scan when its position hint missed made a
//! decision O(n²) after a worker-list change: 1024 workers with one removed.)

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

/// Byte offset of worker `id`'s record among records of `rec` bytes, trying position `hint`, then
/// its neighbours (one worker added or removed before it shifts it by one), then every record.
/// For single-record updates only (O(m) at worst, like the copy of the value itself); whole
/// values are read with [`ById::each`].
pub fn find(b: &[u8], rec: usize, id: u32, hint: usize) -> Option<usize> {
    let n = b.len() / rec;
    for i in [hint, hint.wrapping_sub(1), hint.wrapping_add(1)] {
        if i < n && rd(b, i * rec) == id {
            return Some(i * rec);
        }
    }
    (0..n).map(|i| i * rec).find(|&o| rd(b, o) == id)
}

/// One config's workers by id: their ids in config order, and `(id, position)` sorted by id.
/// Built once per config.
/// The offset of worker `id`'s record in `b` (records of `rec` bytes; a partial tail is dropped),
/// appending a zeroed record with that id when it is missing.
pub fn slot(b: &mut Vec<u8>, rec: usize, id: u32, hint: usize) -> usize {
    b.truncate(b.len() - b.len() % rec.max(1));
    match find(b, rec, id, hint) {
        Some(o) => o,
        None => {
            let o = b.len();
            b.resize(o + rec, 0);
            wr(b, o, id);
            o
        }
    }
}

/// Writes worker `id`'s record in the value at `key` with a CAS read-modify-write: `fill` gets
/// the value and the record's offset. For values with one writer (the poll lease holder), so
/// conflicts are rare; false if all 8 tries lost. A record that `fill` leaves as it was (a
/// failed poll after a failed poll) is not written again: the value holds it already.
pub fn publish<S: crate::store::Store>(
    store: &S,
    key: &str,
    rec: usize,
    id: u32,
    hint: usize,
    buf: &mut Vec<u8>,
    fill: impl Fn(&mut [u8], usize),
) -> bool {
    for _ in 0..8 {
        let cas = store.get(key, buf);
        let len = buf.len();
        let o = slot(buf, rec, id, hint);
        let mut before = [0u8; 64];
        let old = match buf.get(o..o + rec) {
            Some(r) if cas.is_some() && buf.len() == len && rec <= before.len() => {
                before[..rec].copy_from_slice(r);
                Some(&before[..rec])
            }
            _ => None,
        };
        fill(buf, o);
        if old.is_some() && old == buf.get(o..o + rec) {
            return true;
        }
        if store.set(key, buf, cas.unwrap_or(0)).is_ok() {
            return true;
        }
    }
    false
}

#[derive(Debug, Clone, Default)]
pub struct ById {
    order: Vec<u32>,
    sorted: Vec<(u32, u16)>,
}

impl ById {
    pub fn new(ids: impl Iterator<Item = u32>) -> ById {
        let order: Vec<u32> = ids.collect();
        let mut sorted: Vec<(u32, u16)> = order
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i as u16))
            .collect();
        sorted.sort_unstable();
        ById { order, sorted }
    }

    /// Configured position of worker `id` (O(log n)).
    pub fn position(&self, id: u32) -> Option<usize> {
        let k = self.sorted.binary_search_by_key(&id, |e| e.0).ok()?;
        self.sorted.get(k).map(|e| usize::from(e.1))
    }

    /// Position of `id`, trying `hint` first (O(1) when the value was written in config order).
    fn position_hinted(&self, id: u32, hint: usize) -> Option<usize> {
        if self.order.get(hint) == Some(&id) {
            return Some(hint);
        }
        self.position(id)
    }

    /// Calls `f(position, offset)` for every whole record of `rec` bytes in `b` whose id is a
    /// configured worker (records of other workers are skipped; a trailing partial record is
    /// ignored).
    pub fn each(&self, b: &[u8], rec: usize, mut f: impl FnMut(usize, usize)) {
        let whole = b.len() - b.len() % rec.max(1);
        // The hint follows the last shift seen: records written in another config's order (a
        // worker added or removed in front) stay O(1) after the first miss.
        let (mut o, mut k, mut shift) = (0, 0usize, 0isize);
        while o + rec <= whole {
            let hint = k.wrapping_add_signed(shift);
            if let Some(p) = self.position_hinted(rd(b, o), hint) {
                shift = p as isize - k as isize;
                f(p, o);
            }
            o += rec;
            k += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_records_in_any_order_and_skips_unknown_ids() {
        let ids = ById::new([30u32, 10, 20].into_iter());
        let mut b = Vec::new();
        for id in [20u32, 99, 30, 10] {
            b.extend_from_slice(&id.to_le_bytes());
            b.extend_from_slice(&(id + 1).to_le_bytes());
        }
        b.push(7); // partial record
        let mut seen = Vec::new();
        ids.each(&b, 8, |p, o| seen.push((p, rd(&b, o + 4))));
        assert_eq!(seen, vec![(2, 21), (0, 31), (1, 11)]);
        assert_eq!(ids.position(99), None);
    }

    #[test]
    fn find_tries_the_neighbours_of_a_missed_hint() {
        let b: Vec<u8> = [1u32, 2, 3, 4]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(find(&b, 4, 3, 3), Some(8)); // one removed before it
        assert_eq!(find(&b, 4, 3, 1), Some(8)); // one added before it
        assert_eq!(find(&b, 4, 1, 0), Some(0));
        assert_eq!(find(&b, 4, 1, usize::MAX), Some(0));
        assert_eq!(find(&b, 4, 9, 2), None);
    }
}
