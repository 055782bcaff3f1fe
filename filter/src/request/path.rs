//! Which inference endpoint a request path names: the path normalized as the worker's HTTP
//! server routes on it (query dropped, every `%XX` decoded, repeated slashes merged, dot segments
//! resolved) and matched, with no allocation. Costs: one pass over at most
//! [`MAX_CLASSIFIED_PATH`] bytes.

/// Inference endpoints the filter understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Generate,
}

impl Endpoint {
    /// Classifies a request line by its *normalized* path, the path the worker's HTTP server
    /// routes on: the query string is dropped, every `%XX` is decoded (`%63` -> `c`, `%2F` ->
    /// `/`), repeated slashes are merged and `.` / `..` segments resolved. So
    /// `/v1/chat/%63ompletions`, `/v1/chat%2Fcompletions` and `//v1/completions` are inference
    /// requests, not passthrough (the shipped Envoy configs also normalize before the filter).
    /// Only `POST` (and `PUT` for the native `/generate`, as SGLang accepts) are inference.
    /// No allocation: paths longer than [`MAX_CLASSIFIED_PATH`] bytes are not inference paths.
    pub fn classify(method: &[u8], path: &[u8]) -> Option<Endpoint> {
        let mut buf = [0u8; MAX_CLASSIFIED_PATH];
        let path = normalize_path(path, &mut buf)?;
        let post = method == b"POST";
        match path {
            b"/v1/chat/completions" if post => Some(Endpoint::Chat),
            b"/v1/completions" if post => Some(Endpoint::Completions),
            b"/generate" if post || method == b"PUT" => Some(Endpoint::Generate),
            _ => None,
        }
    }
}

/// Longest path [`Endpoint::classify`] normalizes (ours are at most 20 bytes).
pub const MAX_CLASSIFIED_PATH: usize = 64;

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Writes the normalized form of `path` (see [`Endpoint::classify`]) into `buf`; `None` when it
/// does not fit.
pub fn normalize_path<'b>(path: &[u8], buf: &'b mut [u8; MAX_CLASSIFIED_PATH]) -> Option<&'b [u8]> {
    let path = match path.iter().position(|&b| b == b'?' || b == b'#') {
        Some(q) => &path[..q],
        None => path,
    };
    // Percent-decode and merge slashes in one pass.
    let mut n = 0usize;
    let mut i = 0usize;
    while i < path.len() {
        let mut c = path[i];
        i += 1;
        if c == b'%' {
            if let (Some(h), Some(l)) = (
                path.get(i).copied().and_then(hex),
                path.get(i + 1).copied().and_then(hex),
            ) {
                c = h << 4 | l;
                i += 2;
            }
        }
        if c == b'/' && n > 0 && buf[n - 1] == b'/' {
            continue;
        }
        *buf.get_mut(n)? = c;
        n += 1;
    }
    // Resolve `.` and `..` segments in place.
    let mut out = 0usize;
    let mut seg = 0usize;
    while seg < n {
        let end = buf[seg..n]
            .iter()
            .skip(1)
            .position(|&b| b == b'/')
            .map_or(n, |p| seg + 1 + p);
        let s = &buf[seg..end];
        let name = s.strip_prefix(b"/").unwrap_or(s);
        if name == b"." {
            // drop
        } else if name == b".." {
            out = buf[..out].iter().rposition(|&b| b == b'/').unwrap_or(0);
        } else {
            buf.copy_within(seg..end, out);
            out += end - seg;
        }
        seg = end;
    }
    if out == 0 {
        buf[0] = b'/';
        out = 1;
    }
    Some(&buf[..out])
}
