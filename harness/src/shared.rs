//! Process-wide state every VM of one [`crate::Host`] shares, as in one Envoy process: the
//! shared-data store (Envoy's semantics, one mutex) and the stats registry.

use std::collections::HashMap;
use std::sync::Mutex;

/// Envoy's shared data: one store per process, shared by all VMs (of one vm_id).
#[derive(Default)]
pub struct SharedData {
    inner: Mutex<SharedInner>,
}

#[derive(Default)]
struct SharedInner {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl SharedData {
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.inner.lock().unwrap().map.get(key).cloned()
    }
    /// Envoy's `SharedData::set`.
    pub fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        let mut i = self.inner.lock().unwrap();
        i.next_cas = i.next_cas.wrapping_add(1).max(1);
        let next = i.next_cas;
        match i.map.get_mut(key) {
            Some(e) => {
                if cas != 0 && cas != e.1 {
                    return false;
                }
                e.0.clear();
                e.0.extend_from_slice(value);
                e.1 = next;
            }
            None => {
                i.map.insert(key.to_string(), (value.to_vec(), next));
            }
        }
        true
    }
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Total bytes of keys and values (what Envoy's map holds, without its own overhead).
    pub fn bytes(&self) -> usize {
        let i = self.inner.lock().unwrap();
        i.map.iter().map(|(k, v)| k.len() + v.0.len()).sum()
    }
}

/// Process-wide stats: a metric defined by name in several VMs is one stat, as in Envoy.
#[derive(Default)]
pub struct Stats {
    inner: Mutex<StatsInner>,
}

#[derive(Default)]
struct StatsInner {
    ids: HashMap<String, u32>,
    values: Vec<(String, i32, i64)>,
}

impl Stats {
    pub(crate) fn define(&self, kind: i32, name: &str) -> u32 {
        let mut i = self.inner.lock().unwrap();
        if let Some(&id) = i.ids.get(name) {
            return id;
        }
        i.values.push((name.to_string(), kind, 0));
        let id = i.values.len() as u32; // ids start at 1
        i.ids.insert(name.to_string(), id);
        id
    }
    pub(crate) fn with<R>(&self, id: u32, f: impl FnOnce(&mut i64) -> R) -> Option<R> {
        let mut i = self.inner.lock().unwrap();
        let e = i.values.get_mut((id as usize).checked_sub(1)?)?;
        Some(f(&mut e.2))
    }
    /// The value of a metric by its defined name (e.g. `prefix_router.requests.prefix_hit`).
    pub fn get(&self, name: &str) -> Option<i64> {
        let i = self.inner.lock().unwrap();
        let id = *i.ids.get(name)?;
        Some(i.values[id as usize - 1].2)
    }
    /// All metrics `(name, value)`, sorted by name.
    pub fn all(&self) -> Vec<(String, i64)> {
        let i = self.inner.lock().unwrap();
        let mut v: Vec<_> = i.values.iter().map(|e| (e.0.clone(), e.2)).collect();
        v.sort();
        v
    }
}

/// One VM's lease in a model's load value (`pr/l2/<model>`; layout in docs/design.md): the VM's
/// lease id, its last heartbeat (100 ms units) and its `(worker id, requests, tokens)` records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadLease {
    pub vm: u32,
    pub beat: u32,
    pub records: Vec<(u32, u32, u32)>,
}

impl SharedData {
    /// The leases stored in model `model`'s load value (empty when the key is missing; parsing
    /// stops at a malformed tail).
    pub fn load_leases(&self, model: &str) -> Vec<LoadLease> {
        let Some((b, _)) = self.get(&format!("pr/l2/{model}")) else {
            return Vec::new();
        };
        let u = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let (mut out, mut o) = (Vec::new(), 0);
        while o + 12 <= b.len() {
            let n = u(o + 8) as usize;
            let end = o + 12 + 12 * n;
            if end > b.len() {
                break;
            }
            let records = (0..n)
                .map(|k| o + 12 + 12 * k)
                .map(|r| (u(r), u(r + 4), u(r + 8)))
                .collect();
            out.push(LoadLease {
                vm: u(o),
                beat: u(o + 4),
                records,
            });
            o = end;
        }
        out
    }

    /// `(requests, tokens)` summed over every lease stored for `model`: the in-flight load this
    /// process's shared data holds, whatever the VMs' gauges say.
    pub fn load_totals(&self, model: &str) -> (u64, u64) {
        self.load_leases(model)
            .iter()
            .flat_map(|l| l.records.iter())
            .fold((0, 0), |(r, t), &(_, q, k)| {
                (r + u64::from(q), t + u64::from(k))
            })
    }
}
