//! The VM driver: [`Host`] (one Envoy process: compiled module, shared data, stats) and [`Vm`]
//! (one worker thread's instance), calling the module's callbacks in Envoy's order.

use crate::hostfns::linker;
use crate::shared::{SharedData, Stats};
use crate::wasm_file::filter_wasm;
use crate::{
    MAP_HTTP_CALL_RESPONSE_HEADERS, MAP_REQUEST_HEADERS, MAP_RESPONSE_HEADERS, ROOT_CONTEXT,
};
use anyhow::{anyhow, bail, Context as _, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use wasmtime::{CallHook, Config, Engine, Instance, Linker, Memory, Module, Store, TypedFunc};

/// Host options.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Count wasmtime fuel per call (slows execution somewhat).
    pub fuel: bool,
}

/// The module compiled for an engine with `cfg`. Compiling the filter with cranelift takes
/// tens of seconds in the tests' debug build, and every test makes its own [`Host`]: so the
/// engine and module are shared within the process (a `Module` clone shares its code), and the
/// compiled code is kept on disk (`target/proxy-wasm-host/cwasm/`, keyed by the wasm's bytes
/// and the options) for the other test binaries of the same `cargo test`. wasmtime refuses a
/// cached artifact from another wasmtime build or engine configuration; it is then compiled
/// again and replaced.
fn compiled(cfg: &Config, bytes: &[u8], fuel: bool) -> Result<(Engine, Module)> {
    use std::hash::{Hash, Hasher};
    type Compiled = HashMap<(u64, bool, bool), (Engine, Module)>;
    static CACHE: Mutex<Option<Compiled>> = Mutex::new(None);
    let perfmap = std::env::var_os("PREFIX_ROUTER_PERFMAP").is_some();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    let key = (h.finish(), fuel, perfmap);
    let mut cache = CACHE.lock().map_err(|_| anyhow!("module cache poisoned"))?;
    if let Some(c) = cache.get_or_insert_with(HashMap::new).get(&key) {
        return Ok(c.clone());
    }
    let engine = Engine::new(cfg)?;
    let dir = crate::wasm_file::target_dir().join("proxy-wasm-host/cwasm");
    let file = dir.join(format!("{:016x}-{}-{}.cwasm", key.0, fuel, perfmap));
    // SAFETY: the file is one this function wrote from `precompile_module` (a private cache
    // under the build's target directory); wasmtime checks its version and configuration.
    let cached = (!perfmap && file.is_file())
        .then(|| unsafe { Module::deserialize_file(&engine, &file) }.ok())
        .flatten();
    let module = match cached {
        Some(m) => m,
        // perf maps are written while compiling: no cache then
        None if perfmap => Module::new(&engine, bytes)?,
        None => {
            let code = engine.precompile_module(bytes)?;
            // A failed write only costs the next process a compile.
            let tmp = file.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::create_dir_all(&dir).is_ok() && std::fs::write(&tmp, &code).is_ok() {
                let _ = std::fs::rename(&tmp, &file);
            }
            // SAFETY: bytes `precompile_module` produced for this engine just now.
            unsafe { Module::deserialize(&engine, &code)? }
        }
    };
    if let Some(c) = cache.as_mut() {
        c.insert(key, (engine.clone(), module.clone()));
    }
    Ok((engine, module))
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

impl Host {
    pub fn new(wasm: &Path, opts: Options) -> Result<Host> {
        let mut cfg = Config::new();
        cfg.consume_fuel(opts.fuel);
        // `perf record` can name the module's functions (JIT code) with this set.
        if std::env::var_os("PREFIX_ROUTER_PERFMAP").is_some() {
            cfg.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let bytes = std::fs::read(wasm).with_context(|| format!("reading {}", wasm.display()))?;
        let (engine, module) = compiled(&cfg, &bytes, opts.fuel)?;
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
        let (vm, accepted) = self.vm_any(plugin_config)?;
        if !accepted {
            bail!("proxy_on_configure failed: {:?}", vm.logs());
        }
        Ok(vm)
    }

    /// A new VM whose `proxy_on_configure` may refuse `plugin_config` (Envoy keeps such a VM
    /// only in some failure modes; its streams must still never trap): (VM, accepted).
    pub fn vm_any(&self, plugin_config: &str) -> Result<(Vm, bool)> {
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
        let accepted = vm.f.configure.call(&mut vm.store, (ROOT_CONTEXT, n))? != 0;
        Ok((vm, accepted))
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
    pub(crate) shared: Arc<SharedData>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) clock: Arc<Mutex<Option<u64>>>,
    pub(crate) plugin_config: Vec<u8>,
    pub(crate) memory: Option<Memory>,
    pub(crate) alloc: Option<TypedFunc<i32, i32>>,
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
    pub(crate) next_token: u32,
    /// The answer being delivered to `proxy_on_http_call_response`.
    pub(crate) call_headers: Vec<(String, String)>,
    pub(crate) call_body: Vec<u8>,
    /// Calls from the module into the host (each one a host call in Envoy) and from the host
    /// into the module (callbacks, including the allocator the host calls to return data).
    pub host_calls: u64,
    pub guest_calls: u64,
}

impl State {
    pub(crate) fn map(&mut self, t: i32) -> Option<&mut Vec<(String, String)>> {
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
    /// Optional callbacks: as Envoy (proxy-wasm-cpp-host) does, a callback the module does not
    /// export is skipped.
    response_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    done: Option<TypedFunc<i32, i32>>,
    log: Option<TypedFunc<i32, ()>>,
    delete: Option<TypedFunc<i32, ()>>,
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
            response_headers: i.get_typed_func(&mut *s, "proxy_on_response_headers").ok(),
            done: i.get_typed_func(&mut *s, "proxy_on_done").ok(),
            log: i.get_typed_func(&mut *s, "proxy_on_log").ok(),
            delete: i.get_typed_func(&mut *s, "proxy_on_delete").ok(),
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

pub(crate) fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
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

    /// Ends a stream: `on_response_headers` (with `response_headers`, after a `:status` of 200
    /// unless they carry their own), then `on_done`, `on_log`, `on_delete` as Envoy does.
    /// Returns the response headers after the filter.
    pub fn finish(
        &mut self,
        ctx: i32,
        response_headers: &[(&str, &str)],
    ) -> Result<Vec<(String, String)>> {
        {
            let st = self.store.data_mut();
            st.response_headers.clear();
            if !response_headers.iter().any(|(k, _)| *k == ":status") {
                st.response_headers.push((":status".into(), "200".into()));
            }
            st.response_headers.extend(
                response_headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string())),
            );
        }
        let n = self.store.data().response_headers.len() as i32;
        if let Some(f) = self.f.response_headers.clone() {
            f.call(&mut self.store, (ctx, n, 0))?;
        }
        self.done(ctx)?;
        if let Some(f) = self.f.log.clone() {
            f.call(&mut self.store, ctx)?;
        }
        self.delete(ctx)?;
        Ok(std::mem::take(&mut self.store.data_mut().response_headers))
    }

    fn done(&mut self, ctx: i32) -> Result<bool> {
        match self.f.done.clone() {
            Some(f) => Ok(f.call(&mut self.store, ctx)? != 0),
            None => Ok(true),
        }
    }

    fn delete(&mut self, ctx: i32) -> Result<()> {
        if let Some(f) = self.f.delete.clone() {
            f.call(&mut self.store, ctx)?;
        }
        Ok(())
    }

    /// Ends a stream that never got a response (client abort, reset): `on_done`, `on_delete`.
    pub fn abort(&mut self, ctx: i32) -> Result<()> {
        self.done(ctx)?;
        self.delete(ctx)
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
        let done = self.done(ROOT_CONTEXT)?;
        self.delete(ROOT_CONTEXT)?;
        Ok(done)
    }
}
