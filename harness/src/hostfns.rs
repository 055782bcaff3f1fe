//! The host functions: the proxy-wasm ABI 0.2.1 imports (and the few WASI ones Rust's std
//! pulls in) implemented over a VM's [`State`].

use crate::memory::{
    deserialize_pairs, give, read, read_str, serialize_pairs, write_u32, write_u64,
};
use crate::vm::{header, HttpCall, State};
use crate::{
    status, BUFFER_HTTP_CALL_RESPONSE_BODY, BUFFER_PLUGIN_CONFIGURATION, BUFFER_REQUEST_BODY,
    BUFFER_VM_CONFIGURATION,
};
use anyhow::{bail, Result};
use std::time::{SystemTime, UNIX_EPOCH};
use wasmtime::{Caller, Engine, Linker, Module, Val};

pub(crate) fn linker(engine: &Engine, module: &Module) -> Result<Linker<State>> {
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
