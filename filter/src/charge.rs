//! The load one stream holds, and when each part of it is given back.
//!
//! A routed request charges its worker's load (`load.rs`): one request and its estimated
//! uncached prompt tokens; a PD request charges a prefill and a decode worker. The parts end at
//! different times, and each must be released exactly once, whatever way the stream ends
//! (response complete, client reset, local reply, a panic the native guard caught):
//! - **at the first response headers** ([`Due::Answer`]): a PD stream's whole prefill half (the
//!   decode worker answers only once it has the prefill's KV), or a plain stream's prompt tokens
//!   (SGLang answers with the first token: the request is decoding, no longer queued prefill);
//! - **at the stream's end** ([`Due::End`]): everything left (the decode half first, then the
//!   routed worker's remaining charge).
//!
//! [`Charge::take`] takes the part out, so a second call finds nothing: exactly once holds by
//! construction, and the glue has one release path for all of them (`glue::Stream::release`).
//! Costs: a few copies of a small `Copy` value; no allocation, no host call.

use crate::router::Decision;

/// When part of a charge is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// The stream's first response headers.
    Answer,
    /// The stream ended.
    End,
}

/// What a stream still owes the load ledger; empty when nothing was charged (passthrough,
/// rejected, peer batch) or everything was given back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// The routed worker's charge: the whole decision (plain models) or the prefill half (PD).
    pub routed: Option<Decision>,
    /// PD models: the decode half.
    pub decode: Option<Decision>,
}

impl Charge {
    /// Takes out the parts due `at` (at most two; `None` for a part not due or not held).
    pub fn take(&mut self, at: Due) -> [Option<Decision>; 2] {
        match at {
            Due::Answer if self.decode.is_some() => [self.routed.take(), None],
            Due::Answer => [
                self.routed.as_mut().and_then(Decision::take_prompt_tokens),
                None,
            ],
            Due::End => [self.decode.take(), self.routed.take()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Reason;

    fn charged(worker: u16, reqs: u32, tokens: u32) -> Decision {
        Decision::uncharged(0, usize::from(worker), Reason::PrefixHit).with_charge(reqs, tokens)
    }

    /// Sums (requests, tokens) over every part given back, answered or not, answered twice.
    fn given_back(mut c: Charge, answers: usize) -> (u32, u32) {
        let mut parts = Vec::new();
        for _ in 0..answers {
            parts.extend(c.take(Due::Answer));
        }
        parts.extend(c.take(Due::End));
        parts.extend(c.take(Due::End));
        assert_eq!(c, Charge::default(), "nothing left after the end");
        parts.into_iter().flatten().fold((0, 0), |(r, t), d| {
            (r + d.charged_reqs, t + d.charged_tokens)
        })
    }

    #[test]
    fn every_part_is_given_back_exactly_once() {
        let plain = Charge {
            routed: Some(charged(1, 1, 900)),
            decode: None,
        };
        let pd = Charge {
            routed: Some(charged(1, 1, 900)),
            decode: Some(charged(2, 1, 900)),
        };
        for answers in 0..3 {
            assert_eq!(given_back(plain, answers), (1, 900));
            assert_eq!(given_back(pd, answers), (2, 1800));
        }
        assert_eq!(given_back(Charge::default(), 1), (0, 0));
    }

    #[test]
    fn the_answer_releases_the_prompt_tokens_or_the_prefill_half() {
        let mut plain = Charge {
            routed: Some(charged(1, 1, 900)),
            decode: None,
        };
        assert_eq!(plain.take(Due::Answer), [Some(charged(1, 0, 900)), None]);
        assert_eq!(plain.take(Due::Answer), [None, None]);
        assert_eq!(plain.take(Due::End), [None, Some(charged(1, 1, 0))]);
        let mut pd = Charge {
            routed: Some(charged(1, 1, 900)),
            decode: Some(charged(2, 1, 50)),
        };
        assert_eq!(pd.take(Due::Answer), [Some(charged(1, 1, 900)), None]);
        assert_eq!(pd.take(Due::End), [Some(charged(2, 1, 50)), None]);
    }
}
