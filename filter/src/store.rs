//! The one host facility the routing core needs: Envoy's shared-data key/value store.
//!
//! Semantics mirror Envoy's shared data: a get returns the value and a CAS token; a set with
//! `cas == 0` is unconditional; a set with a stale non-zero token fails with `CasMismatch`; a set
//! on a missing key inserts; keys are never deleted. The core only talks to this trait, so it
//! runs natively against [`MemStore`] in tests and benches and against Envoy in the `.wasm`.

use std::cell::RefCell;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CasMismatch;

pub trait Store {
    /// Copies the value of `key` into `out` (cleared first) and returns its CAS token, or `None`
    /// when the key does not exist.
    fn get(&self, key: &str, out: &mut Vec<u8>) -> Option<u32>;
    /// Stores `value` if `cas` is 0 or still current.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), CasMismatch>;
    /// Whether a writer can vanish without undoing what it wrote, so the load leases in this
    /// store must expire when their heartbeat stops (`load.rs`): true in Envoy's shared data (a
    /// Wasm VM can trap and be replaced, without its streams' end callbacks).
    fn leases_expire(&self) -> bool {
        true
    }
}

/// In-memory store with Envoy's semantics, for native tests and benches.
///
/// `conflict_every` simulates contention: when `n > 0`, every n-th conditional set fails as if
/// another thread had written first (and bumps the key's token, as that write would have).
#[derive(Default)]
pub struct MemStore {
    inner: RefCell<MemInner>,
}

#[derive(Default)]
struct MemInner {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    conflict_every: u32,
    conditional_sets: u32,
    /// `leases_expire` answers false (a native process store).
    lasting_leases: bool,
    /// The next set of this key panics (fault injection, [`MemStore::panic_on_set`]).
    panic_on_set: Option<String>,
    pub gets: u64,
    pub sets: u64,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn with_conflicts(every: u32) -> Self {
        let s = Self::default();
        s.inner.borrow_mut().conflict_every = every;
        s
    }
    /// A store whose writers cannot vanish, as the native build's: load leases never expire.
    pub fn with_lasting_leases() -> Self {
        let s = Self::default();
        s.inner.borrow_mut().lasting_leases = true;
        s
    }
    pub fn len(&self) -> usize {
        self.inner.borrow().map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Host calls made so far: (gets, sets).
    pub fn calls(&self) -> (u64, u64) {
        let i = self.inner.borrow();
        (i.gets, i.sets)
    }
    pub fn keys(&self) -> Vec<String> {
        self.inner.borrow().map.keys().cloned().collect()
    }
    /// Makes the next set of `key` panic: a fault inside a host call, for tests that a panic
    /// (caught by the native build's guard) leaks no charge.
    pub fn panic_on_set(&self, key: &str) {
        self.inner.borrow_mut().panic_on_set = Some(key.to_string());
    }
    /// Writes unconditionally, bypassing contention simulation (test set-up).
    pub fn put(&self, key: &str, value: &[u8]) {
        let mut i = self.inner.borrow_mut();
        i.next_cas = i.next_cas.wrapping_add(1).max(1);
        let c = i.next_cas;
        i.map.insert(key.to_string(), (value.to_vec(), c));
    }
}

impl Store for MemStore {
    fn get(&self, key: &str, out: &mut Vec<u8>) -> Option<u32> {
        let mut i = self.inner.borrow_mut();
        i.gets += 1;
        out.clear();
        let (v, c) = i.map.get(key)?;
        out.extend_from_slice(v);
        Some(*c)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), CasMismatch> {
        let mut i = self.inner.borrow_mut();
        if i.panic_on_set.as_deref() == Some(key) {
            i.panic_on_set = None;
            drop(i);
            panic!("injected fault: a set of {key}");
        }
        i.sets += 1;
        i.next_cas = i.next_cas.wrapping_add(1).max(1);
        let new_cas = i.next_cas;
        if cas != 0 {
            i.conditional_sets += 1;
            let every = i.conflict_every;
            if every > 0 && i.conditional_sets.is_multiple_of(every) {
                if let Some(e) = i.map.get_mut(key) {
                    e.1 = new_cas;
                }
                return Err(CasMismatch);
            }
        }
        apply(&mut i.map, key, value, cas, new_cas)
    }

    fn leases_expire(&self) -> bool {
        !self.inner.borrow().lasting_leases
    }
}

/// Shared data's set on an in-memory map (for [`MemStore`] and the native build's process
/// store): a stale non-zero `cas` fails, anything else writes `value` with token `new_cas`.
pub(crate) fn apply(
    map: &mut HashMap<String, (Vec<u8>, u32)>,
    key: &str,
    value: &[u8],
    cas: u32,
    new_cas: u32,
) -> Result<(), CasMismatch> {
    match map.get_mut(key) {
        Some(e) => {
            if cas != 0 && e.1 != cas {
                return Err(CasMismatch);
            }
            e.0.clear();
            e.0.extend_from_slice(value);
            e.1 = new_cas;
        }
        None => {
            map.insert(key.to_string(), (value.to_vec(), new_cas));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_cas_semantics() {
        let s = MemStore::new();
        let mut buf = Vec::new();
        assert_eq!(s.get("k", &mut buf), None);
        s.set("k", b"a", 42).unwrap(); // CAS on a missing key inserts
        let c1 = s.get("k", &mut buf).unwrap();
        assert_eq!(buf, b"a");
        s.set("k", b"b", c1).unwrap();
        assert_eq!(s.set("k", b"c", c1), Err(CasMismatch));
        s.set("k", b"d", 0).unwrap();
        s.get("k", &mut buf).unwrap();
        assert_eq!(buf, b"d");
    }
}
