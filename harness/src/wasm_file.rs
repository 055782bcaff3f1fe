//! Locating (always freshly built) the filter's `.wasm`, and reading a module's export list.
//!
//! Tests must never run a stale module: [`filter_wasm`] runs `cargo build` for the filter once
//! per process (cargo's own freshness check; about a second when nothing changed) instead of
//! reusing whatever file is on disk.

use anyhow::{bail, Context as _, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub(crate) fn target_dir() -> PathBuf {
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    if target.is_absolute() {
        target
    } else {
        root.join(target)
    }
}

/// The standard path of the filter built for Wasm
/// (`cargo build -p prefix-router --target wasm32-wasip1 --release`).
pub fn default_wasm_path() -> PathBuf {
    target_dir().join("wasm32-wasip1/release/prefix_router.wasm")
}

/// The filter's `.wasm`: `PREFIX_ROUTER_WASM` if set (the caller vouches for it), else built
/// from the current sources with `cargo build -p prefix-router --target wasm32-wasip1
/// --release` into a separate target directory (`target/proxy-wasm-host`: a `cargo test` holds
/// the main one's lock, building there would deadlock). Built once per process.
pub fn filter_wasm() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PREFIX_ROUTER_WASM") {
        return Ok(PathBuf::from(p));
    }
    static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    match BUILT.get_or_init(|| build().map_err(|e| format!("{e:#}"))) {
        Ok(p) => Ok(p.clone()),
        Err(e) => bail!("{e}"),
    }
}

fn build() -> Result<PathBuf> {
    let own = target_dir().join("proxy-wasm-host");
    let built = own.join("wasm32-wasip1/release/prefix_router.wasm");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = std::process::Command::new(cargo)
        .current_dir(workspace_root())
        .args([
            "build",
            "--quiet",
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
            "building {} failed: run `cargo build -p prefix-router --target wasm32-wasip1 \
             --release --target-dir {}`",
            built.display(),
            own.display()
        );
    }
    Ok(built)
}

fn leb_u32(b: &[u8], at: &mut usize) -> Option<u32> {
    let mut v = 0u32;
    for shift in (0..35).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u32::from(byte & 0x7f).checked_shl(shift)?;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// The names a Wasm module exports, in its export section's order (parsed from the binary:
/// section id 7; no compilation).
pub fn wasm_exports(bytes: &[u8]) -> Result<Vec<String>> {
    if bytes.get(..4) != Some(b"\0asm") {
        bail!("not a Wasm module");
    }
    let mut at = 8;
    while at < bytes.len() {
        let id = bytes[at];
        at += 1;
        let size = leb_u32(bytes, &mut at).context("section size")? as usize;
        let end = at.checked_add(size).filter(|&e| e <= bytes.len());
        let end = end.context("section past the end")?;
        if id == 7 {
            let mut p = at;
            let n = leb_u32(bytes, &mut p).context("export count")?;
            let mut out = Vec::new();
            for _ in 0..n {
                let len = leb_u32(bytes, &mut p).context("name length")? as usize;
                let name = bytes.get(p..p + len).context("name past the end")?;
                out.push(String::from_utf8(name.to_vec())?);
                p += len + 1; // name, kind byte
                leb_u32(bytes, &mut p).context("export index")?;
            }
            return Ok(out);
        }
        at = end;
    }
    Ok(Vec::new())
}
