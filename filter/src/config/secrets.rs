//! The secret fields (`hash_key`, `peers.secret`): placeholders refused by name, a minimum
//! length, the hashing key derived from `hash_key`.
//!
//! Invariants: a deploy-time placeholder (`__NAME__`) never works as a secret, whatever its
//! length; no error contains a secret's value (only a placeholder's, which is public).
//! Costs: configuration time only.

use super::{err, ConfigError, RawConfig};

/// Shortest accepted peer secret.
pub const MIN_SECRET_LEN: usize = 16;

/// The 64-bit hashing key of a `hash_key` secret.
pub(super) fn derive_hash_key(secret: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(secret.as_bytes(), 0x6861_7368_6b65_7921)
    // "hashkey!"
}

/// A deploy-time placeholder (`__NAME__`, e.g. `__HASH_KEY__`, `__PREFIX_ROUTER_PEER_SECRET__`)
/// left in a secret field: the shipped configs are public, so a placeholder is a secret everyone
/// knows, refused by name whatever its length.
fn is_placeholder(v: &str) -> bool {
    v.len() > 4
        && v.starts_with("__")
        && v.ends_with("__")
        && v.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// A secret field (`hash_key`, `peers.secret`): not a placeholder, at least [`MIN_SECRET_LEN`]
/// printable characters. Errors never contain the value (only a placeholder's, which is public).
pub(super) fn check_secret(field: &str, v: &str) -> Result<(), ConfigError> {
    if is_placeholder(v) {
        return Err(err(
            field,
            format!(
                "is the placeholder {v} of a shipped config: replace it with the secret at deploy \
                 time (docker/envoy-start.sh, the Kubernetes init containers)"
            ),
        ));
    }
    if v.len() < MIN_SECRET_LEN || v.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        return Err(err(
            field,
            format!("must be at least {MIN_SECRET_LEN} printable characters"),
        ));
    }
    Ok(())
}

/// `hash_key`: a secret (`check_secret`).
pub(super) fn check_hash_key(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(k) = &raw.hash_key {
        check_secret("hash_key", k)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn placeholders_left_in_secret_fields_are_refused_by_name() {
        const M: &str = r#""models":{"m":{"workers":["a"]}}"#;
        for (json, field, placeholder) in [
            (
                format!(r#"{{{M},"hash_key":"__HASH_KEY__"}}"#),
                "hash_key",
                "__HASH_KEY__",
            ),
            (
                format!(r#"{{{M},"peers":{{"secret":"__PREFIX_ROUTER_PEER_SECRET__"}}}}"#),
                "peers.secret",
                "__PREFIX_ROUTER_PEER_SECRET__",
            ),
            // any __NAME__, of any length (a long one would pass the length check)
            (
                format!(r#"{{{M},"hash_key":"__SOME_OTHER_SECRET_2__"}}"#),
                "hash_key",
                "__SOME_OTHER_SECRET_2__",
            ),
        ] {
            let e = Config::from_json(json.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{json}");
            assert!(
                e.message.contains(placeholder) && e.message.contains("placeholder"),
                "{e}"
            );
        }
        // a real secret that merely contains underscores passes, and is never echoed on error
        let ok = format!(
            r#"{{{M},"hash_key":"__k3y_with_lower__","peers":{{"secret":"_0123456789abcdef_"}}}}"#
        );
        assert!(Config::from_json(ok.as_bytes()).is_ok());
        let bad = format!(r#"{{{M},"peers":{{"secret":"s3cr3t with space"}}}}"#);
        let e = Config::from_json(bad.as_bytes()).unwrap_err();
        assert_eq!(e.field, "peers.secret");
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
    }
}
