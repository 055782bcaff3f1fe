//! What the router decides for one request: a [`Decision`] (small and `Copy`, so a stream keeps
//! it until it ends and releases exactly what was charged), the [`Outcome`] the glue acts on, and
//! how a decision reads in the debug header ([`Router::debug_value`]).

use super::Router;
use crate::policy::Reason;

/// What was decided for a request; small and `Copy` so the stream context can keep it until the
/// stream ends and release exactly what was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub model: u16,
    pub worker: u16,
    pub reason: Reason,
    pub matched_blocks: u32,
    pub total_blocks: u32,
    /// Load charged to the worker: the request until the stream ends, its estimated uncached
    /// prompt tokens (queued prefill) until the first response headers
    /// ([`Decision::take_prompt_tokens`]); 0/0 when nothing was charged.
    pub charged_reqs: u32,
    pub charged_tokens: u32,
    pub probes: u32,
    pub truncated: bool,
    /// The deepest holder's load as the decision saw it (for the debug header); `None` when
    /// nobody held the prompt.
    pub holder: Option<HolderLoad>,
}

impl Decision {
    /// The one way to make a decision: worker `worker` of model `model` for `reason`, nothing
    /// charged, matched or probed yet (a passthrough pick stays so; routed decisions add their
    /// charge with [`Decision::with_charge`] and their match fields).
    pub fn uncharged(model: usize, worker: usize, reason: Reason) -> Decision {
        Decision {
            model: model as u16,
            worker: worker as u16,
            reason,
            matched_blocks: 0,
            total_blocks: 0,
            charged_reqs: 0,
            charged_tokens: 0,
            probes: 0,
            truncated: false,
            holder: None,
        }
    }

    /// This decision charging its worker `reqs` requests and `tokens` prompt tokens.
    pub fn with_charge(mut self, reqs: u32, tokens: u32) -> Decision {
        self.charged_reqs = reqs;
        self.charged_tokens = tokens;
        self
    }

    /// Takes the prompt-token part out of the charge (`None` when there is none left), for
    /// [`Router::release`] when the worker answers: a streamed SGLang answer starts with its
    /// first token, so from then on the request is decoding, not queued prefill work, and a new
    /// request on that worker no longer waits for it (`docs/design.md`, "Queued prefill"). The
    /// request stays charged: the stream's end releases what is left of `self`.
    pub fn take_prompt_tokens(&mut self) -> Option<Decision> {
        let tokens = std::mem::take(&mut self.charged_tokens);
        (tokens > 0).then_some(self.with_charge(0, tokens))
    }
}

/// A worker's load as one decision saw it: requests in flight, its running-request capacity
/// (0: not reported) and its queued prefill tokens; with the requests that lately reached the
/// same deepest held prefix (`sharers.rs`, rounded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HolderLoad {
    pub worker: u16,
    /// The prompt blocks it holds (the deepest match).
    pub blocks: u32,
    pub reqs: u32,
    pub capacity: u32,
    pub tokens: u32,
    pub sharers: u16,
}

/// The filter's answer for an inference request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Route(Decision),
    /// Answer locally with this status and OpenAI-style JSON body.
    Reject {
        status: u32,
        body: String,
    },
    /// A pool model with no known worker yet (`membership.rs`): its cluster's own fallback
    /// policy picks the host; nothing is charged. The prompt's records are planned for the host
    /// that serves ([`Router::commit_served`]), written once membership names it.
    Unplaced {
        model: u16,
    },
}

impl Router {
    /// The debug header's value: the worker that served (`d`'s), why, the matched and total
    /// blocks, the decode worker of a PD pair, the deepest holder, the blocks it holds and its
    /// load as the decision saw it (requests / capacity, 0: not reported / queued prefill
    /// tokens), and the worker first chosen when a fallback served (`chosen`).
    pub fn debug_value(
        &self,
        d: &Decision,
        decode: Option<&Decision>,
        chosen: Option<u16>,
    ) -> String {
        use std::fmt::Write;
        let mut v = String::with_capacity(96);
        let _ = write!(
            v,
            "worker={}; reason={}; matched={}; total={}",
            self.cluster(d),
            d.reason.as_str(),
            d.matched_blocks,
            d.total_blocks
        );
        if let Some(dec) = decode {
            let _ = write!(v, "; decode={}", self.cluster(dec));
        }
        if let Some(hl) = d.holder {
            let at = Decision {
                worker: hl.worker,
                ..*d
            };
            let _ = write!(
                v,
                "; holder={}; held={}; holder_load={}/{}/{}; sharers={}",
                self.cluster(&at),
                hl.blocks,
                hl.reqs,
                hl.capacity,
                hl.tokens,
                hl.sharers
            );
        }
        if let Some(c) = chosen {
            let first = Decision { worker: c, ..*d };
            let _ = write!(v, "; chosen={}", self.cluster(&first));
        }
        v
    }
}

/// OpenAI-style 404 body for an unknown model.
pub fn not_found_body(model: &str) -> String {
    let msg = format!("The model `{model}` does not exist.");
    let msg = serde_json::to_string(&msg).unwrap_or_else(|_| "\"model not found\"".into());
    format!(
        "{{\"object\":\"error\",\"message\":{msg},\"type\":\"NotFoundError\",\"param\":\"model\",\"code\":404}}"
    )
}
