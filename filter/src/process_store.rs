//! The [`Store`] of the native build (`native`): process memory shared by every Envoy
//! worker thread, with the semantics of Envoy's shared data (see `store.rs`).
//!
//! Why not Envoy's shared data: a dynamic module runs in Envoy's own address space, so its
//! threads can share a plain map; the Wasm build needs the host's shared data only because each
//! worker thread has its own VM and memory. Same contract, so the routing core cannot tell.
//!
//! Costs: one uncontended mutex per get or set and a copy of the value (what a shared-data host
//! call copies, without the VM boundary). The lock is held only for the copy, never across a
//! call into Envoy. Keys are never deleted, as in shared data; the core bounds their number.

use crate::store::{CasMismatch, Store};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The process's one store.
pub struct ProcessStore;

#[derive(Default)]
struct Inner {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

fn inner() -> MutexGuard<'static, Inner> {
    static INNER: OnceLock<Mutex<Inner>> = OnceLock::new();
    // Every write is one insert or one in-place copy, so a lock poisoned by a panic elsewhere
    // still guards a consistent map.
    INNER
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

impl Store for ProcessStore {
    fn get(&self, key: &str, out: &mut Vec<u8>) -> Option<u32> {
        out.clear();
        let i = inner();
        let (v, c) = i.map.get(key)?;
        out.extend_from_slice(v);
        Some(*c)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), CasMismatch> {
        let mut i = inner();
        i.next_cas = i.next_cas.wrapping_add(1).max(1);
        let new_cas = i.next_cas;
        crate::store::apply(&mut i.map, key, value, cas, new_cas)
    }

    /// Every writer is a thread of this process: a stream always ends through Envoy's hooks and
    /// releases its charge (after a caught panic too: `native/guard.rs`), and a crash takes the
    /// store down with the process.
    fn leases_expire(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_u64(key: &str) -> (u64, u32) {
        let mut b = Vec::new();
        let c = ProcessStore.get(key, &mut b).unwrap();
        let w: [u8; 8] = b.get(..8).unwrap().try_into().unwrap();
        (u64::from_le_bytes(w), c)
    }

    #[test]
    fn envoy_cas_semantics() {
        let s = ProcessStore;
        let mut buf = Vec::new();
        assert_eq!(s.get("ps-test-k", &mut buf), None);
        s.set("ps-test-k", b"a", 42).unwrap(); // CAS on a missing key inserts
        let c1 = s.get("ps-test-k", &mut buf).unwrap();
        assert_eq!(buf, b"a");
        s.set("ps-test-k", b"b", c1).unwrap();
        assert_eq!(s.set("ps-test-k", b"c", c1), Err(CasMismatch));
        s.set("ps-test-k", b"d", 0).unwrap();
        s.get("ps-test-k", &mut buf).unwrap();
        assert_eq!(buf, b"d");
    }

    #[test]
    fn threads_share_it_and_never_lose_a_cas_update() {
        ProcessStore
            .set("ps-test-n", &0u64.to_le_bytes(), 0)
            .unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..500 {
                        loop {
                            let (n, c) = read_u64("ps-test-n");
                            if ProcessStore
                                .set("ps-test-n", &(n + 1).to_le_bytes(), c)
                                .is_ok()
                            {
                                break;
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(read_u64("ps-test-n").0, 2000);
    }
}
