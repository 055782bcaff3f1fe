//! The routing decision for one request, end to end, over a [`Store`]: parse, hash, match,
//! choose, charge load, record. Host-agnostic: the Envoy glue and the native tests/benches call
//! the same code. One `Router` lives per VM (per Envoy worker thread) and owns reusable buffers,
//! so a decision allocates nothing in steady state beyond what serde_json needs for escapes.
//!
//! Load accounting lives in [`Ledger`] (`load.rs`), worker choice behind [`Policy`]
//! (`policy/`), the index in `index.rs`, the PD body rewrite in `pd_body.rs`; this file wires
//! them together for one request. Beside it, one concept each: what a decision is
//! (`decision.rs`), a pool model's destination header and rebuilds (`pool.rs`), requests sent
//! before membership named a host (`unplaced.rs`), a PD request's decode worker (`pd.rs`), and
//! the peer records (`peer_records.rs`).
//!
//! Invariants: every field is private, so the ledger, the index buffers, the peer outbox and the
//! PD rewriter change only through `Router` methods, and a charge is made and released only
//! here; the configuration is read only ([`Router::cfg`]): a new one is a new router.
//!
//! **Rendezvous key.** When no worker holds any part of a prompt, the worker comes from
//! rendezvous hashing of a key every replica computes alike. For a chat prompt with at least two
//! messages the key covers the prompt through its second message (typically the system prompt
//! and the conversation's first user message): every turn of one conversation has the same key,
//! while conversations that share a system prompt get different keys, so they spread over the
//! fleet instead of all landing on one worker. Other prompts use their first
//! `policy.affinity_blocks` blocks.

use crate::block_memo::BlockMemo;
use crate::blocks::{hash_blocks_at, hash_token_blocks, keyed_seed, salted_seed};
use crate::busy::Busy;
use crate::config::{Config, UnknownModel};
use crate::footprint::Footprint;
use crate::hits::Verifier;
use crate::ids;
use crate::index::{Held, Index, IndexBuffers, Matches, Plan, WriteStats};
use crate::load::Ledger;
use crate::pd_body::Rewriter;
use crate::peers::Outbox;
use crate::placements::Placements;
use crate::policy::{self, Inputs, Policy, Reason};
use crate::records::ById;
use crate::request::{self, Endpoint, PromptKind};
use crate::sharers::Sharers;
use crate::store::Store;
use xxhash_rust::xxh3::xxh3_64_with_seed;

mod decision;
mod pd;
mod peer_records;
mod pool;
mod unplaced;

pub use decision::{not_found_body, Decision, HolderLoad, Outcome};

/// The rendezvous keys of a prompt: `affinity` (module docs) and `group` (its first
/// `affinity_blocks` blocks, shared by every prompt that opens alike).
#[derive(Clone, Copy)]
struct Keys {
    affinity: u64,
    group: u64,
    /// What siblings of a new prompt share (`placements.rs`): the opening message when it is at
    /// least `affinity_blocks` long, else the rendezvous key.
    sibling: u64,
}

pub struct Router {
    cfg: Config,
    canon: Vec<u8>,
    /// Canonical length after each chat message, and those boundaries as block counts.
    bounds: Vec<usize>,
    /// The token-id fast path's buffers (`request::parse_fast`).
    id_bufs: request::IdBuffers,
    /// Canonical bytes kept per prompt: enough for `max_prompt_blocks` blocks of any model, text
    /// or token ids (up to `MAX_ID_BYTES` canonical bytes per id). Derived from `cfg` once.
    limit: request::Limit,
    ends: Vec<usize>,
    hashes: Vec<u64>,
    /// The previous text prompt's block hashes (`block_memo.rs`).
    memo: BlockMemo,
    /// The index's reusable buffers and probe cache (`index.rs`).
    index_bufs: IndexBuffers,
    matches: Matches,
    matched: Vec<u32>,
    /// The model `matched` belongs to (the last decision's; `usize::MAX`: none).
    last_model: usize,
    /// The destination header's value, reused (`glue`; see [`Router::destination`]).
    dest: String,
    /// Per model: the workers by id, to map index holders and placements to workers in O(log n).
    ids: Vec<ById>,
    ledger: Ledger,
    /// Each worker's decayed in-flight average (`busy.rs`; `cache_aware`'s fleet prefixes).
    busy: Busy,
    /// Uncached prompt tokens sent to each worker lately (`footprint.rs`).
    footprint: Footprint,
    /// Requests lately routed on each deepest held prefix (`sharers.rs`).
    sharers: Sharers,
    /// Recent placements of prompts nobody held, shared by the VMs (`placements.rs`).
    placements: Placements,
    /// Predicted against reported reuse per worker, and the entries it no longer trusts
    /// (`hits.rs`).
    verifier: Verifier,
    policy: Box<dyn Policy>,
    /// Index records for the peers (present when `peers` is configured).
    outbox: Option<Outbox>,
    /// Where the next round-robin pick starts: passthrough requests, and the tie-break of a
    /// least-loaded pick.
    rotation: usize,
    /// Index writes planned by the last decision (see [`Router::take_plan`]).
    plan: Option<Plan>,
    /// What writing that plan's fresh records ahead did ([`Router::take_ahead_stats`]).
    ahead: WriteStats,
    /// Index buckets this VM still has to empty after the table shrank (`index::resize`).
    shrink: Option<std::ops::Range<u32>>,
    /// PD models: body rewriting buffer and room generator (`pd_body.rs`).
    pd_body: Rewriter,
    /// The seed this VM was created with (the clock at configure; see [`Router::init_store`]).
    seed: u64,
    /// Records of requests served before membership named their host (`Outcome::Unplaced`),
    /// waiting for it ([`Router::commit_served`]; bounded, `unplaced.rs`).
    early: Vec<Plan>,
}

impl Router {
    pub fn new(cfg: Config, seed: u64) -> Router {
        let most = |size: fn(&crate::config::Model) -> usize| {
            let per_block = cfg.models.iter().map(size).max().unwrap_or(64);
            per_block.saturating_mul(cfg.max_prompt_blocks)
        };
        let limit = request::Limit {
            text: most(|m| m.text_block_bytes),
            tokens: most(|m| m.token_block_size.saturating_mul(ids::MAX_ID_BYTES)),
        };
        let ids = cfg
            .models
            .iter()
            .map(|m| ById::new(m.workers.iter().map(|w| w.id)))
            .collect();
        let max_workers = cfg
            .models
            .iter()
            .map(|m| m.workers.len())
            .max()
            .unwrap_or(0);
        Router {
            canon: Vec::with_capacity(64 * 1024),
            bounds: Vec::with_capacity(64),
            // Scans record block ends at the default model's block size: the model a body
            // names is only known once it is parsed (another size searches, `blocks.rs`).
            limit,
            id_bufs: request::IdBuffers::for_blocks(
                cfg.models
                    .get(cfg.default_model)
                    .map_or(0, |m| m.token_block_size),
            ),
            ends: Vec::with_capacity(64),
            hashes: Vec::with_capacity(1024),
            memo: BlockMemo::default(),
            index_bufs: IndexBuffers::default(),
            // Holders seen in one lookup: at most HOLDERS per probe; sized so it never grows.
            matches: Matches::with_capacity(),
            matched: Vec::with_capacity(max_workers),
            last_model: usize::MAX,
            dest: String::with_capacity(256),
            ids,
            ledger: Ledger::new(&cfg).seeded(seed),
            busy: Busy::new(&cfg),
            footprint: Footprint::new(&cfg),
            sharers: Sharers::default(),
            placements: Placements::default(),
            verifier: Verifier::new(cfg.models.iter().map(|m| m.workers.len())),
            policy: policy::from_config(cfg.policy.name, seed),
            outbox: cfg.peers.as_ref().map(|p| Outbox::new(p.max_batch)),
            rotation: (seed as usize) % 1024,
            plan: None,
            ahead: WriteStats::default(),
            shrink: None,
            pd_body: Rewriter::new(seed ^ 0x7064),
            seed,
            early: Vec::new(),
            cfg,
        }
    }

    /// Creates each model's load vector if this is the first VM to start, and takes this VM's
    /// id from the shared counter ([`Ledger::init`]). The id is mixed into every per-VM random
    /// stream (PD rooms, round robin's start, the random policy): the clock seed alone is not
    /// unique, since Envoy can configure two worker threads' VMs at the same clock reading, and
    /// two VMs drawing the same bootstrap rooms send two prefills of one room to a prefill
    /// worker, leaving one decode waiting for KV until its timeout.
    pub fn init_store<S: Store>(&mut self, store: &S) {
        self.ledger.init(store, &self.cfg);
        if self.cfg.peers.is_some() {
            // The seed is the wall clock at configure (ns): this receiver's start, unless an
            // earlier configuration of this process set it (`peers::init_table`).
            crate::peers::init_table(store, self.seed / 1_000_000);
        }
        self.shrink = crate::index::resize(store, self.cfg.index_buckets);
        let seed = policy::mix(self.seed, self.ledger.lease_id());
        self.pd_body.reseed(seed ^ 0x7064);
        self.rotation = (seed as usize) % 1024;
        self.policy = policy::from_config(self.cfg.policy.name, seed);
    }

    /// The configuration this router was built from (read only: a new configuration is a new
    /// router).
    pub fn cfg(&self) -> &Config {
        &self.cfg
    }

    /// This VM's id, unique among the VMs of this Envoy process (0 before [`Router::init_store`]).
    pub fn vm_id(&self) -> u32 {
        self.ledger.lease_id()
    }

    /// The upstream cluster of a decision.
    pub fn cluster(&self, d: &Decision) -> &str {
        self.cfg
            .models
            .get(usize::from(d.model))
            .and_then(|m| m.workers.get(usize::from(d.worker)))
            .map_or("", |w| w.cluster.as_str())
    }

    /// The id of worker `w` of model `mi` (0 when there is none).
    pub fn worker_id(&self, mi: usize, w: u16) -> u32 {
        self.cfg
            .models
            .get(mi)
            .and_then(|m| m.workers.get(usize::from(w)))
            .map_or(0, |w| w.id)
    }

    /// A non-inference request: the passthrough cluster, or round robin over the default model.
    /// Returns `None` when `passthrough_cluster` is configured (use it as is).
    pub fn passthrough(&mut self) -> Option<Decision> {
        if self.cfg.passthrough_cluster.is_some() {
            return None;
        }
        let m = self.cfg.default_model;
        let n = self.cfg.models[m].workers.len();
        if n == 0 {
            return None; // a pool model with no known worker: its cluster picks
        }
        self.rotation = self.rotation.wrapping_add(1);
        Some(Decision::uncharged(
            m,
            self.rotation % n,
            Reason::Passthrough,
        ))
    }

    /// Decides where an inference request goes, in the shared (tenant-less) index space. `now`
    /// is in 100 ms units.
    pub fn route<S: Store>(
        &mut self,
        store: &S,
        endpoint: Endpoint,
        body: &[u8],
        now: u32,
    ) -> Outcome {
        self.route_for(store, endpoint, body, b"", now)
    }

    /// [`Router::route`] for `tenant` (the value of `tenant_header`, set by Envoy after
    /// authentication): its prompts hash, match and record only within its own index space.
    pub fn route_for<S: Store>(
        &mut self,
        store: &S,
        endpoint: Endpoint,
        body: &[u8],
        tenant: &[u8],
        now: u32,
    ) -> Outcome {
        self.plan = None;
        self.last_model = usize::MAX;
        let cfg = &self.cfg;
        let cpt = cfg.policy.chars_per_token as usize;
        let dm = cfg.default_model;
        let parsed = match request::parse_fast(
            endpoint,
            body,
            &mut self.canon,
            &mut self.bounds,
            &mut self.id_bufs,
            self.limit,
        ) {
            Ok(p) => p,
            Err(_) => {
                if cfg.models.get(dm).is_none_or(|m| m.workers.is_empty()) {
                    return Outcome::Unplaced { model: dm as u16 };
                }
                let est = cfg.policy.body_tokens(body.len());
                return Outcome::Route(self.least_loaded(store, dm, Reason::ParseError, est, now));
            }
        };
        let (mi, mut forced) = match parsed.model.as_deref() {
            None => (dm, None),
            Some(name) => match cfg.model_index(name.as_bytes()) {
                Some(i) => (i, None),
                None if cfg.unknown_model == UnknownModel::Reject => {
                    return Outcome::Reject {
                        status: 404,
                        body: not_found_body(name),
                    };
                }
                None => (dm, Some(Reason::Fallback)),
            },
        };
        let model = &cfg.models[mi];
        // A pool model before membership names a host: hashed and planned all the same, for
        // the host that will serve it (`commit_served`).
        let unplaced = model.workers.is_empty();
        // Charge what the engine prefills: rendered text, a fixed amount per media part, token
        // ids; never raw JSON sizes, and never more than `max_request_tokens` per request.
        let media = parsed
            .media_parts
            .saturating_mul(cfg.policy.media_part_tokens as usize);
        let (block, prompt_tokens) = match parsed.kind {
            PromptKind::Text => (
                model.text_block_bytes,
                (parsed.text_bytes / cpt).saturating_add(media),
            ),
            PromptKind::Tokens => (model.token_block_size, parsed.tokens),
            PromptKind::None => (0, media),
        };
        let prompt_tokens = prompt_tokens
            .clamp(1, cfg.policy.max_request_tokens as usize)
            .min(u32::MAX as usize) as u32;
        if parsed.kind == PromptKind::None || self.canon.is_empty() {
            if unplaced {
                return Outcome::Unplaced { model: mi as u16 };
            }
            return Outcome::Route(self.least_loaded(
                store,
                mi,
                Reason::Fallback,
                prompt_tokens,
                now,
            ));
        }
        let seed = salted_seed(
            keyed_seed(
                cfg.hash_key,
                model.name.as_bytes(),
                parsed.lora.as_deref().map(str::as_bytes),
                tenant,
            ),
            parsed.cache_salt.as_deref().map(str::as_bytes),
        );
        // A block: `block` bytes of text, or `block` token ids (`ids.rs`).
        let truncated = parsed.truncated
            | match parsed.kind {
                PromptKind::Tokens => match self.id_bufs.block_ends(block) {
                    Some(ends) => hash_blocks_at(
                        seed,
                        &self.canon,
                        ends.iter().copied(),
                        cfg.max_prompt_blocks,
                        &mut self.hashes,
                    ),
                    None => hash_token_blocks(
                        seed,
                        &self.canon,
                        block,
                        cfg.max_prompt_blocks,
                        &mut self.hashes,
                    ),
                },
                // Text: the blocks shared with this VM's previous text prompt are not hashed again.
                _ => self.memo.hash(
                    seed,
                    &self.canon,
                    block,
                    cfg.max_prompt_blocks,
                    &mut self.hashes,
                ),
            };
        // Message boundaries as block counts (full blocks only), for whole-turn matches.
        self.ends.clear();
        if parsed.kind == PromptKind::Text {
            for &b in &self.bounds {
                let c = b / block;
                if c >= 1 && c <= self.hashes.len() && self.ends.last() != Some(&c) {
                    self.ends.push(c);
                }
            }
        }
        if unplaced {
            self.plan_unplaced(mi, now);
            return Outcome::Unplaced { model: mi as u16 };
        }
        let affinity = self.affinity_key(seed, block, parsed.kind);
        // The opening message's end (full blocks), when another message follows it: a fleet
        // prefix candidate (policy/cache_aware.rs).
        let head_blocks = match (parsed.kind, self.bounds.len() >= 2, self.bounds.first()) {
            (PromptKind::Text, true, Some(&end)) => (end / block.max(1)).min(self.hashes.len()),
            _ => 0,
        } as u32;
        let k = self.cfg.policy.affinity_blocks.min(self.hashes.len());
        let group = self.hashes.get(k.wrapping_sub(1)).copied().unwrap_or(0);
        // A new prompt's siblings share its opening message (their conversation keys differ):
        // while the first of them is prefilled, before the index has it, the others follow it
        // within the slack the opening's tokens earn (`policy::shared::follow_sibling`), as a
        // holder would; those sent in the placement's own clock step only behind an opening of
        // a prefill chunk or more (below).
        let sibling = match head_blocks as usize {
            h if h >= k.max(1) => self.hashes.get(h - 1).copied().unwrap_or(affinity),
            _ => affinity,
        };
        let keys = Keys {
            affinity,
            group,
            sibling,
        };
        let mut d = self.decide(store, mi, prompt_tokens, keys, head_blocks, now);
        if let Some(r) = forced.take() {
            d.reason = r;
        }
        d.truncated = truncated;
        Outcome::Route(d)
    }

    /// The rendezvous key (module docs): through the second chat message, else the first
    /// `affinity_blocks` blocks.
    fn affinity_key(&self, seed: u64, block: usize, kind: PromptKind) -> u64 {
        if kind == PromptKind::Text && self.cfg.policy.conversation_key {
            if let Some(&end) = self.bounds.get(1) {
                let end = end.min(self.canon.len());
                // Continue the chain from the last full block before `end`: one short hash.
                let full = (end / block.max(1)).min(self.hashes.len());
                let start = full * block;
                let prev = full
                    .checked_sub(1)
                    .and_then(|i| self.hashes.get(i))
                    .copied()
                    .unwrap_or(seed);
                let tail = self.canon.get(start..end).unwrap_or_default();
                return xxh3_64_with_seed(tail, prev ^ 0x636f_6e76); // "conv"
            }
        }
        let k = self.cfg.policy.affinity_blocks.min(self.hashes.len());
        self.hashes.get(k.wrapping_sub(1)).copied().unwrap_or(0)
    }

    fn decide<S: Store>(
        &mut self,
        store: &S,
        mi: usize,
        prompt_tokens: u32,
        keys: Keys,
        head_blocks: u32,
        now: u32,
    ) -> Decision {
        let Keys {
            affinity,
            group,
            sibling,
        } = keys;
        let cfg = &self.cfg;
        let model = &cfg.models[mi];
        let uses_index = self.policy.uses_index();
        let ix = Index::for_model(cfg, model);
        self.matches.clear();
        if uses_index {
            ix.lookup(
                store,
                &self.hashes,
                now,
                &mut self.index_bufs,
                &mut self.matches,
            );
            ix.lookup_bounds(
                store,
                &self.hashes,
                &self.ends,
                now,
                &mut self.index_bufs,
                &mut self.matches,
            );
        }
        // Map holders (by id) to this config's workers; ids of removed workers are ignored, and
        // so are holders whose records predate what their worker's reported hits still support
        // (dropped from the matches too, so the chosen worker's path is rewritten fresh).
        self.matched.clear();
        self.matched.resize(model.workers.len(), 0);
        self.last_model = mi;
        let ids = &self.ids[mi];
        let verifier = &self.verifier;
        self.matches.workers.retain(|h| {
            ids.position(h.id)
                .is_none_or(|w| !verifier.stale(mi, w, h.oldest, now))
        });
        let total_blocks = self.hashes.len() as u32;
        let mut deepest = 0;
        for &Held { id, blocks, .. } in &self.matches.workers {
            if let Some(m) = ids.position(id).and_then(|i| self.matched.get_mut(i)) {
                *m = (*m).max(blocks);
                deepest = deepest.max(blocks);
            }
        }
        let conversation_blocks = if self.ends.len() >= 3 {
            self.ends.get(1).map_or(0, |&e| e as u32)
        } else {
            0
        };
        let (policy, matched, busy) = (&mut self.policy, &self.matched, &mut self.busy);
        let (rate, slot, util) = (
            self.verifier.rates(mi),
            self.verifier.slots(mi),
            self.verifier.utils(mi),
        );
        let footprint = &mut self.footprint;
        footprint.decay(mi, now, cfg.policy.footprint_decay_ms());
        // A new prompt (nobody holds any of it) may have a sibling placed moments ago. One sent
        // in the same clock step reaches the worker's queue with it: SGLang's default (FCFS)
        // scheduler matches each waiting request against its cache when it forms a prefill
        // batch and puts several in one, so each computes the opening and none reuses another's,
        // unless the opening is at least a prefill chunk (the chunked first request holds the
        // queue until it is done). Such a sibling spreads by its own key: following would only
        // stack a burst of new conversations on one worker.
        let follow = uses_index && deepest == 0 && cfg.policy.follows_placements();
        let recent = if follow {
            self.placements
                .recent(store, &model.placed_key, sibling, now)
                .filter(|&(_, at)| {
                    at != now
                        || policy::opening_tokens(
                            &cfg.policy,
                            prompt_tokens,
                            head_blocks,
                            total_blocks,
                        ) >= cfg.policy.prefill_chunk_tokens
                })
                .and_then(|(id, _)| self.ids[mi].position(id))
        } else {
            None
        };
        let window = cfg.policy.footprint_decay_ms();
        let sharers = self
            .sharers
            .observe_held(&self.hashes, deepest, now, window);
        let mut sampled = false;
        let mut holder = None;
        let (w, tok, reason) = self
            .ledger
            .decide(store, cfg, mi, now, |reqs, tokens, capacity| {
                if !sampled {
                    busy.observe(mi, now, cfg.policy.busy_window_ms, reqs);
                    sampled = true;
                }
                let inp = Inputs {
                    model,
                    reqs,
                    tokens,
                    capacity,
                    matched,
                    deepest,
                    total_blocks,
                    prompt_tokens,
                    affinity,
                    group,
                    conversation_blocks,
                    head_blocks,
                    busy: busy.of(mi),
                    rate,
                    slot,
                    util,
                    placed: footprint.of(mi),
                    recent,
                    sharers,
                };
                let (w, reason) = policy.choose(&cfg.policy, &inp);
                if deepest > 0 {
                    // The first worker holding the deepest match (what the debug header shows).
                    holder = matched
                        .iter()
                        .position(|&m| m == deepest)
                        .map(|h| HolderLoad {
                            worker: h as u16,
                            blocks: deepest,
                            reqs: reqs.get(h).copied().unwrap_or(0),
                            capacity: capacity.get(h).copied().unwrap_or(0),
                            tokens: tokens.get(h).copied().unwrap_or(0),
                            sharers: (sharers + 0.5).min(f32::from(u16::MAX)) as u16,
                        });
                }
                let tok = if uses_index {
                    policy::charged_tokens(&cfg.policy, &inp, w).max(1)
                } else {
                    prompt_tokens
                };
                (w, tok, reason)
            });
        let mut d = Decision::uncharged(mi, w, reason).with_charge(1, tok);
        d.matched_blocks = self.matched.get(w).copied().unwrap_or(0);
        d.total_blocks = total_blocks;
        d.probes = self.matches.probes;
        d.holder = holder;
        if uses_index {
            // What the worker will newly cache (the charge is the uncached estimate).
            footprint.place(mi, w, tok, cfg.policy.footprint_decay_ms());
            if follow {
                if let Some(wk) = model.workers.get(w) {
                    let key = &model.placed_key;
                    let new = self.placements.remember(store, key, sibling, wk.id, now);
                    if let (true, Some(ob)) = (new, &mut self.outbox) {
                        ob.push(model.placed_peer_key, wk.id, sibling);
                    }
                }
            }
            if self.plan_record(mi, w, now) {
                self.write_ahead(store);
            }
        }
        d
    }

    /// Writes the planned records past what the worker holds now, before any answer
    /// (`index::Plan`), for a request that extends a prefix its worker holds: a follow-up
    /// routed while this request waits for its prefill sees where its prefix is going, and
    /// queues behind it there. A prompt its worker holds none of is left to the answer: its
    /// siblings (other conversations on the same new opening, often sent in one burst) would
    /// all follow it into the same prefill batch, computing the opening side by side and
    /// reusing none of it; `placements.rs` places those. Peers hear of the records only once
    /// the answer is a 2xx ([`Router::commit`]).
    fn write_ahead<S: Store>(&mut self, store: &S) {
        let Some(plan) = self.plan.as_mut() else {
            return;
        };
        let Some(model) = self.cfg.models.get(usize::from(plan.model)) else {
            return;
        };
        let ix = Index::for_model(&self.cfg, model);
        self.ahead = ix.write_ahead(store, plan, &mut self.index_bufs);
        self.index_bufs.written.clear();
    }

    /// The index writes [`Router::write_ahead`] made for the last decision (the glue counts
    /// them with the other index writes).
    pub fn take_ahead_stats(&mut self) -> WriteStats {
        std::mem::take(&mut self.ahead)
    }

    /// Plans the chosen worker's index records (the prompt's checkpoints and chat end); true
    /// when the worker is known to hold some of the prompt (its fresh records may be written
    /// ahead, [`Router::write_ahead`]).
    fn plan_record(&mut self, mi: usize, w: usize, now: u32) -> bool {
        let model = &self.cfg.models[mi];
        let ix = Index::for_model(&self.cfg, model);
        let id = model.workers[w].id;
        let mut known = self.matches.known_for(id);
        // A worker the self-check trusts for a shorter span than the TTL gets its path rewritten
        // once a record on it is a quarter of that span old (as the TTL's quarter otherwise): a
        // prefix it keeps receiving must never fall behind its cutoff.
        known.hole |= known.blocks > 0 && self.verifier.refresh_due(mi, w, known.oldest, now);
        let mut plan = Plan::default();
        plan.model = mi as u16;
        plan.worker = id;
        plan.at = now;
        ix.plan(
            &self.hashes,
            self.ends.last().copied(),
            known,
            now,
            &mut plan,
        );
        if !plan.is_empty() {
            self.plan = Some(plan);
        }
        known.blocks > 0
    }

    /// The index writes planned by the last [`Router::route`] (none for a request that does not
    /// record: rejected, passthrough, parse error, comparison policies). The stream keeps it and
    /// hands it to [`Router::commit`] with the response status.
    pub fn take_plan(&mut self) -> Option<Plan> {
        self.plan.take()
    }

    /// Settles a plan once the response `status` is known: on a 2xx (the worker accepted the
    /// request and computes the prefix) writes what was not written ahead and queues every
    /// record for the peers; otherwise (4xx, 5xx, a local reply) takes back what was written
    /// ahead: what a failed request leaves in the index is nothing, and what one request can
    /// put there is bounded by one accepted request's checkpoints.
    pub fn commit<S: Store>(
        &mut self,
        store: &S,
        plan: &Plan,
        status: u32,
        now: u32,
    ) -> WriteStats {
        if !(200..300).contains(&status) {
            return self.abandon(store, plan);
        }
        let Some(model) = self.cfg.models.get(usize::from(plan.model)) else {
            return WriteStats::default();
        };
        let ix = Index::for_model(&self.cfg, model);
        self.index_bufs.written.clear();
        let stats = ix.write(
            store,
            plan.due_at_answer(),
            plan.worker,
            now,
            &mut self.index_bufs,
        );
        if let Some(ob) = &mut self.outbox {
            for h in plan
                .written_ahead()
                .chain(self.index_bufs.written.iter().copied())
            {
                ob.push(model.peer_key, plan.worker, h);
            }
        }
        self.index_bufs.written.clear();
        stats
    }

    /// Takes back a plan's records written ahead: its request failed or ended with no answer.
    pub fn abandon<S: Store>(&mut self, store: &S, plan: &Plan) -> WriteStats {
        let Some(model) = self.cfg.models.get(usize::from(plan.model)) else {
            return WriteStats::default();
        };
        Index::for_model(&self.cfg, model).retract(store, plan, &mut self.index_bufs)
    }

    fn least_loaded<S: Store>(
        &mut self,
        store: &S,
        mi: usize,
        reason: Reason,
        tokens: u32,
        now: u32,
    ) -> Decision {
        self.rotation = self.rotation.wrapping_add(1);
        let (reqs, toks) = self.ledger.view(store, &self.cfg, mi, now);
        let w = policy::least_loaded(reqs, toks, self.rotation);
        let tokens = tokens.max(1);
        self.ledger
            .add(store, &self.cfg, mi, w, 1, i64::from(tokens));
        Decision::uncharged(mi, w, reason).with_charge(1, tokens)
    }

    /// A decision's request was served (its response was a 2xx) and has ended: the worker has
    /// now counted its prompt and cached tokens (SGLang counts both when a request finishes), so
    /// the index's prediction for it joins the self-check's window (`hits.rs`) only now. Counting
    /// it at the decision would compare predictions with counters that lag them by the request's
    /// queueing, prefill and decode: on a long prefill, the siblings queued behind it look like
    /// misses and the worker's entries are aged out although it delivers them.
    pub fn observe_served(&mut self, d: &Decision) {
        if self.policy.uses_index() {
            let (mi, w) = (usize::from(d.model), usize::from(d.worker));
            self.verifier
                .observe(mi, w, d.matched_blocks, d.total_blocks);
        }
    }

    /// Undoes a decision's load charge; call exactly once when its stream ends (see
    /// [`Ledger::release`] for when the write is deferred).
    pub fn release<S: Store>(&mut self, store: &S, d: &Decision) {
        self.ledger.release(
            store,
            &self.cfg,
            usize::from(d.model),
            usize::from(d.worker),
            d.charged_reqs,
            d.charged_tokens,
        );
    }

    /// Gives back a part of a charge with the model's next write or tick (see
    /// [`Ledger::release_later`]).
    pub fn release_later(&mut self, d: &Decision) {
        self.ledger.release_later(
            &self.cfg,
            usize::from(d.model),
            usize::from(d.worker),
            d.charged_reqs,
            d.charged_tokens,
        );
    }

    /// The VM's timer at clock `now` (100 ms units; see [`Ledger::tick`]).
    pub fn tick<S: Store>(&mut self, store: &S, elapsed_ms: u32, now: u32) {
        self.ledger.tick(store, &self.cfg, elapsed_ms, now);
        if self.cfg.load_poll.metrics_interval_ms > 0 && self.verifier.due(now) {
            let ttl = self.cfg.index.ttl_seconds.saturating_mul(10);
            for (mi, (m, ids)) in self.cfg.models.iter().zip(&self.ids).enumerate() {
                self.verifier.read(store, &m.hits_key, ids, mi, now, ttl);
            }
        }
        if let Some(range) = &mut self.shrink {
            let mut key = String::new();
            crate::index::clear_some(store, range, crate::index::CLEAR_PER_TICK, &mut key);
            if range.start >= range.end {
                self.shrink = None;
            }
        }
    }

    /// The load ledger's part of [`Router::tick`] only: the lease of a replaced router whose
    /// streams still run keeps beating (`glue`), nothing else of it runs.
    pub fn keep_load_alive<S: Store>(&mut self, store: &S, elapsed_ms: u32, now: u32) {
        self.ledger.tick(store, &self.cfg, elapsed_ms, now);
    }

    /// Writes every parked load delta (the VM's tick, and shutdown).
    pub fn flush_pending<S: Store>(&mut self, store: &S) {
        self.ledger.flush(store, &self.cfg);
    }

    /// Whether a self-check window closed since the last call, and how many workers it aged
    /// out (`hits.rs`); then [`Router::hit_window`] has each worker's figures.
    pub fn take_hit_checks(&mut self) -> (bool, u64) {
        self.verifier.take_changed()
    }

    /// Worker `w` of model `mi`'s last self-check window (`hits.rs`).
    pub fn hit_window(&self, mi: usize, w: usize) -> Option<&crate::hits::Window> {
        self.verifier.window(mi, w)
    }

    /// Saturated load updates since the last call (`Ledger::take_underflows`).
    pub fn take_load_underflows(&mut self) -> u64 {
        self.ledger.take_underflows()
    }

    /// `(requests, tokens)` in flight in shared data over all models, as of the ledger's last
    /// sample (`Ledger::sampled`).
    pub fn sampled_load(&self) -> (u64, u64) {
        self.ledger.sampled()
    }

    /// What model `mi`'s load value says about its traffic, for the poller's schedule.
    pub fn activity<S: Store>(&mut self, store: &S, mi: usize) -> crate::poll::Activity {
        self.ledger.activity(store, &self.cfg, mi)
    }

    /// This VM's own in-flight `(requests, tokens)` on worker `w` of model `mi` (a load poll's
    /// answer is merged against it, `poll.rs`).
    pub fn own_load<S: Store>(&mut self, store: &S, mi: usize, w: usize) -> (u32, u32) {
        self.ledger.own_of(store, &self.cfg, mi, w)
    }

    /// Model `mi`'s workers by id.
    pub fn worker_ids(&self, mi: usize) -> Option<&ById> {
        self.ids.get(mi)
    }

    /// Number of parked load deltas (should be 0 except under extreme contention).
    pub fn pending_len(&self) -> usize {
        self.ledger.pending_len()
    }

    /// This Envoy's own in-flight (requests, tokens) of every worker of model `mi`.
    pub fn loads<S: Store>(&mut self, store: &S, mi: usize) -> Vec<(u32, u32)> {
        self.ledger.own(store, &self.cfg, mi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;
    use serde_json::Value;

    fn cfg(extra: &str) -> Config {
        let json = format!(
            r#"{{"models":{{"llama":{{"workers":["w0","w1","w2","w3"]}},"qwen":{{"workers":["q0","q1"]}}}},"default_model":"llama"{extra}}}"#
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn chat(model: &str, system: &str, user: &str) -> Vec<u8> {
        serde_json::json!({"model": model, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]})
        .to_string()
        .into_bytes()
    }

    fn routed(o: Outcome) -> Decision {
        match o {
            Outcome::Route(d) => d,
            Outcome::Reject { status, body } => panic!("rejected {status}: {body}"),
            Outcome::Unplaced { model } => panic!("no worker for model {model}"),
        }
    }

    /// Routes and commits the planned index records as a 200 response does, and counts the
    /// prediction as the stream's end does.
    fn served(r: &mut Router, s: &MemStore, ep: Endpoint, body: &[u8], now: u32) -> Decision {
        let d = routed(r.route(s, ep, body, now));
        if let Some(p) = r.take_plan() {
            r.commit(s, &p, 200, now);
        }
        r.observe_served(&d);
        d
    }

    #[test]
    fn shared_prefix_sticks_and_loads_return_to_zero() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 1);
        r.init_store(&s);
        let sys = "You are a meticulous assistant. ".repeat(40);
        let first = served(&mut r, &s, Endpoint::Chat, &chat("llama", &sys, "q0"), 100);
        assert_eq!(first.reason, Reason::HashAffinity);
        r.release(&s, &first);
        for i in 1..50 {
            let d = served(
                &mut r,
                &s,
                Endpoint::Chat,
                &chat("llama", &sys, &format!("q{i}")),
                100,
            );
            assert_eq!((d.worker, d.reason), (first.worker, Reason::PrefixHit));
            assert!(d.matched_blocks * 3 >= (d.total_blocks - 1) * 2);
            r.release(&s, &d);
        }
        assert!(r.loads(&s, 0).iter().all(|&l| l == (0, 0)));
    }

    /// Publishes worker `w` of llama's token counters as the poller would (`hits.rs`).
    fn counters(r: &Router, s: &MemStore, w: usize, prompt: u64, cached: u64, at: u32) {
        let m = &r.cfg.models[0];
        let sample = crate::hits::Sample {
            counters: crate::hits::Counters {
                prompt,
                cached,
                requests: 0,
            },
            at,
            rate: 0,
            slot_us: 0,
            util_ppm: 0,
        };
        assert!(crate::hits::publish(
            s,
            &m.hits_key,
            m.workers[w].id,
            w,
            &sample,
            &mut Vec::new()
        ));
    }

    #[test]
    fn a_worker_whose_reported_hits_fall_short_of_the_predicted_ones_loses_its_entries() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(r#","index":{"ttl_seconds":60}"#), 3);
        r.init_store(&s);
        let sys = "A long conversation that this worker served before. ".repeat(60);
        let first = served(&mut r, &s, Endpoint::Chat, &chat("llama", &sys, "q0"), 5);
        r.release(&s, &first);
        let x = usize::from(first.worker);
        counters(&r, &s, x, 0, 0, 10);
        r.tick(&s, 50, 10);
        // Follow-ups keep the worker while the index predicts their prefix there.
        for t in 11..40 {
            let d = served(
                &mut r,
                &s,
                Endpoint::Chat,
                &chat("llama", &sys, &format!("q{t}")),
                t,
            );
            r.release(&s, &d);
            assert_eq!((usize::from(d.worker), d.reason), (x, Reason::PrefixHit));
        }
        // The worker reports almost none of those hits (it evicted them): half of the TTL span
        // is trusted from now on, and these records are older than that. (The read at 390
        // stages the ended requests; the sample taken at 400 has counted them.)
        r.tick(&s, 50, 390);
        counters(&r, &s, x, 100_000, 1_000, 400);
        r.tick(&s, 50, 400);
        assert_eq!(r.take_hit_checks(), (true, 1));
        let win = *r.hit_window(0, x).unwrap();
        assert!(
            win.predicted_ppm > 500_000 && win.actual_ppm == 10_000,
            "{win:?}"
        );
        let d = served(
            &mut r,
            &s,
            Endpoint::Chat,
            &chat("llama", &sys, "again"),
            401,
        );
        r.release(&s, &d);
        assert_eq!(
            d.matched_blocks, 0,
            "the old entries are no longer trusted: {d:?}"
        );
        assert_ne!(d.reason, Reason::PrefixHit);
        // What the chosen worker is sent now is recorded fresh and trusted.
        let again = served(
            &mut r,
            &s,
            Endpoint::Chat,
            &chat("llama", &sys, "later"),
            402,
        );
        assert_eq!((again.worker, again.reason), (d.worker, Reason::PrefixHit));
        // Another VM that never saw the shortfall still trusts them (each VM checks its own).
        let mut other = Router::new(cfg(r#","index":{"ttl_seconds":60}"#), 4);
        let o = routed(other.route(&s, Endpoint::Chat, &chat("llama", &sys, "x"), 403));
        assert_eq!(o.reason, Reason::PrefixHit);
    }

    #[test]
    fn predictions_join_the_self_check_when_their_requests_end() {
        // A long first prefill: its siblings are routed to the worker (predicted hits) and
        // queue behind it. The worker counts tokens only when requests finish, so a window that
        // closes meanwhile must not hold the queued siblings' predictions against it.
        let s = MemStore::new();
        let mut r = Router::new(cfg(r#","index":{"ttl_seconds":60}"#), 3);
        r.init_store(&s);
        let sys = "A long document that every question here is asked about. ".repeat(60);
        let first = served(&mut r, &s, Endpoint::Chat, &chat("llama", &sys, "q0"), 5);
        r.release(&s, &first);
        let x = usize::from(first.worker);
        counters(&r, &s, x, 0, 0, 10);
        r.tick(&s, 50, 10);
        let mut queued = Vec::new();
        for t in 11..40 {
            let body = chat("llama", &sys, &format!("q{t}"));
            let d = routed(r.route(&s, Endpoint::Chat, &body, t));
            if let Some(p) = r.take_plan() {
                r.commit(&s, &p, 200, t);
            }
            assert_eq!((usize::from(d.worker), d.reason), (x, Reason::PrefixHit));
            // The load bound is not what this test is about: the charge goes back now, the
            // prediction waits for the request's end.
            r.release(&s, &d);
            queued.push(d);
        }
        // Only the first request has finished: the counters show its prompt, nothing reused.
        counters(&r, &s, x, 1_000, 0, 400);
        r.tick(&s, 50, 400);
        assert_eq!(r.take_hit_checks().1, 0, "no worker aged out");
        let d = routed(r.route(&s, Endpoint::Chat, &chat("llama", &sys, "a"), 401));
        assert_eq!((usize::from(d.worker), d.reason), (x, Reason::PrefixHit));
        r.release(&s, &d);
        // The siblings finish, served from the cache as predicted: still trusted.
        for d in &queued {
            r.observe_served(d);
        }
        r.tick(&s, 50, 790);
        counters(&r, &s, x, 60_000, 55_000, 800);
        r.tick(&s, 50, 800);
        assert_eq!(r.take_hit_checks(), (true, 0));
        // Had they been counted at their decisions, the first window would have aged it out:
        // the same predictions, ended before the counters show no reuse.
        let s2 = MemStore::new();
        let mut r2 = Router::new(cfg(r#","index":{"ttl_seconds":60}"#), 3);
        r2.init_store(&s2);
        let first = served(&mut r2, &s2, Endpoint::Chat, &chat("llama", &sys, "q0"), 5);
        r2.release(&s2, &first);
        counters(&r2, &s2, x, 0, 0, 10);
        r2.tick(&s2, 50, 10);
        for t in 11..40 {
            let body = chat("llama", &sys, &format!("q{t}"));
            let d = served(&mut r2, &s2, Endpoint::Chat, &body, t);
            r2.release(&s2, &d);
        }
        r2.tick(&s2, 50, 390);
        counters(&r2, &s2, x, 1_000, 0, 400);
        r2.tick(&s2, 50, 400);
        assert_eq!(r2.take_hit_checks(), (true, 1));
    }

    #[test]
    fn a_restarted_worker_is_not_trusted_with_entries_from_before() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 3);
        r.init_store(&s);
        let sys = "Another conversation, served before the restart. ".repeat(40);
        let first = served(&mut r, &s, Endpoint::Chat, &chat("llama", &sys, "q0"), 5);
        r.release(&s, &first);
        let x = usize::from(first.worker);
        counters(&r, &s, x, 90_000, 40_000, 6);
        r.tick(&s, 50, 6);
        // The counters went backwards: a new process with an empty cache.
        counters(&r, &s, x, 300, 0, 20);
        r.tick(&s, 50, 20);
        assert_eq!(r.take_hit_checks(), (false, 1));
        let d = served(&mut r, &s, Endpoint::Chat, &chat("llama", &sys, "q1"), 21);
        assert_eq!(d.matched_blocks, 0, "{d:?}");
    }

    #[test]
    fn two_vms_sharing_a_store_agree_and_respect_the_bound() {
        // Two routers over one store behave like two Envoy worker threads.
        let s = MemStore::new();
        let mut a = Router::new(cfg(""), 1);
        let mut b = Router::new(cfg(""), 2);
        a.init_store(&s);
        b.init_store(&s);
        let sys = "Shared system prompt for everyone. ".repeat(30);
        let d0 = served(&mut a, &s, Endpoint::Chat, &chat("llama", &sys, "x"), 5);
        a.release(&s, &d0);
        let d1 = served(&mut b, &s, Endpoint::Chat, &chat("llama", &sys, "y"), 5);
        assert_eq!((d1.worker, d1.reason), (d0.worker, Reason::PrefixHit));
        b.release(&s, &d1);
        // Hold 40 requests open: the load bound spreads them.
        let mut open = Vec::new();
        for i in 0..40 {
            let r = if i % 2 == 0 { &mut a } else { &mut b };
            let d = served(
                r,
                &s,
                Endpoint::Chat,
                &chat("llama", &sys, &i.to_string()),
                6,
            );
            let loads = r.loads(&s, 0);
            let total: u32 = loads.iter().map(|l| l.0).sum();
            let max = loads.iter().map(|l| l.0).max().unwrap();
            assert!(
                f64::from(max) <= 2.0 * f64::from(total) / 4.0 + 3.0,
                "{loads:?}"
            );
            open.push(d);
        }
        assert!(open.iter().any(|d| d.reason == Reason::LoadSpill));
        for (i, d) in open.iter().enumerate() {
            if i % 2 == 0 {
                a.release(&s, d)
            } else {
                b.release(&s, d)
            }
        }
        assert!(a.loads(&s, 0).iter().all(|&l| l == (0, 0)));
    }

    #[test]
    fn a_pd_sibling_on_another_vm_follows_a_new_prompt_before_its_answer_is_indexed() {
        // The first prompt of a group is still being served (nothing indexed); a sibling with
        // another question (another conversation key) reaches another thread.
        let sys = "A system prompt all of this group's questions share. ".repeat(20);
        let (mut differed, mut expired_moved) = (0, 0);
        for window in [0, 60_000] {
            let cfg_w = || {
                let json = format!(
                    r#"{{"models":{{"llama":{{"prefill":[{}],"decode":["d0","d1"]}},
                    "qwen":{{"workers":["q0","q1","q2","q3"]}}}},
                    "default_model":"qwen","policy":{{"placement_window_ms":{window}}}}}"#,
                    (0..4)
                        .map(|i| format!(r#"{{"cluster":"p{i}","bootstrap_host":"h"}}"#))
                        .collect::<Vec<_>>()
                        .join(",")
                );
                Config::from_json(json.as_bytes()).unwrap()
            };
            for g in 0..8 {
                let s = MemStore::new();
                let mut a = Router::new(cfg_w(), 1);
                let mut b = Router::new(cfg_w(), 2);
                a.init_store(&s);
                b.init_store(&s);
                let sys = format!("{g} {sys}");
                for model in ["llama"] {
                    let first = routed(a.route(&s, Endpoint::Chat, &chat(model, &sys, "q"), 50));
                    assert_eq!(first.reason, Reason::HashAffinity);
                    for q in 0..6 {
                        let body = chat(model, &sys, &format!("question {q}"));
                        let d = routed(b.route(&s, Endpoint::Chat, &body, 52));
                        b.release(&s, &d);
                        let moved = usize::from(d.worker != first.worker);
                        if window == 0 {
                            differed += moved;
                        } else {
                            assert_eq!(d.worker, first.worker, "group {g} question {q}")
                        }
                    }
                    // Once the placement is older than its window, rendezvous decides again.
                    if window > 0 {
                        let late = 52 + crate::placements::TICKS + 1;
                        let body = chat(model, &sys, "a late question");
                        let d = routed(b.route(&s, Endpoint::Chat, &body, late));
                        b.release(&s, &d);
                        expired_moved += usize::from(d.worker != first.worker);
                    }
                }
            }
        }
        assert!(expired_moved > 0, "expired placements steer nothing");
        // Without the shared placements the conversation keys scatter the siblings.
        assert!(differed > 20, "{differed}");
    }

    #[test]
    fn a_sibling_follows_a_new_opening_within_the_slack_its_tokens_earn() {
        // Not PD. The first question on a document is being prefilled (nothing indexed, still
        // in flight); more questions on it reach another thread, each staying in flight too.
        // A long document earns a holder's full slack: its siblings wait for it rather than
        // recompute it elsewhere. A short opening earns almost none: the siblings spread. In
        // the clock step of the placement only an opening of a prefill chunk or more is
        // followed: shorter siblings would be prefilled in one batch with it, reusing nothing.
        let cases = [
            (10_000, 51),
            (40, 51),
            (2_000, 51),
            (2_000, 50),
            (10_000, 50),
        ];
        let mut followed = [0usize; 5];
        for (k, &(opening, step)) in cases.iter().enumerate() {
            for g in 0..8 {
                let s = MemStore::new();
                let mut a = Router::new(cfg(""), 1);
                let mut b = Router::new(cfg(""), 2);
                a.init_store(&s);
                b.init_store(&s);
                let doc = format!("{g} {}", "word ".repeat(opening));
                let first = routed(a.route(&s, Endpoint::Chat, &chat("llama", &doc, "q"), 50));
                assert_eq!(first.reason, Reason::HashAffinity);
                for q in 0..2 {
                    let body = chat("llama", &doc, &format!("question {q}"));
                    let d = routed(b.route(&s, Endpoint::Chat, &body, step));
                    followed[k] += usize::from(d.worker == first.worker);
                }
            }
        }
        assert_eq!(
            followed[0], 16,
            "a document's siblings follow it: {followed:?}"
        );
        assert!(followed[1] < 8, "short openings spread: {followed:?}");
        assert_eq!(
            followed[2], 16,
            "a 2.5k-token opening a step later: {followed:?}"
        );
        assert!(
            followed[3] < 8,
            "... in the same step, spread: {followed:?}"
        );
        assert_eq!(followed[4], 16, "a document in the same step: {followed:?}");
    }

    #[test]
    fn a_sibling_on_another_replica_follows_a_new_opening_once_the_peers_told_it() {
        // Two replicas (their own shared data): replica A places a document's first question
        // (nothing indexed yet: still in flight); more questions reach replica B a step later.
        // Delivered, A's batch carries the placement and B's siblings follow; not delivered, B
        // places them by its own keys.
        let peers = r#","peers":{"clusters":["p"],"secret":"0123456789abcdef"}"#;
        let (mut followed, mut alone, mut sent) = (0, 0, 0);
        for deliver in [true, false] {
            for g in 0..8 {
                let (sa, sb) = (MemStore::new(), MemStore::new());
                let mut a = Router::new(cfg(peers), 1);
                let mut b = Router::new(cfg(peers), 2);
                a.init_store(&sa);
                b.init_store(&sb);
                let doc = format!("{g} {}", "word ".repeat(10_000));
                let first = routed(a.route(&sa, Endpoint::Chat, &chat("llama", &doc, "q"), 50));
                assert_eq!(first.reason, Reason::HashAffinity);
                let (_, ob) = a.outbox().unwrap();
                sent += ob.len();
                let batch = ob
                    .seal("0123456789abcdef", 7, 1, 1_700_000_000_000)
                    .to_vec();
                if deliver {
                    let got = b.receive_peer_batch(&sb, &batch, 1_700_000_000_000, 51);
                    assert_eq!(got.map(|x| x.placements), Ok(1));
                }
                for q in 0..2 {
                    let body = chat("llama", &doc, &format!("question {q}"));
                    let d = routed(b.route(&sb, Endpoint::Chat, &body, 51));
                    let same = usize::from(d.worker == first.worker);
                    if deliver {
                        followed += same;
                    } else {
                        alone += same;
                    }
                }
            }
        }
        assert_eq!(
            sent, 16,
            "one placement per new opening, no index record before the answer"
        );
        assert_eq!(followed, 16, "every sibling followed");
        assert!(
            alone < 12,
            "undelivered, the conversation keys scatter them: {alone}"
        );
    }

    #[test]
    fn quiet_vms_release_at_once_busy_vms_park_until_the_next_write() {
        let s = MemStore::new();
        let mut a = Router::new(cfg(""), 1);
        let mut b = Router::new(cfg(""), 2);
        a.init_store(&s);
        let body = chat("llama", &"quiet ".repeat(50), "u");
        // Quiet VM (no tick has seen 200 decisions/s): the release reaches shared data at once,
        // so another thread sees an idle fleet.
        let d = served(&mut a, &s, Endpoint::Chat, &body, 1);
        a.release(&s, &d);
        assert_eq!(a.pending_len(), 0);
        assert!(b.loads(&s, 0).iter().all(|&l| l == (0, 0)));
        // Busy VM: 20 decisions in a 50 ms tick = 400/s >= 200/s.
        for _ in 0..20 {
            let d = served(&mut a, &s, Endpoint::Chat, &body, 1);
            a.release(&s, &d);
        }
        a.tick(&s, 50, 1);
        let d = served(&mut a, &s, Endpoint::Chat, &body, 1);
        a.release(&s, &d);
        assert_eq!(a.pending_len(), 1);
        assert_eq!(
            b.loads(&s, 0)[usize::from(d.worker)].0,
            1,
            "parked: others see it"
        );
        assert!(
            a.loads(&s, 0).iter().all(|&l| l == (0, 0)),
            "own decisions do not"
        );
        // The next decision carries it.
        let d2 = served(&mut a, &s, Endpoint::Chat, &body, 1);
        assert_eq!(a.pending_len(), 0);
        let l = b.loads(&s, 0);
        assert_eq!(l.iter().map(|l| l.0).sum::<u32>(), 1, "{l:?}");
        a.release(&s, &d2);
        // A tick that saw 1 decision in 50 ms (20/s) flushes and makes the VM quiet again.
        a.tick(&s, 50, 1);
        assert!(b.loads(&s, 0).iter().all(|&l| l == (0, 0)));
        let d = served(&mut a, &s, Endpoint::Chat, &body, 1);
        a.release(&s, &d);
        assert_eq!(a.pending_len(), 0);
        assert!(b.loads(&s, 0).iter().all(|&l| l == (0, 0)));
    }

    #[test]
    fn contention_never_loses_a_load_delta() {
        let s = MemStore::with_conflicts(3);
        let mut r = Router::new(cfg(""), 3);
        r.init_store(&s);
        let mut ds = Vec::new();
        for i in 0..200 {
            let body = chat("llama", &format!("prefix {}", i % 7), &i.to_string());
            ds.push(served(&mut r, &s, Endpoint::Chat, &body, 9));
        }
        for d in &ds {
            r.release(&s, d);
        }
        r.flush_pending(&s);
        assert_eq!(r.pending_len(), 0);
        assert!(
            r.loads(&s, 0).iter().all(|&l| l == (0, 0)),
            "{:?}",
            r.loads(&s, 0)
        );
    }

    #[test]
    fn models_are_isolated_and_unknown_models_follow_config() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 4);
        let d = served(&mut r, &s, Endpoint::Chat, &chat("qwen", "s", "u"), 1);
        assert_eq!(d.model, 1);
        assert!(r.cluster(&d).starts_with('q'));
        let d = served(&mut r, &s, Endpoint::Chat, &chat("nope", "s", "u"), 1);
        assert_eq!((d.model, d.reason), (0, Reason::Fallback));
        let mut r = Router::new(cfg(r#","unknown_model":"reject""#), 4);
        match r.route(&s, Endpoint::Chat, &chat("no\"pe", "s", "u"), 1) {
            Outcome::Reject { status, body } => {
                assert_eq!(status, 404);
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert_eq!(v["type"], "NotFoundError");
                assert!(v["message"].as_str().unwrap().contains("no\"pe"));
            }
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn malformed_and_empty_bodies_are_routed_and_charged() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 5);
        r.init_store(&s);
        // A real prompt first, so stale per-request state would show up below.
        let d = served(
            &mut r,
            &s,
            Endpoint::Chat,
            &chat("llama", &"x".repeat(999), "u"),
            1,
        );
        assert!(d.total_blocks > 10);
        r.release(&s, &d);
        for body in [&b"{not json"[..], b"", b"[1,2]", b"{\"messages\":7}"] {
            let d = served(&mut r, &s, Endpoint::Chat, body, 1);
            assert_eq!(d.reason, Reason::ParseError);
            assert_eq!((d.total_blocks, d.matched_blocks), (0, 0));
            assert_eq!(d.charged_reqs, 1);
            r.release(&s, &d);
        }
        let d = served(&mut r, &s, Endpoint::Chat, br#"{"messages":[]}"#, 1);
        assert_eq!(d.reason, Reason::Fallback);
        r.release(&s, &d);
        assert!(r.loads(&s, 0).iter().all(|&l| l == (0, 0)));
    }

    #[test]
    fn only_a_2xx_response_keeps_records_and_tenants_never_share() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 13);
        r.init_store(&s);
        let system = "tenant data ".repeat(40);
        let body = chat("llama", &system, "u");
        // A prompt nobody holds writes nothing before its answer; a failed one, nothing at all.
        for status in [0, 199, 300, 404, 429, 500, 503] {
            let d = routed(r.route_for(&s, Endpoint::Chat, &body, b"acme", 1));
            assert_eq!(r.take_ahead_stats(), WriteStats::default());
            let plan = r.take_plan().expect("a cache-aware decision plans records");
            assert!(plan.hashes().len() >= 2);
            assert_eq!(r.commit(&s, &plan, status, 1), WriteStats::default());
            r.release(&s, &d);
        }
        let d = routed(r.route_for(&s, Endpoint::Chat, &body, b"acme", 2));
        assert_eq!(d.matched_blocks, 0, "nothing recorded for a failed request");
        let plan = r.take_plan().unwrap();
        assert!(r.commit(&s, &plan, 200, 2).writes >= 2);
        r.release(&s, &d);
        // A prompt that extends what its worker holds writes its new records at the decision;
        // a failed answer takes them back, a repeat of the failure finds nothing left to take.
        let longer = chat("llama", &system, &"a longer question ".repeat(40));
        for status in [0, 404, 503] {
            let d = routed(r.route_for(&s, Endpoint::Chat, &longer, b"acme", 20));
            let ahead = r.take_ahead_stats();
            let plan = r.take_plan().unwrap();
            assert!(ahead.writes >= 1 && plan.fresh() >= 1, "{ahead:?}");
            let back = r.commit(&s, &plan, status, 20);
            assert_eq!((back.writes, back.retracted), (0, ahead.writes), "{status}");
            assert_eq!(r.commit(&s, &plan, status, 20).retracted, 0);
            r.release(&s, &d);
        }
        // Same tenant: a hit. Another tenant or none: the same prompt matches nothing.
        let d = routed(r.route_for(&s, Endpoint::Chat, &body, b"acme", 30));
        assert!(d.matched_blocks > 0);
        r.release(&s, &d);
        for tenant in [&b"globex"[..], b""] {
            let d = routed(r.route_for(&s, Endpoint::Chat, &body, tenant, 30));
            assert_eq!((d.matched_blocks, d.probes > 0), (0, true), "{tenant:?}");
            r.release(&s, &d);
        }
    }

    #[test]
    fn a_follow_up_sees_its_previous_prompt_while_that_is_queued() {
        // A conversation's second turn is routed by one thread to the worker holding its first
        // and waits there for its prefill; the third turn reaches another thread before that
        // answer. It matches the whole second turn on the same worker, and once the second
        // turn fails, only the first.
        let s = MemStore::new();
        let mut a = Router::new(cfg(""), 1);
        let mut b = Router::new(cfg(""), 2);
        a.init_store(&s);
        b.init_store(&s);
        let body = |t: &str| format!(r#"{{"model":"llama","prompt":"{t}"}}"#).into_bytes();
        let t1 = format!(
            "{} user: the first question.",
            "A system prompt. ".repeat(40)
        );
        let t2 = format!(
            "{t1} assistant: {} user: the next one?",
            "an answer ".repeat(60)
        );
        let t3 = format!("{t2} assistant: more. user: and then?");
        let d1 = routed(a.route(&s, Endpoint::Completions, &body(&t1), 10));
        let plan = a.take_plan().unwrap();
        a.commit(&s, &plan, 200, 10);
        a.release(&s, &d1);
        let d2 = routed(a.route(&s, Endpoint::Completions, &body(&t2), 50));
        assert_eq!((d2.worker, d2.matched_blocks > 0), (d1.worker, true));
        assert!(a.take_ahead_stats().writes > 0);
        let plan = a.take_plan().unwrap();
        let d = routed(b.route(&s, Endpoint::Completions, &body(&t3), 51));
        assert_eq!((d.worker, d.reason), (d1.worker, Reason::PrefixHit));
        // (At its deepest checkpoint: the turn's last block is partial.)
        assert!(
            d.matched_blocks * 3 >= d2.total_blocks * 2 && d.matched_blocks > d2.matched_blocks,
            "{} of {} (the first turn: {})",
            d.matched_blocks,
            d2.total_blocks,
            d2.matched_blocks
        );
        b.release(&s, &d);
        let _ = b.take_plan();
        assert!(a.commit(&s, &plan, 503, 52).retracted >= 1);
        a.release(&s, &d2);
        // (Past the other thread's probe cache, `index.local_cache_ms`.)
        let d = routed(b.route(&s, Endpoint::Completions, &body(&t3), 70));
        assert_eq!(
            d.matched_blocks, d2.matched_blocks,
            "the failed turn left nothing"
        );
    }

    #[test]
    fn a_follow_up_served_by_a_fallback_host_is_recorded_for_that_host_only() {
        // The second turn's records are written ahead for the worker chosen, then a fallback
        // host serves it: they are taken back, and the 2xx records the turn for the host that
        // served.
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 1);
        r.init_store(&s);
        let body = |t: &str| format!(r#"{{"model":"llama","prompt":"{t}"}}"#).into_bytes();
        let t1 = format!("{} user: first.", "A system prompt. ".repeat(40));
        let t2 = format!("{t1} assistant: {} user: next?", "an answer ".repeat(60));
        let d1 = routed(r.route(&s, Endpoint::Completions, &body(&t1), 10));
        let plan = r.take_plan().unwrap();
        r.commit(&s, &plan, 200, 10);
        r.release(&s, &d1);
        let d2 = routed(r.route(&s, Endpoint::Completions, &body(&t2), 50));
        assert_eq!(d2.worker, d1.worker);
        let ahead = r.take_ahead_stats();
        assert!(ahead.writes > 0);
        let mut plan = r.take_plan().unwrap();
        let other = (d1.worker + 1) % 4;
        assert_eq!(r.abandon(&s, &plan).retracted, ahead.writes);
        plan.move_to(r.worker_id(0, other));
        assert!(plan.written_ahead().next().is_none());
        assert_eq!(plan.due_at_answer().len(), plan.hashes().len());
        r.commit(&s, &plan, 200, 50);
        r.release(&s, &d2);
        // (Past the probe cache, `index.local_cache_ms`.)
        let d = routed(r.route(&s, Endpoint::Completions, &body(&t2), 80));
        assert_eq!((d.worker, d.reason), (other, Reason::PrefixHit));
        assert!(d.matched_blocks > d2.matched_blocks, "{d:?}");
        r.release(&s, &d);
    }

    #[test]
    fn salted_prompts_never_match_each_other_and_no_salt_hashes_as_before() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 13);
        r.init_store(&s);
        let text = "salted document ".repeat(40);
        let with = |salt: serde_json::Value, ep: Endpoint| {
            let mut v = match ep {
                Endpoint::Chat => serde_json::json!({"model": "llama", "messages": [
                    {"role": "system", "content": text}, {"role": "user", "content": "u"}]}),
                _ => serde_json::json!({"model": "llama", "prompt": text}),
            };
            if !salt.is_null() {
                v["cache_salt"] = salt;
            }
            v.to_string().into_bytes()
        };
        for ep in [Endpoint::Chat, Endpoint::Completions] {
            let a = with(serde_json::json!("tenant-a"), ep);
            served(&mut r, &s, ep, &a, 1);
            let d = routed(r.route(&s, ep, &a, 2));
            assert!(d.matched_blocks > 0, "the same salt matches");
            r.release(&s, &d);
            // Another salt, or none: nothing matches.
            for other in [serde_json::json!("tenant-b"), serde_json::Value::Null] {
                let d = routed(r.route(&s, ep, &with(other.clone(), ep), 2));
                assert_eq!(d.matched_blocks, 0, "{other}");
                r.release(&s, &d);
            }
        }
        // No salt, a null salt and an empty salt hash as a body without the field.
        let plain = chat("llama", &text, "u");
        served(&mut r, &s, Endpoint::Chat, &plain, 3);
        for salt in [serde_json::Value::Null, serde_json::json!("")] {
            let mut v: serde_json::Value = serde_json::from_slice(&plain).unwrap();
            v["cache_salt"] = salt.clone();
            let d = routed(r.route(&s, Endpoint::Chat, v.to_string().as_bytes(), 4));
            assert!(d.matched_blocks > 0, "{salt}");
            r.release(&s, &d);
        }
        // A salt that is not a string: a malformed body, routed (parse_error), never dropped.
        for bad in [
            serde_json::json!(5),
            serde_json::json!(["x"]),
            serde_json::json!({}),
        ] {
            let body = with(bad.clone(), Endpoint::Chat);
            let d = routed(r.route(&s, Endpoint::Chat, &body, 5));
            assert_eq!(d.reason, Reason::ParseError, "{bad}");
            r.release(&s, &d);
        }
    }

    #[test]
    fn the_hash_key_moves_every_bucket() {
        // Without the key a client cannot tell which buckets its prompts hit: the same prompt
        // lands in unrelated buckets under two keys.
        let body = chat("llama", &"grind me ".repeat(40), "u");
        let mut keys = Vec::new();
        for k in [
            "",
            r#","hash_key":"0123456789abcdef""#,
            r#","hash_key":"0123456789abcdeg""#,
        ] {
            let s = MemStore::new();
            let mut r = Router::new(cfg(&format!(r#","index":{{"capacity":1048576}}{k}"#)), 14);
            let d = served(&mut r, &s, Endpoint::Chat, &body, 1);
            assert!(d.total_blocks > 4);
            let mut ks: Vec<String> = s
                .keys()
                .into_iter()
                .filter(|k| k.starts_with("pr/i"))
                .collect();
            ks.sort();
            keys.push(ks);
        }
        assert!(keys.iter().all(|k| k.len() >= 4));
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert!(a.iter().all(|k| !b.contains(k)), "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn reloads_never_orphan_the_index() {
        let s = MemStore::new();
        let body = |i: u32| chat("a", &format!("prompt {i} ").repeat(30), "u");
        let idx_keys = |s: &MemStore| {
            s.keys()
                .into_iter()
                .filter(|k| k.starts_with(crate::index::KEY_PREFIX))
                .count()
        };
        // 1024 buckets, filled.
        let big = r#"{"models":{"a":{"workers":["w0","w1"]}},"index":{"capacity":4096}}"#;
        let mut r = Router::new(Config::from_json(big.as_bytes()).unwrap(), 1);
        r.init_store(&s);
        for i in 0..3000 {
            served(&mut r, &s, Endpoint::Chat, &body(i), 1);
        }
        let used = idx_keys(&s);
        assert!(used > 900, "{used}");
        // The model renamed: the same table, no new keys beyond its size.
        let renamed = r#"{"models":{"b":{"workers":["w0","w1"]}},"index":{"capacity":4096}}"#;
        let mut r = Router::new(Config::from_json(renamed.as_bytes()).unwrap(), 2);
        r.init_store(&s);
        for i in 0..3000 {
            served(
                &mut r,
                &s,
                Endpoint::Chat,
                &chat("b", &format!("p {i} ").repeat(30), "u"),
                1,
            );
        }
        assert!(idx_keys(&s) <= 1024 + 1, "{}", idx_keys(&s));
        // Capacity shrunk to 64 buckets: the rest is emptied over a few ticks.
        let small = r#"{"models":{"b":{"workers":["w0","w1"]}},"index":{"capacity":256}}"#;
        let mut r = Router::new(Config::from_json(small.as_bytes()).unwrap(), 3);
        r.init_store(&s);
        for _ in 0..8 {
            r.tick(&s, 50, 1);
        }
        let mut buf = Vec::new();
        let live = s
            .keys()
            .into_iter()
            .filter(|k| {
                k.starts_with(crate::index::KEY_PREFIX) && k.as_str() != crate::index::SIZE_KEY
            })
            .filter(|k| s.get(k, &mut buf).is_some() && !buf.is_empty())
            .count();
        assert!(live <= 64, "{live} buckets still hold data");
        // A second VM of the same config cleans nothing more and reads the same table.
        let mut r2 = Router::new(Config::from_json(small.as_bytes()).unwrap(), 4);
        r2.init_store(&s);
        assert!(r2.shrink.is_none());
    }

    #[test]
    fn the_prompt_charge_ends_at_the_first_token_and_the_request_charge_at_the_stream_end() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 1);
        r.init_store(&s);
        let mut d = served(
            &mut r,
            &s,
            Endpoint::Chat,
            &chat("llama", &"x".repeat(4000), "hi"),
            1,
        );
        let (w, mi) = (usize::from(d.worker), usize::from(d.model));
        assert!(d.charged_tokens >= 1000, "{d:?}");
        assert_eq!(r.ledger.own(&s, &r.cfg, mi)[w], (1, d.charged_tokens));
        // The first response headers: the request is decoding, no longer queued prefill.
        let tokens = d.take_prompt_tokens().expect("tokens charged");
        r.release(&s, &tokens);
        assert_eq!(d.charged_tokens, 0);
        assert_eq!(r.ledger.own(&s, &r.cfg, mi)[w], (1, 0));
        let (reqs, tokens) = r.ledger.view(&s, &r.cfg, mi, 1);
        assert_eq!((reqs[w], tokens[w]), (1, 0), "what the next decision sees");
        // Twice there is nothing left; the stream end releases the request only.
        assert_eq!(d.take_prompt_tokens(), None);
        r.release(&s, &d);
        assert_eq!(r.ledger.own(&s, &r.cfg, mi)[w], (0, 0));
        assert_eq!(r.ledger.take_underflows(), 0);
    }

    #[test]
    fn a_client_cannot_inflate_the_load_charge() {
        let s = MemStore::new();
        let mut r = Router::new(
            cfg(r#","policy":{"media_part_tokens":500,"max_request_tokens":100000}"#),
            12,
        );
        r.init_store(&s);
        let junk = "j".repeat(1 << 20);
        // A 1 MiB junk field in a content part, a 1 MiB name and a 1 MiB image URL.
        let body = format!(
            r#"{{"model":"llama","messages":[{{"role":"user","name":"{junk}","content":[{{"type":"text","text":"hi there"}},{{"type":"image_url","image_url":{{"url":"http://x/{junk}"}}}},{{"type":"x","x":"{junk}"}}]}}]}}"#
        );
        let d = served(&mut r, &s, Endpoint::Chat, body.as_bytes(), 1);
        assert!(d.charged_tokens <= 1000 + 4, "charged {}", d.charged_tokens);
        r.release(&s, &d);
        // 4M token ids: capped per request.
        let ids = vec!["7"; 4_000_000].join(",");
        let body = format!(r#"{{"model":"llama","prompt":[{ids}]}}"#);
        let d = served(&mut r, &s, Endpoint::Completions, body.as_bytes(), 1);
        assert_eq!(d.charged_tokens, 100_000);
        r.release(&s, &d);
        // A malformed 4 MiB body is capped too.
        let d = routed(r.route(&s, Endpoint::Chat, &vec![b'{'; 4 << 20], 1));
        assert_eq!(d.charged_tokens, 100_000);
        r.release(&s, &d);
        assert!(r.loads(&s, 0).iter().all(|&l| l == (0, 0)));
    }

    #[test]
    fn comparison_policies_rotate_and_spread() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(r#","policy":{"name":"round_robin"}"#), 6);
        let ws: Vec<u16> = (0..8)
            .map(|_| routed(r.route(&s, Endpoint::Completions, br#"{"prompt":"same"}"#, 1)).worker)
            .collect();
        assert_eq!(
            ws[..4]
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len(),
            4
        );
        assert_eq!(ws[..4], ws[4..]);
        let mut r = Router::new(cfg(r#","policy":{"name":"random"}"#), 7);
        let mut seen = [0; 4];
        for _ in 0..400 {
            let d = served(
                &mut r,
                &s,
                Endpoint::Completions,
                br#"{"prompt":"same"}"#,
                1,
            );
            assert_eq!(d.reason, Reason::Random);
            seen[usize::from(d.worker)] += 1;
        }
        assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
    }

    #[test]
    fn removed_workers_are_never_chosen_after_reload() {
        let s = MemStore::new();
        let mut old = Router::new(cfg(""), 8);
        old.init_store(&s);
        let body = chat("llama", &"held by someone ".repeat(20), "u");
        let d = served(&mut old, &s, Endpoint::Chat, &body, 1);
        let holder = old.cluster(&d).to_string();
        old.release(&s, &d);
        // New config without the holder: its index entries must be ignored.
        let others: Vec<String> = ["w0", "w1", "w2", "w3"]
            .iter()
            .filter(|w| **w != holder)
            .map(|w| format!("\"{w}\""))
            .collect();
        let json = format!(
            r#"{{"models":{{"llama":{{"workers":[{}]}}}}}}"#,
            others.join(",")
        );
        let mut new = Router::new(Config::from_json(json.as_bytes()).unwrap(), 9);
        new.init_store(&s);
        for _ in 0..20 {
            let d = served(&mut new, &s, Endpoint::Chat, &body, 2);
            assert_ne!(new.cluster(&d), holder);
            new.release(&s, &d);
        }
    }

    #[test]
    fn multi_turn_matches_the_whole_previous_turn() {
        let s = MemStore::new();
        let mut r = Router::new(cfg(""), 11);
        r.init_store(&s);
        let mut msgs = vec![serde_json::json!({"role": "system", "content": "sys ".repeat(300)})];
        let mut prev_blocks = 0u32;
        let mut worker = None;
        for turn in 0..5 {
            msgs.push(serde_json::json!({"role": "user", "content": format!("question {turn} ").repeat(20)}));
            let body = serde_json::json!({"model": "llama", "messages": &msgs}).to_string();
            let d = served(&mut r, &s, Endpoint::Chat, body.as_bytes(), 1);
            if turn > 0 {
                assert_eq!(Some(d.worker), worker, "turn {turn} stays");
                assert!(
                    d.matched_blocks >= prev_blocks,
                    "turn {turn}: matched {} < previous turn's {prev_blocks} full blocks",
                    d.matched_blocks
                );
            }
            worker = Some(d.worker);
            r.release(&s, &d);
            let mut canon = Vec::new();
            request::parse(Endpoint::Chat, body.as_bytes(), &mut canon, 1 << 20).unwrap();
            prev_blocks = (canon.len() / 64) as u32;
            msgs.push(serde_json::json!({"role": "assistant", "content": format!("answer {turn} ").repeat(15)}));
        }
    }

    const PD: &str = r#"{"models":{"m":{
        "prefill":[{"cluster":"p0","bootstrap_host":"10.0.0.1","bootstrap_port":9001},
                   {"cluster":"p1","bootstrap_host":"10.0.0.2"}],
        "decode":["d0","d1"]}}}"#;

    #[test]
    fn two_vms_configured_at_the_same_clock_reading_draw_different_rooms() {
        let store = MemStore::default();
        let body = br#"{"model":"m","prompt":"hello"}"#;
        let mut rooms = std::collections::HashSet::new();
        for _ in 0..2 {
            // the same seed: Envoy may hand two worker threads' VMs the same time
            let mut r = Router::new(Config::from_json(PD.as_bytes()).unwrap(), 5);
            r.init_store(&store);
            for _ in 0..64 {
                let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
                    panic!("rejected");
                };
                assert!(r.rewrite_for_prefill(&p, body).unwrap().is_ok());
                let v: Value = serde_json::from_slice(r.rewritten().body()).unwrap();
                assert!(
                    rooms.insert(v["bootstrap_room"].as_u64().unwrap()),
                    "a room repeats"
                );
                r.release(&store, &p);
            }
        }
    }

    /// A router over the `PD` model and its store.
    fn pd_router() -> (Router, MemStore) {
        let store = MemStore::default();
        let mut r = Router::new(Config::from_json(PD.as_bytes()).unwrap(), 5);
        r.init_store(&store);
        (r, store)
    }

    #[test]
    fn prefill_by_cache_and_load_decode_by_load_both_released() {
        let (mut r, store) = pd_router();
        let body = br#"{"model":"m","prompt":"a long shared prefix that spans several blocks of text for the index to remember it, twice over and over again"}"#;
        // one at a time: the same prompt stays on its prefill worker (prefix hit)
        let mut prefills = Vec::new();
        for _ in 0..4 {
            let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
                panic!("rejected");
            };
            // The index records once the response is a 2xx (router::Router::commit).
            if let Some(plan) = r.take_plan() {
                r.commit(&store, &plan, 200, 10);
            }
            let d = r.decode_decision(&store, &p, 400, 10).unwrap();
            assert_eq!(usize::from(d.model), 1);
            assert!(r.rewrite_for_prefill(&p, body).unwrap().is_ok());
            let v: Value = serde_json::from_slice(r.rewritten().body()).unwrap();
            assert_eq!(v["model"], "m");
            assert!(v["bootstrap_room"].as_u64().unwrap() < 1 << 63);
            prefills.push((p.worker, p.reason));
            r.release(&store, &p);
            r.release(&store, &d);
        }
        assert!(
            prefills.iter().all(|w| w.0 == prefills[0].0),
            "{prefills:?}"
        );
        assert_eq!(prefills[3].1, Reason::PrefixHit);
        // held together: decode spreads by load, two each
        let mut held = Vec::new();
        for _ in 0..4 {
            let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
                panic!("rejected");
            };
            let d = r.decode_decision(&store, &p, 400, 10).unwrap();
            held.push((p, d));
        }
        let on0 = held.iter().filter(|(_, d)| d.worker == 0).count();
        assert_eq!(on0, 2);
        for (p, d) in &held {
            r.release(&store, p);
            r.release(&store, d);
        }
        r.flush_pending(&store);
        for mi in 0..2 {
            let (reqs, toks) = r.ledger.view(&store, &r.cfg, mi, 10);
            assert!(reqs.iter().all(|&x| x == 0), "model {mi}: {reqs:?}");
            assert!(toks.iter().all(|&x| x == 0), "model {mi}: {toks:?}");
        }
        // a non-PD model has no decode half
        let c = Config::from_json(br#"{"models":{"m":{"workers":["a"]}}}"#).unwrap();
        let mut r = Router::new(c, 5);
        r.init_store(&store);
        let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
            panic!()
        };
        assert!(r.decode_decision(&store, &p, 1, 10).is_none());
        assert!(r.rewrite_for_prefill(&p, body).is_none());
    }

    #[test]
    fn a_client_cannot_inflate_the_decode_charge() {
        let (mut r, store) = pd_router();
        let body = br#"{"model":"m","prompt":"hello"}"#;
        let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
            panic!("rejected");
        };
        // A 16 MiB body (a junk field): charged at most max_request_tokens, not 4M tokens.
        let d = r.decode_decision(&store, &p, 16 << 20, 10).unwrap();
        assert_eq!(d.charged_tokens, r.cfg.policy.max_request_tokens);
        r.release(&store, &p);
        r.release(&store, &d);
    }
}
