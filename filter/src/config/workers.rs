//! One worker as written (a cluster name, or cluster, weight and address) and as validated: its
//! stable id, its address syntax.
//!
//! Invariants: a [`Worker`] has a printable cluster, a weight in (0, 1e6], an `IP:PORT` address
//! when one is given, and a non-zero id that hashes its name, so shared data never misreads a
//! reordered config. Costs: configuration time only ([`valid_address`] also at responses).

use super::{err, ConfigError, MAX_ADDRESS};
use serde::Deserialize;

#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum RawWorker {
    Name(String),
    Weighted {
        cluster: String,
        #[serde(default = "default_weight")]
        weight: f64,
        /// The worker's `IP:PORT`, to credit it with the requests it served as another
        /// worker's fallback (`upstream.address` at the response).
        #[serde(default)]
        address: Option<String>,
    },
}

fn default_weight() -> f64 {
    1.0
}

/// One upstream worker (an Envoy cluster).
#[derive(Debug, Clone)]
pub struct Worker {
    /// The worker's cluster; a pool worker's address.
    pub cluster: String,
    pub weight: f64,
    /// `IP:PORT` when known (always for a pool worker): matched against `upstream.address`.
    pub address: Option<String>,
    /// Stable non-zero identity stored in shared data: index holders and load entries name
    /// workers by this id, so a config with reordered or removed workers never misreads them.
    pub id: u32,
}

/// Worker identity: xxh3 of the cluster name, never 0 (0 marks an empty slot).
pub fn worker_id(cluster: &str) -> u32 {
    let h = xxhash_rust::xxh3::xxh3_64(cluster.as_bytes());
    let id = (h ^ (h >> 32)) as u32;
    if id == 0 {
        1
    } else {
        id
    }
}

/// `host:port` with a numeric port, printable, at most [`MAX_ADDRESS`] bytes, no whitespace.
pub fn valid_address(a: &[u8]) -> bool {
    if a.is_empty() || a.len() > MAX_ADDRESS {
        return false;
    }
    if a.iter().any(|b| !b.is_ascii_graphic() || *b == b',') {
        return false;
    }
    let Some(colon) = a.iter().rposition(|&b| b == b':') else {
        return false;
    };
    let (host, port) = (&a[..colon], &a[colon + 1..]);
    !host.is_empty()
        && !port.is_empty()
        && port.len() <= 5
        && port.iter().all(u8::is_ascii_digit)
        && std::str::from_utf8(port)
            .ok()
            .and_then(|p| p.parse::<u16>().ok())
            .is_some_and(|p| p > 0)
}

/// One worker as written (`wf`: its field): its address, cluster name and weight.
pub(crate) fn check_worker(wf: &str, w: &RawWorker) -> Result<Worker, ConfigError> {
    let (cluster, weight, address) = match w {
        RawWorker::Name(c) => (c.clone(), 1.0, None),
        RawWorker::Weighted {
            cluster,
            weight,
            address,
        } => (cluster.clone(), *weight, address.clone()),
    };
    if address
        .as_ref()
        .is_some_and(|a| !valid_address(a.as_bytes()))
    {
        return Err(err(format!("{wf}.address"), "must be IP:PORT"));
    }
    if cluster.is_empty() || cluster.bytes().any(|b| b.is_ascii_control()) {
        return Err(err(wf, "cluster must be a non-empty printable name"));
    }
    if !(weight.is_finite() && weight > 0.0 && weight <= 1e6) {
        return Err(err(format!("{wf}.weight"), "must be > 0 and <= 1e6"));
    }
    Ok(Worker {
        id: worker_id(&cluster),
        cluster,
        weight,
        address,
    })
}

/// `w` (field `wf`) names no worker of `workers` and no id of theirs (ids are hashes of names).
pub(crate) fn check_distinct(wf: &str, workers: &[Worker], w: &Worker) -> Result<(), ConfigError> {
    if let Some(prev) = workers.iter().find(|p| p.id == w.id) {
        let cluster = &w.cluster;
        let msg = if prev.cluster == *cluster {
            format!("duplicate cluster `{cluster}`")
        } else {
            format!("`{cluster}` collides with `{}`; rename one", prev.cluster)
        };
        return Err(err(wf, msg));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_are_stable_and_nonzero() {
        assert_eq!(worker_id("w0"), worker_id("w0"));
        assert_ne!(worker_id("w0"), worker_id("w1"));
        assert_ne!(worker_id(""), 0);
    }
}
