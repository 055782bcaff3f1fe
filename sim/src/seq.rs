//! What the scheduler is handed (`SimRequest`, via `Cmd`), what it sends back (`Progress`) and
//! what it keeps per request while it waits, is prefilled in chunks or runs (`Seq`).

use std::borrow::Cow;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use crate::radix::NodeId;

/// SGLang's `SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`: KV reserved per request at most this many
/// output tokens (the request may still generate more).
pub const CLIP_MAX_NEW_TOKENS: usize = 4096;

/// Progress of one request, sent by the scheduler (cumulative values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Index of the request within its HTTP request (batches).
    pub index: usize,
    /// Prompt tokens served from the cache.
    pub cached: usize,
    /// Output tokens produced so far.
    pub generated: usize,
    /// Generation is complete.
    pub finished: bool,
}

/// A request handed to the scheduler.
#[derive(Debug)]
pub struct SimRequest {
    pub index: usize,
    pub prompt: Vec<u32>,
    /// The full planned output (the scheduler only decides *when* tokens appear).
    pub output: Vec<u32>,
    /// The request's output limit (`max_new_tokens`), which KV admission reserves for; the
    /// planned output may stop earlier (EOS).
    pub max_new: usize,
    pub tx: mpsc::UnboundedSender<Progress>,
    pub arrival: Instant,
    /// PD decode: the prompt's KV came from a prefill worker (no prefill compute here);
    /// the value is the prefill worker's cached prompt tokens, reported instead of ours.
    pub prefilled: Option<usize>,
}

/// Commands to the scheduler task.
#[derive(Debug)]
pub enum Cmd {
    Submit(SimRequest),
    /// Flush the cache; answers `false` (and does nothing) while requests run or wait.
    Flush(oneshot::Sender<bool>),
}

/// A request inside the scheduler: waiting, being prefilled in chunks, or running.
pub(crate) struct Seq {
    pub(crate) req: SimRequest,
    /// Output tokens produced (and sent) so far; kept across a retraction.
    pub(crate) generated: usize,
    /// Prompt tokens served from the cache at the first admission (reported in `usage`).
    pub(crate) cached: Option<usize>,
    /// Was retracted at least once (SGLang's `retracted_stain`: its re-prefill is left out of
    /// the cache hit rate).
    pub(crate) retracted: bool,
    /// Waiting: tokens of `fill` not in the cache, estimated when it arrives and refreshed at
    /// every prefill attempt (SGLang's `num_matched_prefix_tokens`).
    pub(crate) uncached: usize,
    /// Locked cache node (chunked or running).
    pub(crate) node: Option<NodeId>,
    /// Tokens of `fill` whose KV is in the tree (prefilled so far).
    pub(crate) done: usize,
    pub(crate) last_token: Instant,
}

impl Seq {
    pub(crate) fn new(req: SimRequest, uncached: usize) -> Self {
        Seq {
            req,
            generated: 0,
            cached: None,
            retracted: false,
            uncached,
            node: None,
            done: 0,
            last_token: Instant::now(),
        }
    }

    /// What a prefill computes: the prompt plus, after a retraction, the tokens generated so far
    /// (SGLang's `fill_ids = origin_input_ids + output_ids`).
    pub(crate) fn fill(&self) -> Cow<'_, [u32]> {
        if self.generated == 0 {
            Cow::Borrowed(&self.req.prompt)
        } else {
            let n = self.generated.min(self.req.output.len());
            let mut v = Vec::with_capacity(self.req.prompt.len() + n);
            v.extend_from_slice(&self.req.prompt);
            v.extend_from_slice(&self.req.output[..n]);
            Cow::Owned(v)
        }
    }

    pub(crate) fn fill_len(&self) -> usize {
        self.req.prompt.len() + self.generated
    }

    /// Running: KV held outside the radix tree, one token per decode step since its prefill.
    pub(crate) fn held(&self) -> usize {
        self.fill_len().saturating_sub(1 + self.done)
    }

    /// Output tokens the KV budget still reserves for (SGLang clips the estimate at 4096).
    pub(crate) fn max_new_left(&self) -> usize {
        self.req
            .max_new
            .saturating_sub(self.generated)
            .min(CLIP_MAX_NEW_TOKENS)
    }

    pub(crate) fn reported_cached(&self) -> usize {
        self.req.prefilled.unwrap_or(self.cached.unwrap_or(0))
    }
}
