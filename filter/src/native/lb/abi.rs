//! The load-balancer half of Envoy 1.40's dynamic-module ABI: the callbacks the module imports
//! (`envoy_dynamic_module_callback_lb_*`) and [`EnvoyLb`], the [`LbHost`] over them for one
//! `choose_host` call.
//!
//! Invariants (read off the shipped `envoy` 1.40.0 binary, `objdump -d` of each callback and of
//! the Rust SDK's own `on_lb_*` hooks built into it; docs/performance.md, "Host choice inside
//! Envoy's load balancer", says how):
//! - `lb_context_get_downstream_header(ctx, key, *out, index, *count)`: the request headers the
//!   router holds (after every HTTP filter ran, so the filter's own header is there); Envoy
//!   lower-cases a copy of `key` (a heap copy past 22 bytes) and scans the header map;
//! - `lb_context_should_select_another_host(lb, ctx, priority, index)`: `index` counts
//!   `hosts()` (every member), not `healthyHosts()`; true when the route's retry host
//!   predicates (previous_hosts) reject the host: a host this request already tried;
//! - `lb_get_healthy_host_address(lb, priority, i, *out)` / `lb_get_host_address`: `IP:PORT`,
//!   Envoy's bytes, valid during the hook;
//! - `lb_get_host_stat(lb, priority, index, stat)`: `index` counts `hosts()`; stat 7 is
//!   `rq_active` (the jump table's last entry reads the host's second gauge);
//! - the hook's answer is an index into `healthyHosts()` of the priority.
//!
//! The LB context of 1.40 has no filter-state or dynamic-metadata getter (the cluster
//! extension's `cluster_lb_context_get_filter_state_bytes` is for `envoy.clusters.dynamic_modules`
//! only), so the filter's ranking reaches the LB in the request header it already sets.

use super::hosts::LbHost;
use crate::native::ffi::Buf;
use std::ffi::c_void;

/// Priority 0: pool clusters have one priority (envoy/gen gives them no other).
const PRIORITY: u32 = 0;
/// `envoy_dynamic_module_type_host_stat_RqActive`.
const STAT_RQ_ACTIVE: u32 = 7;

mod raw {
    use crate::native::ffi::Buf;
    use std::ffi::c_void;
    extern "C" {
        pub fn envoy_dynamic_module_callback_lb_context_get_downstream_header(
            ctx: *mut c_void,
            key: Buf,
            out: *mut Buf,
            index: usize,
            count: *mut usize,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_lb_context_should_select_another_host(
            lb: *mut c_void,
            ctx: *mut c_void,
            priority: u32,
            index: usize,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_lb_get_hosts_count(
            lb: *mut c_void,
            priority: u32,
        ) -> usize;
        pub fn envoy_dynamic_module_callback_lb_get_healthy_hosts_count(
            lb: *mut c_void,
            priority: u32,
        ) -> usize;
        pub fn envoy_dynamic_module_callback_lb_get_host_address(
            lb: *mut c_void,
            priority: u32,
            index: usize,
            out: *mut Buf,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_lb_get_healthy_host_address(
            lb: *mut c_void,
            priority: u32,
            index: usize,
            out: *mut Buf,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_lb_get_host_stat(
            lb: *mut c_void,
            priority: u32,
            index: usize,
            stat: u32,
        ) -> u64;
        pub fn envoy_dynamic_module_callback_lb_config_define_counter(
            config: *mut c_void,
            name: Buf,
            labels: *const Buf,
            labels_len: usize,
            id: *mut usize,
        ) -> u32;
        pub fn envoy_dynamic_module_callback_lb_config_increment_counter(
            config: *mut c_void,
            id: usize,
            labels: *const Buf,
            labels_len: usize,
            by: u64,
        ) -> u32;
    }
}

/// Envoy's LB and the current request's LB context (NULL outside `choose_host`: then the
/// request reads as having no headers and no host as tried).
pub(crate) struct EnvoyLb {
    pub(crate) lb: *mut c_void,
    pub(crate) ctx: *mut c_void,
}

impl EnvoyLb {
    /// # Safety
    /// `lb` is Envoy's live LB pointer of the current hook.
    unsafe fn address(&self, healthy: bool, i: usize) -> Option<&[u8]> {
        let mut out = Buf::NULL;
        let ok = if healthy {
            raw::envoy_dynamic_module_callback_lb_get_healthy_host_address(
                self.lb, PRIORITY, i, &mut out,
            )
        } else {
            raw::envoy_dynamic_module_callback_lb_get_host_address(self.lb, PRIORITY, i, &mut out)
        };
        ok.then(|| out.bytes())
    }
}

// SAFETY (every method): `EnvoyLb` is built only inside an LB hook from the pointers Envoy
// passed to it (exports.rs), and its borrows end with the hook.
impl LbHost for EnvoyLb {
    fn header(&self, name: &[u8]) -> Option<&[u8]> {
        if self.ctx.is_null() {
            return None;
        }
        let mut out = Buf::NULL;
        let mut count = 0usize;
        let ok = unsafe {
            raw::envoy_dynamic_module_callback_lb_context_get_downstream_header(
                self.ctx,
                Buf::of(name),
                &mut out,
                0,
                &mut count,
            )
        };
        ok.then(|| unsafe { out.bytes() })
    }

    fn hosts_count(&self) -> usize {
        unsafe { raw::envoy_dynamic_module_callback_lb_get_hosts_count(self.lb, PRIORITY) }
    }

    fn healthy_count(&self) -> usize {
        unsafe { raw::envoy_dynamic_module_callback_lb_get_healthy_hosts_count(self.lb, PRIORITY) }
    }

    fn host_address(&self, i: usize) -> Option<&[u8]> {
        unsafe { self.address(false, i) }
    }

    fn healthy_address(&self, i: usize) -> Option<&[u8]> {
        unsafe { self.address(true, i) }
    }

    fn rejected(&self, i: usize) -> bool {
        !self.ctx.is_null()
            && unsafe {
                raw::envoy_dynamic_module_callback_lb_context_should_select_another_host(
                    self.lb, self.ctx, PRIORITY, i,
                )
            }
    }

    fn active_requests(&self, i: usize) -> u64 {
        unsafe {
            raw::envoy_dynamic_module_callback_lb_get_host_stat(
                self.lb,
                PRIORITY,
                i,
                STAT_RQ_ACTIVE,
            )
        }
    }
}

/// Defines counter `name` on the LB config (only inside `on_lb_config_new`); None when refused.
///
/// # Safety
/// `config` is Envoy's LB config pointer of the current `on_lb_config_new`.
pub(crate) unsafe fn define_counter(config: *mut c_void, name: &str) -> Option<usize> {
    let mut id = 0usize;
    let rc = raw::envoy_dynamic_module_callback_lb_config_define_counter(
        config,
        Buf::of(name.as_bytes()),
        std::ptr::null(),
        0,
        &mut id,
    );
    (rc == 0).then_some(id)
}

/// Adds one to counter `id` of the LB config (any thread).
///
/// # Safety
/// `config` is Envoy's live LB config pointer; `id` came from [`define_counter`].
pub(crate) unsafe fn increment(config: *mut c_void, id: usize) {
    raw::envoy_dynamic_module_callback_lb_config_increment_counter(
        config,
        id,
        std::ptr::null(),
        0,
        1,
    );
}
