//! Token radix tree with SGLang's RadixCache semantics.
//!
//! * Keys are token ids; each edge carries a run of tokens (compressed trie).
//! * `match_prefix` returns the longest cached prefix and splits an edge when the match ends
//!   inside it, so the returned node ends exactly at the matched length.
//! * Running requests lock the path from their node to the root (`inc_lock`); locked nodes are
//!   never evicted.
//! * Eviction removes unlocked leaves in least-recently-used order (a leaf whose parent becomes an
//!   unlocked leaf is then itself a candidate), exactly like SGLang's heap-based `evict`.
//! * Size accounting is in tokens (sum of edge lengths); capacity is enforced by the scheduler,
//!   which calls `evict` before admitting work.
//!
//! The LRU order is kept in a `BTreeSet<(tick, node)>` of evictable leaves so that eviction is
//! `O(log n)` per removed node instead of a full scan.

use std::collections::{BTreeSet, HashMap};

/// Index of a node in the tree's slab.
pub type NodeId = usize;

/// The root node id (always present, holds no tokens, never evicted).
pub const ROOT: NodeId = 0;

#[derive(Debug)]
struct Node {
    key: Vec<u32>,
    children: HashMap<u32, NodeId>,
    parent: NodeId,
    lock_ref: u32,
    last_access: u64,
    /// Key under which this node sits in the LRU set (present iff it is an evictable leaf).
    lru_key: Option<u64>,
    alive: bool,
}

impl Node {
    fn new(key: Vec<u32>, parent: NodeId, tick: u64) -> Self {
        Node {
            key,
            children: HashMap::new(),
            parent,
            lock_ref: 0,
            last_access: tick,
            lru_key: None,
            alive: true,
        }
    }
}

/// Token radix cache.
#[derive(Debug)]
pub struct RadixCache {
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    lru: BTreeSet<(u64, NodeId)>,
    tick: u64,
    total: usize,
    protected: usize,
}

impl Default for RadixCache {
    fn default() -> Self {
        Self::new()
    }
}

fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl RadixCache {
    /// An empty cache.
    pub fn new() -> Self {
        RadixCache {
            nodes: vec![Node::new(Vec::new(), ROOT, 0)],
            free: Vec::new(),
            lru: BTreeSet::new(),
            tick: 0,
            total: 0,
            protected: 0,
        }
    }

    /// Tokens stored in the tree (evictable and locked).
    pub fn total_size(&self) -> usize {
        self.total
    }

    /// Tokens on paths locked by running requests.
    pub fn protected_size(&self) -> usize {
        self.protected
    }

    /// Tokens that eviction could free right now.
    pub fn evictable_size(&self) -> usize {
        self.total - self.protected
    }

    /// Number of live nodes (root included).
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Drops everything. Callers must ensure no request holds a lock (SGLang refuses to flush
    /// while requests are running or waiting).
    pub fn reset(&mut self) {
        *self = RadixCache::new();
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        if let Some(id) = self.free.pop() {
            self.nodes[id] = node;
            id
        } else {
            self.nodes.push(node);
            self.nodes.len() - 1
        }
    }

    /// Re-files `id` in the LRU set according to its current state.
    fn refresh(&mut self, id: NodeId) {
        if id == ROOT {
            return;
        }
        let n = &mut self.nodes[id];
        if let Some(k) = n.lru_key.take() {
            self.lru.remove(&(k, id));
        }
        if n.alive && n.children.is_empty() && n.lock_ref == 0 {
            n.lru_key = Some(n.last_access);
            self.lru.insert((n.last_access, id));
        }
    }

    /// Splits `id`'s edge after `at` tokens; returns the new upper node (which keeps `id`'s
    /// parent link and lock count; `id` becomes its only child).
    fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let parent = self.nodes[id].parent;
        let first = self.nodes[id].key[0];
        let tail = self.nodes[id].key.split_off(at);
        let head = std::mem::replace(&mut self.nodes[id].key, tail);
        let lock_ref = self.nodes[id].lock_ref;
        let last_access = self.nodes[id].last_access;
        let mut upper = Node::new(head, parent, last_access);
        upper.lock_ref = lock_ref;
        let tail_first = self.nodes[id].key[0];
        upper.children.insert(tail_first, id);
        let up = self.alloc(upper);
        self.nodes[id].parent = up;
        self.nodes[parent].children.insert(first, up);
        // `id` keeps its leaf status; `up` has a child so it is not in the LRU set.
        up
    }

    /// Longest cached prefix of `tokens`: (matched length, node ending exactly there).
    /// Touches the matched path (LRU).
    pub fn match_prefix(&mut self, tokens: &[u32]) -> (usize, NodeId) {
        let tick = self.next_tick();
        let mut node = ROOT;
        let mut pos = 0;
        self.nodes[ROOT].last_access = tick;
        while pos < tokens.len() {
            let Some(&child) = self.nodes[node].children.get(&tokens[pos]) else {
                break;
            };
            let n = common_len(&self.nodes[child].key, &tokens[pos..]);
            let child = if n < self.nodes[child].key.len() {
                self.split(child, n)
            } else {
                child
            };
            self.nodes[child].last_access = tick;
            self.refresh(child);
            pos += n;
            node = child;
        }
        (pos, node)
    }

    /// Length of the longest cached prefix of `tokens`, read-only: no split, no LRU touch
    /// (used to estimate the uncached tokens of waiting requests for `/v1/loads`).
    pub fn peek_prefix(&self, tokens: &[u32]) -> usize {
        let mut node = ROOT;
        let mut pos = 0;
        while pos < tokens.len() {
            let Some(&child) = self.nodes[node].children.get(&tokens[pos]) else {
                break;
            };
            let key = &self.nodes[child].key;
            let n = common_len(key, &tokens[pos..]);
            pos += n;
            if n < key.len() {
                break;
            }
            node = child;
        }
        pos
    }

    /// Inserts `tokens`; returns (length that was already cached, node of the full sequence).
    /// Touches the whole path (LRU).
    pub fn insert(&mut self, tokens: &[u32]) -> (usize, NodeId) {
        let tick = self.next_tick();
        let mut node = ROOT;
        let mut pos = 0;
        while pos < tokens.len() {
            match self.nodes[node].children.get(&tokens[pos]) {
                Some(&child) => {
                    let n = common_len(&self.nodes[child].key, &tokens[pos..]);
                    let child = if n < self.nodes[child].key.len() {
                        self.split(child, n)
                    } else {
                        child
                    };
                    self.nodes[child].last_access = tick;
                    self.refresh(child);
                    pos += n;
                    node = child;
                }
                None => {
                    let leaf = Node::new(tokens[pos..].to_vec(), node, tick);
                    let id = self.alloc(leaf);
                    self.nodes[node].children.insert(tokens[pos], id);
                    self.total += tokens.len() - pos;
                    self.refresh(node);
                    self.refresh(id);
                    return (pos, id);
                }
            }
        }
        (pos, node)
    }

    /// Locks the path from `id` to the root (a running request uses it).
    pub fn inc_lock(&mut self, id: NodeId) {
        let mut cur = id;
        while cur != ROOT {
            let n = &mut self.nodes[cur];
            if n.lock_ref == 0 {
                self.protected += n.key.len();
            }
            n.lock_ref += 1;
            let parent = n.parent;
            self.refresh(cur);
            cur = parent;
        }
    }

    /// Releases a lock taken with `inc_lock`.
    pub fn dec_lock(&mut self, id: NodeId) {
        let mut cur = id;
        while cur != ROOT {
            let n = &mut self.nodes[cur];
            debug_assert!(n.lock_ref > 0, "dec_lock on an unlocked node");
            n.lock_ref = n.lock_ref.saturating_sub(1);
            if n.lock_ref == 0 {
                self.protected -= n.key.len();
            }
            let parent = n.parent;
            self.refresh(cur);
            cur = parent;
        }
    }

    /// Evicts least-recently-used unlocked leaves until at least `num_tokens` tokens were freed
    /// or nothing evictable is left. Returns the number of tokens freed.
    pub fn evict(&mut self, num_tokens: usize) -> usize {
        let mut freed = 0;
        while freed < num_tokens {
            let Some(&(k, id)) = self.lru.iter().next() else {
                break;
            };
            self.lru.remove(&(k, id));
            let parent = self.nodes[id].parent;
            let first = self.nodes[id].key[0];
            let len = self.nodes[id].key.len();
            self.nodes[parent].children.remove(&first);
            let n = &mut self.nodes[id];
            n.alive = false;
            n.lru_key = None;
            n.key = Vec::new();
            n.children = HashMap::new();
            self.free.push(id);
            self.total -= len;
            freed += len;
            self.refresh(parent);
        }
        freed
    }

    /// Is the node's path locked (test helper)?
    pub fn lock_ref(&self, id: NodeId) -> u32 {
        self.nodes[id].lock_ref
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn match_and_insert() {
        let mut c = RadixCache::new();
        assert_eq!(c.match_prefix(&[1, 2, 3]).0, 0);
        assert_eq!(c.insert(&[1, 2, 3, 4]).0, 0);
        assert_eq!(c.total_size(), 4);
        assert_eq!(c.match_prefix(&[1, 2, 3, 4, 5]).0, 4);
        assert_eq!(c.match_prefix(&[1, 2, 9]).0, 2);
        // the split did not change the size
        assert_eq!(c.total_size(), 4);
        assert_eq!(c.insert(&[1, 2, 7, 8]).0, 2);
        assert_eq!(c.total_size(), 6);
        assert_eq!(c.match_prefix(&[1, 2, 7, 8]).0, 4);
        assert_eq!(c.match_prefix(&[1, 2, 3, 4]).0, 4);
        assert_eq!(c.match_prefix(&[2]).0, 0);
        assert_eq!(c.insert(&[1, 2]).0, 2);
        assert_eq!(c.total_size(), 6);
    }

    #[test]
    fn peek_matches_like_match_prefix_without_changing_the_tree() {
        let mut c = RadixCache::new();
        c.insert(&[1, 2, 3, 4]);
        c.insert(&[1, 2, 7]);
        let nodes = c.node_count();
        for (q, want) in [
            (vec![1, 2, 3, 4, 5], 4),
            (vec![1, 2, 3, 9], 3),
            (vec![1, 2, 7], 3),
            (vec![1, 9], 1),
            (vec![5], 0),
            (vec![], 0),
        ] {
            assert_eq!(c.peek_prefix(&q), want, "{q:?}");
        }
        assert_eq!(c.node_count(), nodes, "peek never splits");
        assert_eq!(c.match_prefix(&[1, 2, 3, 9]).0, 3);
    }

    #[test]
    fn lru_evicts_oldest_leaf_first() {
        let mut c = RadixCache::new();
        c.insert(&seq(0..10)); // A
        c.insert(&seq(100..110)); // B
        c.insert(&seq(200..210)); // C
                                  // touch A so B is now the oldest
        assert_eq!(c.match_prefix(&seq(0..10)).0, 10);
        assert_eq!(c.evict(1), 10);
        assert_eq!(c.match_prefix(&seq(100..110)).0, 0, "B evicted");
        assert_eq!(c.match_prefix(&seq(0..10)).0, 10);
        assert_eq!(c.match_prefix(&seq(200..210)).0, 10);
        assert_eq!(c.total_size(), 20);
    }

    #[test]
    fn eviction_goes_leaf_then_parent() {
        let mut c = RadixCache::new();
        c.insert(&seq(0..10));
        c.insert(&[&seq(0..10)[..], &seq(50..55)[..]].concat());
        c.insert(&[&seq(0..10)[..], &seq(60..65)[..]].concat());
        c.insert(&seq(300..304));
        assert_eq!(c.total_size(), 24);
        // oldest leaf: 0..10 + 50..55 branch (5 tokens)
        assert_eq!(c.evict(5), 5);
        assert_eq!(
            c.match_prefix(&[&seq(0..10)[..], &seq(50..55)[..]].concat())
                .0,
            10
        );
        // everything
        assert_eq!(c.evict(usize::MAX), 19);
        assert_eq!(c.total_size(), 0);
        assert_eq!(c.node_count(), 1);
    }

    #[test]
    fn locked_paths_survive_eviction() {
        let mut c = RadixCache::new();
        let (_, a) = c.insert(&seq(0..8));
        let (_, b) = c.insert(&[&seq(0..4)[..], &seq(90..94)[..]].concat());
        c.insert(&seq(500..506));
        c.inc_lock(a);
        assert_eq!(c.protected_size(), 8);
        assert_eq!(c.evictable_size(), 4 + 6);
        // evict everything possible: only b's branch and the 500.. sequence go
        assert_eq!(c.evict(usize::MAX), 10);
        assert_eq!(c.match_prefix(&seq(0..8)).0, 8);
        assert_eq!(c.total_size(), 8);
        assert!(c.lock_ref(a) > 0);
        let _ = b;
        c.dec_lock(a);
        assert_eq!(c.protected_size(), 0);
        assert_eq!(c.evict(usize::MAX), 8);
        assert_eq!(c.total_size(), 0);
    }

    #[test]
    fn lock_survives_split_by_other_request() {
        let mut c = RadixCache::new();
        let (_, a) = c.insert(&seq(0..10));
        c.inc_lock(a);
        // splitting a locked edge keeps both halves locked
        let (m, _) = c.match_prefix(&seq(0..5));
        assert_eq!(m, 5);
        assert_eq!(c.protected_size(), 10);
        assert_eq!(c.evict(usize::MAX), 0);
        c.dec_lock(a);
        assert_eq!(c.protected_size(), 0);
        assert_eq!(c.evict(usize::MAX), 10);
    }

    #[test]
    fn capacity_bounded_by_evict_before_insert() {
        // The scheduler's pattern: make room, then insert. The tree never exceeds capacity.
        let cap = 1000;
        let mut c = RadixCache::new();
        for i in 0..500u32 {
            let s: Vec<u32> = (0..37).map(|j| i * 1000 + j).collect();
            let need = s.len();
            let over = (c.total_size() + need).saturating_sub(cap);
            if over > 0 {
                assert!(c.evict(over) >= over);
            }
            c.insert(&s);
            assert!(c.total_size() <= cap);
        }
        // the most recent sequences are still there, the oldest are gone
        let last: Vec<u32> = (0..37).map(|j| 499 * 1000 + j).collect();
        assert_eq!(c.match_prefix(&last).0, 37);
        let first: Vec<u32> = (0..37).collect();
        assert_eq!(c.match_prefix(&first).0, 0);
        // node slots are reused
        assert!(c.node_count() < 40);
    }

    #[test]
    fn reset_clears() {
        let mut c = RadixCache::new();
        c.insert(&seq(0..100));
        c.reset();
        assert_eq!(c.total_size(), 0);
        assert_eq!(c.match_prefix(&seq(0..100)).0, 0);
    }
}
