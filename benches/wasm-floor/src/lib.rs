//! The floor of any body-routing proxy-wasm filter in Envoy: the same SDK, callbacks and stop /
//! buffer pattern as prefix-router, and the two host calls no such filter can skip (read the
//! body, set the cluster header), with no parsing, hashing or shared data. `benches/overhead`
//! runs it as kind `wasm_floor`, so prefix-router's own cost is (iii) minus this, and Envoy's
//! Wasm plumbing is this minus (ii).

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
            self.set_http_request_header("x-prefix-router-cluster", Some("w0"));
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
        let cluster = if body.is_empty() { "w1" } else { "w0" };
        self.set_http_request_header("x-prefix-router-cluster", Some(cluster));
        Action::Continue
    }
}
