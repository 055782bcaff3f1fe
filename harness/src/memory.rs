//! ABI memory helpers: reading and writing the guest's linear memory, handing bytes to the guest
//! through its allocator, and the proxy-wasm header-pair serialization.

use crate::status;
use crate::vm::State;
use anyhow::{anyhow, Result};
use wasmtime::Caller;

fn mem<'a>(c: &'a mut Caller<'_, State>) -> (&'a mut [u8], &'a mut State) {
    let m = c.data().memory.expect("memory set at instantiation");
    m.data_and_store_mut(c)
}

pub(crate) fn read(c: &mut Caller<'_, State>, ptr: i32, len: i32) -> Option<Vec<u8>> {
    let (m, _) = mem(c);
    m.get(ptr as u32 as usize..(ptr as u32 as usize).checked_add(len as u32 as usize)?)
        .map(<[u8]>::to_vec)
}

pub(crate) fn read_str(c: &mut Caller<'_, State>, ptr: i32, len: i32) -> Option<String> {
    String::from_utf8(read(c, ptr, len)?).ok()
}

pub(crate) fn write_u32(c: &mut Caller<'_, State>, ptr: i32, v: u32) -> bool {
    let (m, _) = mem(c);
    match m.get_mut(ptr as u32 as usize..ptr as u32 as usize + 4) {
        Some(s) => {
            s.copy_from_slice(&v.to_le_bytes());
            true
        }
        None => false,
    }
}

pub(crate) fn write_u64(c: &mut Caller<'_, State>, ptr: i32, v: u64) -> bool {
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
pub(crate) fn give(
    c: &mut Caller<'_, State>,
    data: &[u8],
    ret_ptr: i32,
    ret_len: i32,
) -> Result<i32> {
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

pub(crate) fn serialize_pairs(h: &[(String, String)]) -> Vec<u8> {
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

pub(crate) fn deserialize_pairs(b: &[u8]) -> Option<Vec<(String, String)>> {
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
