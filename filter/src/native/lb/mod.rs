//! The native module as the pool cluster's load balancer (Envoy 1.40's
//! `envoy.load_balancing_policies.dynamic_modules`, alpha in Envoy; opt-in with
//! `envoy/gen --native --native-lb`): Envoy asks it for a host on every attempt, and it
//! answers from the hosts the filter listed (its choice, then the next holders by cached
//! prefix) in the destination header, skipping hosts the request already tried and hosts Envoy
//! holds unhealthy (`pick.rs`). Same `.so` as the filter (`libprefix_router.so`).
//!
//! The rooms: [`abi`] (the LB callbacks, checked against the 1.40 binary), [`hosts`] (what the
//! LB sees of Envoy, behind `LbHost`, and the address table), [`pick`] (the choice), [`exports`]
//! (the hooks, the config, the counters, the panic guard).
//!
//! Why the header and not filter state: the 1.40 LB context reads request headers, the hash
//! key, the override host and the retry predicates only (no filter state, no dynamic metadata),
//! and the header is what the filter writes already. The LB cannot write back what it picked
//! either, so crediting the worker that served still reads `upstream.address` in the filter
//! (`served.rs`); docs/performance.md records what the LB costs against override_host.

pub(crate) mod abi;
mod exports;
pub(crate) mod hosts;
mod pick;

#[cfg(test)]
mod fake;
