//! A small proxy-wasm ABI 0.2.1 host on wasmtime: enough of Envoy to load the real
//! `prefix_router.wasm` and drive it like Envoy's worker threads do.
//!
//! * [`Host`]: one "Envoy process": the compiled module, ONE shared-data store (Envoy semantics:
//!   a get returns value + CAS token; `cas == 0` sets unconditionally; a stale token fails with
//!   `CasMismatch`; a CAS on a missing key inserts; no deletes) and one stats registry, shared by
//!   every VM created from it, across threads.
//! * [`Vm`]: one Wasm VM (one Envoy worker thread): root context configured with the plugin
//!   configuration; [`Vm::request`] runs a stream's request callbacks and returns what the filter
//!   did; [`Vm::finish`] ends the stream (`on_response_headers`, `on_done`, `on_log`,
//!   `on_delete`, in Envoy's order); [`Vm::roundtrip`] does both.
//!
//! Host functions implemented: header maps (get/set/add/replace/remove/pairs), buffers (request
//! body, plugin and VM configuration), shared data, properties (a settable map), metrics
//! (define/increment/record/get), log, tick period, current time (settable clock),
//! send_local_response, set_effective_context, continue/close stream, done; WASI
//! `environ_get`, `environ_sizes_get`, `fd_write` (captured as logs), `proc_exit` (trap). Any other
//! import the module declares answers `Unimplemented` (status 12).
//!
//! Fuel: with [`Options::fuel`] each call's wasmtime fuel (≈ Wasm instructions) is counted and
//! reported in [`Response::fuel`].

use anyhow::{anyhow, bail, Context as _, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use wasmtime::{
    CallHook, Caller, Config, Engine, Instance, Linker, Memory, Module, Store, TypedFunc, Val,
};

/// proxy-wasm status codes.
pub mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
    pub const CAS_MISMATCH: i32 = 8;
    pub const UNIMPLEMENTED: i32 = 12;
}

const MAP_REQUEST_HEADERS: i32 = 0;
const MAP_RESPONSE_HEADERS: i32 = 2;
const MAP_HTTP_CALL_RESPONSE_HEADERS: i32 = 6;
const BUFFER_REQUEST_BODY: i32 = 0;
const BUFFER_HTTP_CALL_RESPONSE_BODY: i32 = 4;
const BUFFER_VM_CONFIGURATION: i32 = 6;
const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;
const ROOT_CONTEXT: i32 = 1;

/// Envoy's shared data: one store per process, shared by all VMs (of one vm_id).
#[derive(Default)]
pub struct SharedData {
    inner: Mutex<SharedInner>,
}

#[derive(Default)]
struct SharedInner {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl SharedData {
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.inner.lock().unwrap().map.get(key).cloned()
    }
    /// Envoy's `SharedData::set`.
    pub fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        let mut i = self.inner.lock().unwrap();
        i.next_cas = i.next_cas.wrapping_add(1).max(1);
        let next = i.next_cas;
        match i.map.get_mut(key) {
            Some(e) => {
                if cas != 0 && cas != e.1 {
                    return false;
                }
                e.0.clear();
                e.0.extend_from_slice(value);
                e.1 = next;
            }
            None => {
                i.map.insert(key.to_string(), (value.to_vec(), next));
            }
        }
        true
    }
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Total bytes of keys and values (what Envoy's map holds, without its own overhead).
    pub fn bytes(&self) -> usize {
        let i = self.inner.lock().unwrap();
        i.map.iter().map(|(k, v)| k.len() + v.0.len()).sum()
    }
}

/// Process-wide stats: a metric defined by name in several VMs is one stat, as in Envoy.
#[derive(Default)]
pub struct Stats {
    inner: Mutex<StatsInner>,
}

#[derive(Default)]
struct StatsInner {
    ids: HashMap<String, u32>,
    values: Vec<(String, i32, i64)>,
}

impl Stats {
    fn define(&self, kind: i32, name: &str) -> u32 {
        let mut i = self.inner.lock().unwrap();
        if let Some(&id) = i.ids.get(name) {
            return id;
        }
        i.values.push((name.to_string(), kind, 0));
        let id = i.values.len() as u32; // ids start at 1
        i.ids.insert(name.to_string(), id);
        id
    }
    fn with<R>(&self, id: u32, f: impl FnOnce(&mut i64) -> R) -> Option<R> {
        let mut i = self.inner.lock().unwrap();
        let e = i.values.get_mut((id as usize).checked_sub(1)?)?;
        Some(f(&mut e.2))
    }
    /// The value of a metric by its defined name (e.g. `prefix_router.requests.prefix_hit`).
    pub fn get(&self, name: &str) -> Option<i64> {
        let i = self.inner.lock().unwrap();
        let id = *i.ids.get(name)?;
        Some(i.values[id as usize - 1].2)
    }
    /// All metrics `(name, value)`, sorted by name.
    pub fn all(&self) -> Vec<(String, i64)> {
        let i = self.inner.lock().unwrap();
        let mut v: Vec<_> = i.values.iter().map(|e| (e.0.clone(), e.2)).collect();
        v.sort();
        v
    }
}

/// Host options.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Count wasmtime fuel per call (slows execution somewhat).
    pub fuel: bool,
}

/// One "Envoy process": compiled module, shared data and stats shared by its VMs.
#[derive(Clone)]
pub struct Host {
    engine: Engine,
    module: Module,
    linker: Linker<State>,
    pub shared: Arc<SharedData>,
    pub stats: Arc<Stats>,
    /// Fixed clock in nanoseconds since the epoch; `None` = the system clock.
    pub clock: Arc<Mutex<Option<u64>>>,
    opts: Options,
}

/// The standard path of the filter built for Wasm.
pub fn default_wasm_path() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let target = if target.is_absolute() {
        target
    } else {
        root.join(target)
    };
    target.join("wasm32-wasip1/release/prefix_router.wasm")
}

/// The filter's `.wasm`: from `PREFIX_ROUTER_WASM` if set, else the standard path
/// (`target/wasm32-wasip1/release/prefix_router.wasm`). When that is missing it is built with
/// `cargo build -p prefix-router --target wasm32-wasip1 --release` into a separate target
/// directory (`target/proxy-wasm-host`), so a `cargo test` holding the main target dir's lock
/// cannot deadlock on it.
pub fn filter_wasm() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PREFIX_ROUTER_WASM") {
        return Ok(PathBuf::from(p));
    }
    let p = default_wasm_path();
    if p.exists() {
        return Ok(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let own = p
        .ancestors()
        .nth(3)
        .map_or_else(|| root.join("target"), Path::to_path_buf)
        .join("proxy-wasm-host");
    let built = own.join("wasm32-wasip1/release/prefix_router.wasm");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!(
        "{} is missing: building it into {}",
        p.display(),
        own.display()
    );
    let st = std::process::Command::new(cargo)
        .current_dir(&root)
        .args([
            "build",
            "-p",
            "prefix-router",
            "--target",
            "wasm32-wasip1",
            "--release",
        ])
        .arg("--target-dir")
        .arg(&own)
        .status()
        .context("running cargo to build the filter")?;
    if !st.success() || !built.exists() {
        bail!(
            "{} is missing and building it failed: run `cargo build -p prefix-router \
             --target wasm32-wasip1 --release`",
            p.display()
        );
    }
    Ok(built)
}

impl Host {
    pub fn new(wasm: &Path, opts: Options) -> Result<Host> {
        let mut cfg = Config::new();
        cfg.consume_fuel(opts.fuel);
        let engine = Engine::new(&cfg)?;
        let bytes = std::fs::read(wasm).with_context(|| format!("reading {}", wasm.display()))?;
        let module = Module::new(&engine, bytes)?;
        let linker = linker(&engine, &module)?;
        Ok(Host {
            engine,
            module,
            linker,
            shared: Arc::default(),
            stats: Arc::default(),
            clock: Arc::default(),
            opts,
        })
    }

    /// The filter built for Wasm (see [`filter_wasm`]).
    pub fn filter(opts: Options) -> Result<Host> {
        Host::new(&filter_wasm()?, opts)
    }

    /// Sets the clock every VM reads (nanoseconds since the epoch).
    pub fn set_clock(&self, nanos: u64) {
        *self.clock.lock().unwrap() = Some(nanos);
    }

    /// A new VM (an Envoy worker thread's instance) configured with `plugin_config`.
    pub fn vm(&self, plugin_config: &str) -> Result<Vm> {
        let state = State {
            shared: self.shared.clone(),
            stats: self.stats.clone(),
            clock: self.clock.clone(),
            plugin_config: plugin_config.as_bytes().to_vec(),
            ..State::default()
        };
        let mut store = Store::new(&self.engine, state);
        store.call_hook(|mut s, hook| {
            match hook {
                CallHook::CallingHost => s.data_mut().host_calls += 1,
                CallHook::CallingWasm => s.data_mut().guest_calls += 1,
                _ => {}
            }
            Ok(())
        });
        if self.opts.fuel {
            store.set_fuel(u64::MAX / 2)?;
        }
        let instance = self.linker.instantiate(&mut store, &self.module)?;
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| anyhow!("module exports no memory"))?;
        let alloc = instance.get_typed_func::<i32, i32>(&mut store, "proxy_on_memory_allocate")?;
        store.data_mut().memory = Some(memory);
        store.data_mut().alloc = Some(alloc);
        let f = Exports::new(&instance, &mut store)?;
        if let Ok(init) = instance.get_typed_func::<(), ()>(&mut store, "_initialize") {
            init.call(&mut store, ())?;
        }
        let mut vm = Vm {
            store,
            f,
            next_context: ROOT_CONTEXT + 1,
            fuel: self.opts.fuel,
        };
        vm.f.context_create.call(&mut vm.store, (ROOT_CONTEXT, 0))?;
        if vm.f.vm_start.call(&mut vm.store, (ROOT_CONTEXT, 0))? == 0 {
            bail!("proxy_on_vm_start failed: {:?}", vm.logs());
        }
        let n = plugin_config.len() as i32;
        if vm.f.configure.call(&mut vm.store, (ROOT_CONTEXT, n))? == 0 {
            bail!("proxy_on_configure failed: {:?}", vm.logs());
        }
        Ok(vm)
    }
}

/// An HTTP call the module dispatched (`proxy_http_call`).
#[derive(Debug, Clone)]
pub struct HttpCall {
    pub token: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u32,
}

impl HttpCall {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

/// A local response the filter sent: (status, body, headers).
pub type LocalResponse = (u32, Vec<u8>, Vec<(String, String)>);

/// Per-VM host state.
#[derive(Default)]
pub struct State {
    shared: Arc<SharedData>,
    stats: Arc<Stats>,
    clock: Arc<Mutex<Option<u64>>>,
    plugin_config: Vec<u8>,
    memory: Option<Memory>,
    alloc: Option<TypedFunc<i32, i32>>,
    /// Current stream's request headers, request body, response headers.
    pub request_headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub response_headers: Vec<(String, String)>,
    /// A local response the filter sent: (status, body, headers).
    pub local_response: Option<LocalResponse>,
    pub properties: HashMap<String, Vec<u8>>,
    /// (level, message) of every log call and WASI stdout/stderr write.
    pub logs: Vec<(i32, String)>,
    pub tick_period_ms: u32,
    pub effective_context: i32,
    /// HTTP calls the module dispatched and nobody answered yet (see [`Vm::answer_http_call`]).
    pub http_calls: Vec<HttpCall>,
    next_token: u32,
    /// The answer being delivered to `proxy_on_http_call_response`.
    call_headers: Vec<(String, String)>,
    call_body: Vec<u8>,
    /// Calls from the module into the host (each one a host call in Envoy) and from the host
    /// into the module (callbacks, including the allocator the host calls to return data).
    pub host_calls: u64,
    pub guest_calls: u64,
}

impl State {
    fn map(&mut self, t: i32) -> Option<&mut Vec<(String, String)>> {
        match t {
            MAP_REQUEST_HEADERS => Some(&mut self.request_headers),
            MAP_RESPONSE_HEADERS => Some(&mut self.response_headers),
            MAP_HTTP_CALL_RESPONSE_HEADERS => Some(&mut self.call_headers),
            _ => None,
        }
    }
}

/// `proxy_on_http_call_response(context, token, headers, body size, trailers)`.
type CallResponseFn = TypedFunc<(i32, i32, i32, i32, i32), ()>;

struct Exports {
    context_create: TypedFunc<(i32, i32), ()>,
    vm_start: TypedFunc<(i32, i32), i32>,
    configure: TypedFunc<(i32, i32), i32>,
    tick: TypedFunc<i32, ()>,
    request_headers: TypedFunc<(i32, i32, i32), i32>,
    request_body: TypedFunc<(i32, i32, i32), i32>,
    response_headers: TypedFunc<(i32, i32, i32), i32>,
    done: TypedFunc<i32, i32>,
    log: TypedFunc<i32, ()>,
    delete: TypedFunc<i32, ()>,
    http_call_response: Option<CallResponseFn>,
}

impl Exports {
    fn new(i: &Instance, s: &mut Store<State>) -> Result<Exports> {
        Ok(Exports {
            context_create: i.get_typed_func(&mut *s, "proxy_on_context_create")?,
            vm_start: i.get_typed_func(&mut *s, "proxy_on_vm_start")?,
            configure: i.get_typed_func(&mut *s, "proxy_on_configure")?,
            tick: i.get_typed_func(&mut *s, "proxy_on_tick")?,
            request_headers: i.get_typed_func(&mut *s, "proxy_on_request_headers")?,
            request_body: i.get_typed_func(&mut *s, "proxy_on_request_body")?,
            response_headers: i.get_typed_func(&mut *s, "proxy_on_response_headers")?,
            done: i.get_typed_func(&mut *s, "proxy_on_done")?,
            log: i.get_typed_func(&mut *s, "proxy_on_log")?,
            delete: i.get_typed_func(&mut *s, "proxy_on_delete")?,
            http_call_response: i
                .get_typed_func(&mut *s, "proxy_on_http_call_response")
                .ok(),
        })
    }
}

/// What the filter did with a request.
#[derive(Debug, Clone, Default)]
pub struct Response {
    /// The stream's context id (pass it to [`Vm::finish`]).
    pub context: i32,
    /// Actions returned by `on_request_headers` / `on_request_body` (0 continue, 1 pause).
    pub headers_action: i32,
    pub body_action: Option<i32>,
    /// Request headers after the filter ran.
    pub request_headers: Vec<(String, String)>,
    pub local_response: Option<LocalResponse>,
    /// Fuel the request callbacks consumed (0 unless `Options::fuel`).
    pub fuel: u64,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.request_headers, name)
    }
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|e| e.0 == name).map(|e| e.1.as_str())
}

/// One Wasm VM: an Envoy worker thread's instance of the filter.
pub struct Vm {
    store: Store<State>,
    f: Exports,
    next_context: i32,
    fuel: bool,
}

impl Vm {
    pub fn state(&self) -> &State {
        self.store.data()
    }
    pub fn logs(&self) -> &[(i32, String)] {
        &self.store.data().logs
    }

    fn fuel_left(&self) -> u64 {
        if self.fuel {
            self.store.get_fuel().unwrap_or(0)
        } else {
            0
        }
    }

    /// Runs a request's callbacks: context creation, `on_request_headers` and (when there is a
    /// body, or the headers callback paused) `on_request_body` with the whole body at end of
    /// stream, as Envoy does once it has buffered it. The stream stays open until
    /// [`Vm::finish`]; its load charge is held until then.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Response> {
        let ctx = self.next_context;
        self.next_context = self.next_context.wrapping_add(1).max(ROOT_CONTEXT + 1);
        let fuel0 = self.fuel_left();
        {
            let st = self.store.data_mut();
            st.request_headers.clear();
            st.request_headers.push((":method".into(), method.into()));
            st.request_headers.push((":path".into(), path.into()));
            st.request_headers
                .extend(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            st.body.clear();
            st.body.extend_from_slice(body);
            st.response_headers.clear();
            st.local_response = None;
        }
        self.f
            .context_create
            .call(&mut self.store, (ctx, ROOT_CONTEXT))?;
        let n = self.store.data().request_headers.len() as i32;
        let eos = i32::from(body.is_empty());
        let ha = self
            .f
            .request_headers
            .call(&mut self.store, (ctx, n, eos))?;
        let mut ba = None;
        if !body.is_empty() {
            ba = Some(
                self.f
                    .request_body
                    .call(&mut self.store, (ctx, body.len() as i32, 1))?,
            );
        }
        let fuel = fuel0.saturating_sub(self.fuel_left());
        let st = self.store.data_mut();
        Ok(Response {
            context: ctx,
            headers_action: ha,
            body_action: ba,
            request_headers: std::mem::take(&mut st.request_headers),
            local_response: st.local_response.take(),
            fuel,
        })
    }

    /// Ends a stream: `on_response_headers` (with `response_headers`), then `on_done`,
    /// `on_log`, `on_delete` as Envoy does. Returns the response headers after the filter.
    pub fn finish(
        &mut self,
        ctx: i32,
        response_headers: &[(&str, &str)],
    ) -> Result<Vec<(String, String)>> {
        {
            let st = self.store.data_mut();
            st.response_headers.clear();
            st.response_headers.push((":status".into(), "200".into()));
            st.response_headers.extend(
                response_headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string())),
            );
        }
        let n = self.store.data().response_headers.len() as i32;
        self.f.response_headers.call(&mut self.store, (ctx, n, 0))?;
        self.f.done.call(&mut self.store, ctx)?;
        self.f.log.call(&mut self.store, ctx)?;
        self.f.delete.call(&mut self.store, ctx)?;
        Ok(std::mem::take(&mut self.store.data_mut().response_headers))
    }

    /// Ends a stream that never got a response (client abort, reset): `on_done`, `on_delete`.
    pub fn abort(&mut self, ctx: i32) -> Result<()> {
        self.f.done.call(&mut self.store, ctx)?;
        self.f.delete.call(&mut self.store, ctx)?;
        Ok(())
    }

    /// `request` then `finish`: one complete request. Returns the request-side response with
    /// `fuel` covering the whole lifecycle.
    pub fn roundtrip(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Response> {
        let fuel0 = self.fuel_left();
        let mut r = self.request(method, path, headers, body)?;
        self.finish(r.context, &[])?;
        r.fuel = fuel0.saturating_sub(self.fuel_left());
        Ok(r)
    }

    /// Takes the HTTP calls dispatched since the last call (each awaits an answer).
    pub fn take_http_calls(&mut self) -> Vec<HttpCall> {
        std::mem::take(&mut self.store.data_mut().http_calls)
    }

    /// Delivers the answer to a dispatched call (`status` 0 = failed: no headers, as Envoy
    /// reports a reset or timeout) to the root context, as Envoy does.
    pub fn answer_http_call(&mut self, token: u32, status: u32, body: &[u8]) -> Result<()> {
        let Some(f) = self.f.http_call_response.clone() else {
            bail!("module exports no proxy_on_http_call_response");
        };
        let nh = {
            let st = self.store.data_mut();
            st.call_headers.clear();
            if status != 0 {
                st.call_headers.push((":status".into(), status.to_string()));
            }
            st.call_body = body.to_vec();
            st.call_headers.len() as i32
        };
        f.call(
            &mut self.store,
            (ROOT_CONTEXT, token as i32, nh, body.len() as i32, 0),
        )
    }

    /// The root context's timer (Envoy calls it every tick period).
    pub fn tick(&mut self) -> Result<()> {
        self.f.tick.call(&mut self.store, ROOT_CONTEXT)
    }

    /// As many timer calls as Envoy would make in `ms` at the module's tick period (at least
    /// one); the clock is left alone.
    pub fn elapse(&mut self, ms: u32) -> Result<()> {
        let period = self.store.data().tick_period_ms.max(1);
        for _ in 0..(ms / period).max(1) {
            self.tick()?;
        }
        Ok(())
    }

    /// Tears the plugin down as Envoy does when its configuration is removed (a listener update
    /// drained the old filter chain) or at shutdown: `proxy_on_done` then `proxy_on_delete` on
    /// the root context. Returns what `on_done` answered (true: done now).
    pub fn shutdown(&mut self) -> Result<bool> {
        let done = self.f.done.call(&mut self.store, ROOT_CONTEXT)? != 0;
        self.f.delete.call(&mut self.store, ROOT_CONTEXT)?;
        Ok(done)
    }
}

// ---------------------------------------------------------------------------------------------
// Host functions.

fn mem<'a>(c: &'a mut Caller<'_, State>) -> (&'a mut [u8], &'a mut State) {
    let m = c.data().memory.expect("memory set at instantiation");
    m.data_and_store_mut(c)
}

fn read(c: &mut Caller<'_, State>, ptr: i32, len: i32) -> Option<Vec<u8>> {
    let (m, _) = mem(c);
    m.get(ptr as u32 as usize..(ptr as u32 as usize).checked_add(len as u32 as usize)?)
        .map(<[u8]>::to_vec)
}

fn read_str(c: &mut Caller<'_, State>, ptr: i32, len: i32) -> Option<String> {
    String::from_utf8(read(c, ptr, len)?).ok()
}

fn write_u32(c: &mut Caller<'_, State>, ptr: i32, v: u32) -> bool {
    let (m, _) = mem(c);
    match m.get_mut(ptr as u32 as usize..ptr as u32 as usize + 4) {
        Some(s) => {
            s.copy_from_slice(&v.to_le_bytes());
            true
        }
        None => false,
    }
}

fn write_u64(c: &mut Caller<'_, State>, ptr: i32, v: u64) -> bool {
    let (m, _) = mem(c);
    match m.get_mut(ptr as u32 as usize..ptr as u32 as usize + 8) {
        Some(s) => {
            s.copy_from_slice(&v.to_le_bytes());
            true
        }
        None => false,
    }
}

/// Copies `data` into guest memory allocated by the guest, and writes (ptr, len) to the return
/// pointers. Empty data returns a null pointer (the SDK reads that as "no value").
fn give(c: &mut Caller<'_, State>, data: &[u8], ret_ptr: i32, ret_len: i32) -> Result<i32> {
    let ptr = if data.is_empty() {
        0
    } else {
        let alloc = c
            .data()
            .alloc
            .clone()
            .expect("allocator set at instantiation");
        let p = alloc.call(&mut *c, data.len() as i32)?;
        let (m, _) = mem(c);
        let at = p as u32 as usize;
        m.get_mut(at..at + data.len())
            .ok_or_else(|| anyhow!("guest allocation out of bounds"))?
            .copy_from_slice(data);
        p
    };
    if !write_u32(c, ret_ptr, ptr as u32) || !write_u32(c, ret_len, data.len() as u32) {
        return Ok(status::BAD_ARGUMENT);
    }
    Ok(status::OK)
}

fn serialize_pairs(h: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    for (k, v) in h {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in h {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

fn deserialize_pairs(b: &[u8]) -> Option<Vec<(String, String)>> {
    let rd = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    let n = rd(0)?;
    let mut sizes = Vec::with_capacity(n);
    for i in 0..n {
        sizes.push((rd(4 + 8 * i)?, rd(8 + 8 * i)?));
    }
    let mut at = 4 + 8 * n;
    let mut out = Vec::with_capacity(n);
    for (kl, vl) in sizes {
        let k = std::str::from_utf8(b.get(at..at + kl)?).ok()?.to_string();
        at += kl + 1;
        let v = std::str::from_utf8(b.get(at..at + vl)?).ok()?.to_string();
        at += vl + 1;
        out.push((k, v));
    }
    Some(out)
}

fn linker(engine: &Engine, module: &Module) -> Result<Linker<State>> {
    let mut l: Linker<State> = Linker::new(engine);
    l.func_wrap(
        "env",
        "proxy_log",
        |mut c: Caller<'_, State>, level: i32, p: i32, n: i32| -> i32 {
            let msg = read_str(&mut c, p, n).unwrap_or_default();
            c.data_mut().logs.push((level, msg));
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_log_level",
        |mut c: Caller<'_, State>, ret: i32| -> i32 {
            write_u32(&mut c, ret, 0);
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, State>, ms: i32| -> i32 {
            c.data_mut().tick_period_ms = ms as u32;
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, State>, ret: i32| -> i32 {
            let fixed = *c.data().clock.lock().unwrap();
            let now = fixed.unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            });
            write_u64(&mut c, ret, now);
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, State>, t: i32, start: i32, max: i32, rp: i32, rl: i32| -> Result<i32> {
            let st = c.data();
            let src: &[u8] = match t {
                BUFFER_REQUEST_BODY => &st.body,
                BUFFER_HTTP_CALL_RESPONSE_BODY => &st.call_body,
                BUFFER_PLUGIN_CONFIGURATION => &st.plugin_config,
                BUFFER_VM_CONFIGURATION => &[],
                _ => return Ok(status::NOT_FOUND),
            };
            let start = (start as u32 as usize).min(src.len());
            let end = start.saturating_add(max as u32 as usize).min(src.len());
            let data = src[start..end].to_vec();
            give(&mut c, &data, rp, rl)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |mut c: Caller<'_, State>, t: i32, start: i32, size: i32, p: i32, n: i32| -> i32 {
            if t != BUFFER_REQUEST_BODY {
                return status::UNIMPLEMENTED;
            }
            let Some(data) = read(&mut c, p, n) else {
                return status::BAD_ARGUMENT;
            };
            let body = &mut c.data_mut().body;
            let start = (start as u32 as usize).min(body.len());
            let end = start.saturating_add(size as u32 as usize).min(body.len());
            body.splice(start..end, data);
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Caller<'_, State>, t: i32, kp: i32, kl: i32, rp: i32, rl: i32| -> Result<i32> {
            let Some(k) = read_str(&mut c, kp, kl) else {
                return Ok(status::BAD_ARGUMENT);
            };
            let Some(m) = c.data_mut().map(t) else {
                return Ok(status::BAD_ARGUMENT);
            };
            match header(m, &k).map(|v| v.as_bytes().to_vec()) {
                Some(v) => give(&mut c, &v, rp, rl),
                None => Ok(status::NOT_FOUND),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, State>, t: i32, rp: i32, rl: i32| -> Result<i32> {
            let Some(m) = c.data_mut().map(t) else {
                return Ok(status::BAD_ARGUMENT);
            };
            let data = serialize_pairs(m);
            give(&mut c, &data, rp, rl)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, State>, t: i32, p: i32, n: i32| -> i32 {
            let Some(pairs) = read(&mut c, p, n).and_then(|b| deserialize_pairs(&b)) else {
                return status::BAD_ARGUMENT;
            };
            match c.data_mut().map(t) {
                Some(m) => {
                    *m = pairs;
                    status::OK
                }
                None => status::BAD_ARGUMENT,
            }
        },
    )?;
    for (name, mode) in [
        ("proxy_add_header_map_value", 0),
        ("proxy_replace_header_map_value", 1),
    ] {
        l.func_wrap(
            "env",
            name,
            move |mut c: Caller<'_, State>, t: i32, kp: i32, kl: i32, vp: i32, vl: i32| -> i32 {
                let (Some(k), Some(v)) = (read_str(&mut c, kp, kl), read_str(&mut c, vp, vl))
                else {
                    return status::BAD_ARGUMENT;
                };
                let Some(m) = c.data_mut().map(t) else {
                    return status::BAD_ARGUMENT;
                };
                if mode == 1 {
                    m.retain(|e| e.0 != k);
                }
                m.push((k, v));
                status::OK
            },
        )?;
    }
    l.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, State>, t: i32, kp: i32, kl: i32| -> i32 {
            let Some(k) = read_str(&mut c, kp, kl) else {
                return status::BAD_ARGUMENT;
            };
            match c.data_mut().map(t) {
                Some(m) => {
                    m.retain(|e| e.0 != k);
                    status::OK
                }
                None => status::BAD_ARGUMENT,
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Caller<'_, State>, kp: i32, kl: i32, rp: i32, rl: i32, rc: i32| -> Result<i32> {
            let Some(k) = read_str(&mut c, kp, kl) else {
                return Ok(status::BAD_ARGUMENT);
            };
            let Some((v, cas)) = c.data().shared.get(&k) else {
                return Ok(status::NOT_FOUND);
            };
            let s = give(&mut c, &v, rp, rl)?;
            write_u32(&mut c, rc, cas);
            Ok(s)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Caller<'_, State>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| -> i32 {
            let (Some(k), Some(v)) = (read_str(&mut c, kp, kl), read(&mut c, vp, vl)) else {
                return status::BAD_ARGUMENT;
            };
            if c.data().shared.set(&k, &v, cas as u32) {
                status::OK
            } else {
                status::CAS_MISMATCH
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: Caller<'_, State>, pp: i32, pl: i32, rp: i32, rl: i32| -> Result<i32> {
            let Some(k) = read(&mut c, pp, pl) else {
                return Ok(status::BAD_ARGUMENT);
            };
            // Paths arrive NUL-separated; stored under the same bytes read as a string.
            let k = String::from_utf8_lossy(&k).into_owned();
            match c.data().properties.get(&k).cloned() {
                Some(v) => give(&mut c, &v, rp, rl),
                None => Ok(status::NOT_FOUND),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: Caller<'_, State>, pp: i32, pl: i32, vp: i32, vl: i32| -> i32 {
            let (Some(k), Some(v)) = (read(&mut c, pp, pl), read(&mut c, vp, vl)) else {
                return status::BAD_ARGUMENT;
            };
            let k = String::from_utf8_lossy(&k).into_owned();
            c.data_mut().properties.insert(k, v);
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Caller<'_, State>, t: i32, np: i32, nl: i32, rid: i32| -> i32 {
            let Some(name) = read_str(&mut c, np, nl) else {
                return status::BAD_ARGUMENT;
            };
            let id = c.data().stats.define(t, &name);
            write_u32(&mut c, rid, id);
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_increment_metric",
        |c: Caller<'_, State>, id: i32, by: i64| -> i32 {
            match c.data().stats.with(id as u32, |v| *v += by) {
                Some(()) => status::OK,
                None => status::NOT_FOUND,
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_record_metric",
        |c: Caller<'_, State>, id: i32, val: i64| -> i32 {
            match c.data().stats.with(id as u32, |v| *v = val) {
                Some(()) => status::OK,
                None => status::NOT_FOUND,
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_metric",
        |mut c: Caller<'_, State>, id: i32, rp: i32| -> i32 {
            match c.data().stats.with(id as u32, |v| *v) {
                Some(v) => {
                    write_u64(&mut c, rp, v as u64);
                    status::OK
                }
                None => status::NOT_FOUND,
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Caller<'_, State>,
         code: i32,
         _dp: i32,
         _dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         _grpc: i32|
         -> i32 {
            let body = read(&mut c, bp, bl).unwrap_or_default();
            let headers = read(&mut c, hp, hl)
                .and_then(|b| deserialize_pairs(&b))
                .unwrap_or_default();
            c.data_mut().local_response = Some((code as u32, body, headers));
            status::OK
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_effective_context",
        |mut c: Caller<'_, State>, ctx: i32| -> i32 {
            c.data_mut().effective_context = ctx;
            status::OK
        },
    )?;
    for name in ["proxy_continue_stream", "proxy_close_stream"] {
        l.func_wrap("env", name, |_: Caller<'_, State>, _t: i32| -> i32 {
            status::OK
        })?;
    }
    l.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Caller<'_, State>,
         up: i32,
         upl: i32,
         hd: i32,
         hdl: i32,
         bd: i32,
         bdl: i32,
         _tr: i32,
         _trl: i32,
         timeout_ms: i32,
         ret: i32|
         -> i32 {
            let (Some(cluster), Some(h), Some(body)) = (
                read_str(&mut c, up, upl),
                read(&mut c, hd, hdl),
                read(&mut c, bd, bdl),
            ) else {
                return status::BAD_ARGUMENT;
            };
            let Some(headers) = deserialize_pairs(&h) else {
                return status::BAD_ARGUMENT;
            };
            let st = c.data_mut();
            st.next_token = st.next_token.wrapping_add(1).max(1);
            let token = st.next_token;
            st.http_calls.push(HttpCall {
                token,
                cluster,
                headers,
                body,
                timeout_ms: timeout_ms as u32,
            });
            if write_u32(&mut c, ret, token) {
                status::OK
            } else {
                status::BAD_ARGUMENT
            }
        },
    )?;
    l.func_wrap("env", "proxy_done", |_: Caller<'_, State>| -> i32 {
        status::OK
    })?;
    // WASI (wasip1) imports the Rust std runtime pulls in.
    let wasi = "wasi_snapshot_preview1";
    l.func_wrap(
        wasi,
        "environ_sizes_get",
        |mut c: Caller<'_, State>, a: i32, b: i32| -> i32 {
            write_u32(&mut c, a, 0);
            write_u32(&mut c, b, 0);
            0
        },
    )?;
    l.func_wrap(
        wasi,
        "environ_get",
        |_: Caller<'_, State>, _a: i32, _b: i32| -> i32 { 0 },
    )?;
    l.func_wrap(
        wasi,
        "fd_write",
        |mut c: Caller<'_, State>, fd: i32, iovs: i32, n: i32, ret: i32| -> i32 {
            let mut total = 0u32;
            let mut text = Vec::new();
            for i in 0..n {
                let Some(iov) = read(&mut c, iovs + 8 * i, 8) else {
                    return 21; // EFAULT
                };
                let p = i32::from_le_bytes(iov[..4].try_into().unwrap());
                let l = i32::from_le_bytes(iov[4..].try_into().unwrap());
                let Some(b) = read(&mut c, p, l) else {
                    return 21;
                };
                total += l as u32;
                text.extend_from_slice(&b);
            }
            let msg = String::from_utf8_lossy(&text).into_owned();
            c.data_mut().logs.push((100 + fd, msg));
            write_u32(&mut c, ret, total);
            0
        },
    )?;
    l.func_wrap(
        wasi,
        "proc_exit",
        |_: Caller<'_, State>, code: i32| -> Result<()> { bail!("proc_exit({code})") },
    )?;
    // Everything else the module imports (gRPC, HTTP calls, queues, ...) is unimplemented.
    for imp in module.imports() {
        let wasmtime::ExternType::Func(ft) = imp.ty() else {
            continue;
        };
        let results: Vec<wasmtime::ValType> = ft.results().collect();
        // Defining an import again fails (no shadowing): that is how the ones above are kept.
        let _ = l.func_new(imp.module(), imp.name(), ft.clone(), move |_, _, out| {
            for (o, t) in out.iter_mut().zip(&results) {
                *o = match t {
                    wasmtime::ValType::I64 => Val::I64(i64::from(status::UNIMPLEMENTED)),
                    _ => Val::I32(status::UNIMPLEMENTED),
                };
            }
            Ok(())
        });
    }
    Ok(l)
}
