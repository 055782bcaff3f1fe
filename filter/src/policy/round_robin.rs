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
        // Kept below the worker count, so the rotation never wraps (a free-running counter
        // skipped positions when it wrapped at 2^32 on wasm32, 2^32 mod n being non-zero).
        let n = inp.model.workers.len().max(1);
        self.next = (self.next % n + 1) % n;
        (self.next, Reason::RoundRobin)
    }
    fn uses_index(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::shared_tests::{inputs, model};

    #[test]
    fn rotation_stays_in_range_and_in_order_from_any_state() {
        let m = model(3);
        let z = [0u32; 3];
        let inp = inputs(&m, &z, &z, &z, 0);
        let mut rr = RoundRobin { next: usize::MAX };
        let p = PolicyConfig::default();
        let seq: Vec<usize> = (0..6).map(|_| rr.choose(&p, &inp).0).collect();
        // usize::MAX % 3 == 0 on both 32- and 64-bit targets: the next is 1, then in turn.
        assert_eq!(seq, vec![1, 2, 0, 1, 2, 0]);
    }
}
