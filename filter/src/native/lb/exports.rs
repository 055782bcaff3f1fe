//! The LB hooks Envoy calls (`envoy_dynamic_module_on_lb_*`, Envoy 1.40): the module as the
//! pool cluster's `envoy.load_balancing_policies.dynamic_modules` policy.
//!
//! Invariants Envoy gives: a config's hooks run on the main thread; each worker thread has its
//! own LB instance ([`Lb`]), whose `choose_host` and membership hooks run on that thread only;
//! `on_lb_destroy` comes once per instance, `on_lb_config_destroy` after the config's last
//! instance; the LB config pointer Envoy passes to `on_lb_config_new` lives as long as our config.
//!
//! Failing closed: every hook that runs module code runs under the panic guard; a panic in
//! `choose_host` picks no host (Envoy answers 503 "no healthy upstream"; the request is never
//! sent to a host the module did not choose), counts `prefix_router.lb.panics` and logs; a
//! config that does not parse is refused (Envoy's config load fails, naming nothing else).
//!
//! Counters (Envoy stats, defined with the config): `prefix_router.lb.listed_fallback` (an
//! attempt went to a later listed host: a retry, or the first choice was not healthy),
//! `.unlisted` (no listed host usable: the least busy one), `.no_host`, `.panics`. An attempt
//! that goes to the filter's first choice counts nothing: it makes no call beyond the pick's.

use super::abi::{self, EnvoyLb};
use super::hosts::{LbHost, Table};
use super::pick::{pick, Pick};
use crate::native::ffi::Buf;
use crate::native::guard;
use serde::Deserialize;
use std::ffi::c_void;
use std::io::Write;

/// The LB's configuration (`lb_policy_config`, a `google.protobuf.StringValue` holding JSON).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    /// The request header the filter lists its hosts in (`destination_header` of the filter).
    #[serde(default = "default_header")]
    header: String,
}

fn default_header() -> String {
    "x-gateway-destination-endpoint".into()
}

/// Counter ids on Envoy's LB config (None: Envoy refused the definition; not counted).
#[derive(Default)]
struct Counters {
    listed_fallback: Option<usize>,
    unlisted: Option<usize>,
    no_host: Option<usize>,
    panics: Option<usize>,
}

pub(crate) struct LbConfig {
    envoy: *mut c_void,
    header: Box<[u8]>,
    counters: Counters,
}

/// One worker thread's LB instance.
pub(crate) struct Lb {
    config: *const LbConfig,
    table: Table,
}

/// The validated header name, or an error naming the field.
fn parse(json: &[u8]) -> Result<Box<[u8]>, String> {
    let raw: RawConfig = if json.iter().all(u8::is_ascii_whitespace) {
        RawConfig {
            header: default_header(),
        }
    } else {
        serde_json::from_slice(json).map_err(|e| format!("lb_policy_config: {e}"))?
    };
    let ok = !raw.header.is_empty()
        && raw
            .header
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !ok {
        return Err(format!(
            "lb_policy_config.header: {:?} is not a lower-case header name",
            raw.header
        ));
    }
    Ok(raw.header.into_bytes().into_boxed_slice())
}

fn log(msg: &str) {
    // Not `eprintln!`, which panics when stderr cannot be written.
    let _ = writeln!(std::io::stderr(), "prefix-router lb: {msg}");
}

/// The pick for one attempt, written to `index` (priority 0); false: no host.
fn choose(lb: &mut Lb, cfg: &LbConfig, h: &impl LbHost, index: &mut u32) -> (bool, Option<usize>) {
    match pick(h, &mut lb.table, &cfg.header) {
        Pick::Listed { healthy, rank } => {
            *index = healthy;
            (
                true,
                (rank > 0).then_some(cfg.counters.listed_fallback).flatten(),
            )
        }
        Pick::Unlisted { healthy } => {
            *index = healthy;
            (true, cfg.counters.unlisted)
        }
        Pick::Nothing => (false, cfg.counters.no_host),
    }
}

/// [`choose`] under the panic guard: a panic picks nothing and counts as one.
fn guarded(lb: &mut Lb, cfg: &LbConfig, h: &impl LbHost, index: &mut u32) -> (bool, Option<usize>) {
    guard::catch("on_lb_choose_host", || choose(lb, cfg, h, index))
        .unwrap_or((false, cfg.counters.panics))
}

// ---- The exported symbols --------------------------------------------------------------------

/// # Safety
/// `envoy` is Envoy's LB config pointer; `config` Envoy's buffer, valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_config_new(
    envoy: *mut c_void,
    _name: Buf,
    config: Buf,
) -> *const c_void {
    let made = guard::catch("on_lb_config_new", || {
        let header = match parse(config.bytes()) {
            Ok(h) => h,
            Err(e) => {
                log(&e);
                return std::ptr::null();
            }
        };
        let define = |name: &str| abi::define_counter(envoy, name);
        let counters = Counters {
            listed_fallback: define("prefix_router.lb.listed_fallback"),
            unlisted: define("prefix_router.lb.unlisted"),
            no_host: define("prefix_router.lb.no_host"),
            panics: define("prefix_router.lb.panics"),
        };
        Box::into_raw(Box::new(LbConfig {
            envoy,
            header,
            counters,
        }))
        .cast_const()
        .cast()
    });
    made.unwrap_or(std::ptr::null())
}

/// # Safety
/// `config` came from [`envoy_dynamic_module_on_lb_config_new`], destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_config_destroy(config: *const c_void) {
    if !config.is_null() {
        drop(Box::from_raw(config.cast_mut().cast::<LbConfig>()));
    }
}

/// # Safety
/// `config` came from [`envoy_dynamic_module_on_lb_config_new`] and outlives the instance.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_new(
    config: *const c_void,
    _lb: *mut c_void,
) -> *mut c_void {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(Lb {
        config: config.cast(),
        table: Table::new(),
    }))
    .cast()
}

/// # Safety
/// Envoy's live pointers of this worker thread's LB and the attempt's context; `lb_module` came
/// from [`envoy_dynamic_module_on_lb_new`]; the out-pointers are writable.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_choose_host(
    lb_envoy: *mut c_void,
    lb_module: *mut c_void,
    ctx: *mut c_void,
    priority: *mut u32,
    index: *mut u32,
) -> bool {
    let Some(lb) = lb_module.cast::<Lb>().as_mut() else {
        return false;
    };
    let Some(cfg) = lb.config.as_ref() else {
        return false;
    };
    if priority.is_null() || index.is_null() || lb_envoy.is_null() {
        return false;
    }
    let h = EnvoyLb { lb: lb_envoy, ctx };
    let mut at = 0u32;
    let (picked, count) = guarded(lb, cfg, &h, &mut at);
    if let Some(id) = count {
        abi::increment(cfg.envoy, id);
    }
    if picked {
        *priority = 0;
        *index = at;
    }
    picked
}

/// # Safety
/// `lb_module` came from [`envoy_dynamic_module_on_lb_new`], on its thread.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_on_host_membership_update(
    _lb_envoy: *mut c_void,
    lb_module: *mut c_void,
    _added: usize,
    _removed: usize,
) {
    if let Some(lb) = lb_module.cast::<Lb>().as_mut() {
        lb.table.invalidate();
    }
}

/// # Safety
/// `lb_module` came from [`envoy_dynamic_module_on_lb_new`], destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_destroy(lb_module: *mut c_void) {
    if !lb_module.is_null() {
        drop(Box::from_raw(lb_module.cast::<Lb>()));
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeLb;
    use super::*;

    fn cfg() -> LbConfig {
        LbConfig {
            envoy: std::ptr::null_mut(),
            header: default_header().into_bytes().into_boxed_slice(),
            counters: Counters {
                listed_fallback: Some(1),
                unlisted: Some(2),
                no_host: Some(3),
                panics: Some(4),
            },
        }
    }

    #[test]
    fn the_config_is_validated_with_errors_naming_the_field() {
        assert_eq!(
            &*parse(b"").unwrap_or_default(),
            b"x-gateway-destination-endpoint"
        );
        assert_eq!(&*parse(br#"{"header":"x-d"}"#).unwrap_or_default(), b"x-d");
        for bad in [
            &br#"{"header":""}"#[..],
            br#"{"header":"X-D"}"#,
            br#"{"header":"a b"}"#,
        ] {
            assert!(parse(bad).is_err_and(|e| e.starts_with("lb_policy_config.header")));
        }
        assert!(parse(br#"{"hedaer":"x"}"#).is_err_and(|e| e.starts_with("lb_policy_config")));
        assert!(parse(b"[").is_err());
    }

    #[test]
    fn only_attempts_off_the_first_choice_are_counted() {
        let c = cfg();
        let mut lb = Lb {
            config: &c,
            table: Table::new(),
        };
        let mut f = FakeLb::new(&["10.0.0.1:80", "10.0.0.2:80"]);
        f.header = Some("10.0.0.1:80,10.0.0.2:80".into());
        let mut at = 9;
        assert_eq!(choose(&mut lb, &c, &f, &mut at), (true, None));
        assert_eq!(at, 0);
        f.tried.insert(0);
        assert_eq!(choose(&mut lb, &c, &f, &mut at), (true, Some(1)));
        assert_eq!(at, 1);
        f.header = None;
        assert_eq!(choose(&mut lb, &c, &f, &mut at), (true, Some(2)));
        f.unhealthy.extend([0, 1]);
        assert_eq!(choose(&mut lb, &c, &f, &mut at), (false, Some(3)));
    }

    #[test]
    fn a_panic_picks_no_host_and_is_counted() {
        let c = cfg();
        let mut lb = Lb {
            config: &c,
            table: Table::new(),
        };
        let mut f = FakeLb::new(&["10.0.0.1:80"]);
        f.panics = true;
        let mut at = 0;
        assert_eq!(guarded(&mut lb, &c, &f, &mut at), (false, Some(4)));
        f.panics = false; // the instance keeps working after a caught panic
        assert_eq!(guarded(&mut lb, &c, &f, &mut at), (true, Some(2)));
    }
}
