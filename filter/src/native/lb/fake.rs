//! An in-memory Envoy for the LB's unit tests: members by address, which are unhealthy, which
//! this request tried, requests in flight, the request's destination header; counts address
//! reads (what a rebuild costs).

use super::hosts::LbHost;
use std::cell::Cell;
use std::collections::HashSet;

#[derive(Default)]
pub(crate) struct FakeLb {
    pub(crate) hosts: Vec<String>,
    /// Member positions Envoy holds unhealthy.
    pub(crate) unhealthy: HashSet<usize>,
    /// Member positions the retry predicate rejects.
    pub(crate) tried: HashSet<usize>,
    pub(crate) active: Vec<u64>,
    pub(crate) header: Option<String>,
    pub(crate) address_reads: Cell<usize>,
    /// Reading the header panics (the panic guard's test).
    pub(crate) panics: bool,
}

impl FakeLb {
    pub(crate) fn new(hosts: &[&str]) -> FakeLb {
        FakeLb {
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ..FakeLb::default()
        }
    }

    fn healthy(&self) -> impl Iterator<Item = &String> {
        self.hosts
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.unhealthy.contains(i))
            .map(|(_, h)| h)
    }
}

impl LbHost for FakeLb {
    fn header(&self, name: &[u8]) -> Option<&[u8]> {
        assert!(!self.panics, "a fault inside the LB");
        assert_eq!(name, b"x-gateway-destination-endpoint");
        self.header.as_deref().map(str::as_bytes)
    }
    fn hosts_count(&self) -> usize {
        self.hosts.len()
    }
    fn healthy_count(&self) -> usize {
        self.healthy().count()
    }
    fn host_address(&self, i: usize) -> Option<&[u8]> {
        self.address_reads.set(self.address_reads.get() + 1);
        self.hosts.get(i).map(|h| h.as_bytes())
    }
    fn healthy_address(&self, i: usize) -> Option<&[u8]> {
        self.address_reads.set(self.address_reads.get() + 1);
        self.healthy().nth(i).map(|h| h.as_bytes())
    }
    fn rejected(&self, i: usize) -> bool {
        self.tried.contains(&i)
    }
    fn active_requests(&self, i: usize) -> u64 {
        self.active.get(i).copied().unwrap_or(0)
    }
}
