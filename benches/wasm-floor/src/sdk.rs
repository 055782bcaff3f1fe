//! The floor on the proxy-wasm Rust SDK (all callbacks exported).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Floor))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Floor;

impl Context for Floor {}

impl HttpContext for Floor {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.set_http_request_header(crate::CLUSTER_HEADER, Some("w0"));
            return Action::Continue;
        }
        // Like prefix-router: hold the headers until the body has been read.
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause; // buffer
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        let cluster = if body.is_empty() {
            "w0"
        } else {
            // Round robin, like the lean floor (see lean.rs).
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            ["w0", "w1", "w2", "w3"][NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 4]
        };
        self.set_http_request_header(crate::CLUSTER_HEADER, Some(cluster));
        Action::Continue
    }
}
