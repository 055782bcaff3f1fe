//! `round_robin`: the next worker in turn, per VM (a comparison baseline: no index, no bound).

use super::{Inputs, Policy, Reason};
use crate::config::PolicyConfig;

pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// Starts at a seed-dependent position so the VMs of one Envoy do not rotate in lockstep.
    pub fn new(seed: u64) -> RoundRobin {
        RoundRobin {
            next: (seed % 1024) as usize,
        }
    }
}

impl Policy for RoundRobin {
    fn choose(&mut self, _p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
        self.next = self.next.wrapping_add(1);
        (
            self.next % inp.model.workers.len().max(1),
            Reason::RoundRobin,
        )
    }
    fn uses_index(&self) -> bool {
        false
    }
}
