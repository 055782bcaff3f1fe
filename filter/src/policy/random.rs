//! `random`: a uniformly random worker (a comparison baseline: no index, no bound).

use super::{next_random, Inputs, Policy, Reason};
use crate::config::PolicyConfig;

pub struct Random {
    rng: u64,
}

impl Random {
    pub fn new(seed: u64) -> Random {
        Random { rng: seed | 1 }
    }
}

impl Policy for Random {
    fn choose(&mut self, _p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
        let n = inp.model.workers.len().max(1) as u64;
        ((next_random(&mut self.rng) % n) as usize, Reason::Random)
    }
    fn uses_index(&self) -> bool {
        false
    }
}
