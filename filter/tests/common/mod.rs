//! What the FakeHost-driven integration tests share: a root configured on a fresh fake Envoy.

use prefix_router::glue::Root;
use prefix_router::host::FakeHost;

/// The fake clock's start (ns since the epoch).
const T0: u64 = 1_700_000_000_000_000_000;

/// A fake Envoy at `T0` and a root that accepted `cfg` (the test fails naming the errors if not).
pub fn configured(cfg: &str) -> (FakeHost, Root) {
    let h = FakeHost::new();
    {
        let mut s = h.state.borrow_mut();
        s.plugin_config = cfg.as_bytes().to_vec();
        s.now_nanos = T0;
    }
    let mut root = Root::new();
    assert!(
        root.on_configure(&h, cfg.len()),
        "{:?}",
        h.state.borrow().errors
    );
    (h, root)
}
