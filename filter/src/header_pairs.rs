//! The proxy-wasm serialization of a header map: a `u32` count, then a (key length, value
//! length) `u32` pair per header, then each key and each value followed by a NUL. Envoy returns
//! a whole map this way from one `proxy_get_header_map_pairs` call and takes it this way for
//! `proxy_dispatch_http_call` and `proxy_send_local_response`.
//!
//! Why the filter reads request headers as one map: every host call is a V8 boundary crossing
//! and every returned value a re-entrant call into the module's allocator. One map read gives
//! `:method`, `:path`, the tenant header and whether the client sent any of the filter's own
//! routing headers (removed only then), where separate reads cost a call each (see
//! `glue::Stream::on_request_headers`).
//!
//! [`decode`] borrows from the buffer and never panics: a truncated or inconsistent buffer ends
//! the iteration early (the headers before the damage are still yielded).

/// Serializes `(name, value)` pairs; one allocation of the exact size.
pub fn encode<K: AsRef<[u8]>, V: AsRef<[u8]>>(h: &[(K, V)]) -> Vec<u8> {
    let size = 4 + h
        .iter()
        .map(|(k, v)| 10 + k.as_ref().len() + v.as_ref().len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    for (k, v) in h {
        out.extend_from_slice(&(k.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (k, v) in h {
        out.extend_from_slice(k.as_ref());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

/// The `(name, value)` pairs of a serialized map, in order.
pub fn decode(b: &[u8]) -> Pairs<'_> {
    let n = u32_at(b, 0).map_or(0, |n| n as usize);
    // The size table must fit; a count the buffer cannot hold yields nothing.
    let data = n
        .checked_mul(8)
        .and_then(|t| t.checked_add(4))
        .filter(|&d| d <= b.len());
    match data {
        Some(data) => Pairs { b, n, i: 0, data },
        None => Pairs {
            b,
            n: 0,
            i: 0,
            data: 0,
        },
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let w = b.get(at..at.checked_add(4)?)?.first_chunk::<4>()?;
    Some(u32::from_le_bytes(*w))
}

/// Iterator of [`decode`].
pub struct Pairs<'a> {
    b: &'a [u8],
    n: usize,
    i: usize,
    /// Where the next key starts.
    data: usize,
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.i >= self.n {
            return None;
        }
        let sizes = 4 + 8 * self.i;
        let k = u32_at(self.b, sizes)? as usize;
        let v = u32_at(self.b, sizes + 4)? as usize;
        let key_end = self.data.checked_add(k)?;
        let val_start = key_end.checked_add(1)?;
        let val_end = val_start.checked_add(v)?;
        let (Some(key), Some(val)) = (
            self.b.get(self.data..key_end),
            self.b.get(val_start..val_end),
        ) else {
            self.n = 0;
            return None;
        };
        self.data = val_end + 1;
        self.i += 1;
        Some((key, val))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let h = [
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("x-e", ""),
        ];
        let b = encode(&h);
        let got: Vec<_> = decode(&b).collect();
        let want: Vec<(&[u8], &[u8])> = h
            .iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .collect();
        assert_eq!(got, want);
        assert_eq!(decode(&encode::<&str, &str>(&[])).count(), 0);
    }

    #[test]
    fn damaged_buffers_end_early_without_panicking() {
        let b = encode(&[("a", "1"), ("bb", "22")]);
        for cut in 0..b.len() {
            let n = decode(&b[..cut]).count();
            assert!(n <= 2, "cut {cut}");
        }
        // The last NUL is not needed to read the last value.
        assert_eq!(decode(&b[..b.len() - 1]).count(), 2);
        assert_eq!(decode(&b[..b.len() - 2]).count(), 1);
        // A huge count or huge lengths.
        let mut big = b.clone();
        big[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&big).count(), 0);
        let mut big = b.clone();
        big[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&big).count(), 0);
        assert_eq!(decode(&[]).count(), 0);
    }
}
