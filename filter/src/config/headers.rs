//! The headers the filter reads or sets: their default names and the checks that keep them
//! lower-case and pairwise distinct.
//!
//! Invariants: a name shared by two of these headers is refused, naming both fields, because
//! the filter removes a client's value of every header it sets. Costs: configuration time only.

use super::{err, pd, ConfigError, RawConfig};

pub(super) fn default_cluster_header() -> String {
    "x-prefix-router-cluster".into()
}
pub(super) fn default_destination_header() -> String {
    "x-gateway-destination-endpoint".into()
}

pub(crate) fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Every header the filter reads or sets (`cluster_header`, `prefill_cluster_header`,
/// `destination_header`, `debug_header`, `tenant_header`): lower-case and pairwise distinct. The
/// filter removes a client's value of each header it sets; a name shared with another (e.g. the
/// tenant header Envoy sets after authentication) would keep a client's value or drop a trusted one.
pub(super) fn check_headers(raw: &RawConfig) -> Result<(), ConfigError> {
    if !valid_header_name(&raw.cluster_header) {
        return Err(err(
            "cluster_header",
            "must be a lower-case header name ([a-z0-9_-]+)",
        ));
    }
    if let Some(h) = &raw.debug_header {
        if !valid_header_name(h) || *h == raw.cluster_header {
            return Err(err(
                "debug_header",
                "must be a lower-case header name distinct from cluster_header",
            ));
        }
    }
    pd::check_header(
        &raw.prefill_cluster_header,
        &raw.cluster_header,
        raw.debug_header.as_deref(),
    )?;
    let named = [
        ("cluster_header", Some(raw.cluster_header.as_str())),
        (
            "prefill_cluster_header",
            Some(raw.prefill_cluster_header.as_str()),
        ),
        ("destination_header", Some(raw.destination_header.as_str())),
        ("debug_header", raw.debug_header.as_deref()),
        ("tenant_header", raw.tenant_header.as_deref()),
    ];
    for (i, (field, name)) in named.iter().enumerate() {
        let Some(name) = name else { continue };
        if let Some((first, _)) = named[..i].iter().find(|(_, n)| *n == Some(*name)) {
            return Err(err(
                *field,
                format!(
                    "names the same header as `{first}` ({name}): every header the filter reads \
                     or sets must be distinct"
                ),
            ));
        }
    }
    Ok(())
}

/// `tenant_header`: lower-case and distinct from the cluster and debug headers.
pub(super) fn check_tenant_header(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(h) = &raw.tenant_header {
        if !valid_header_name(h) || *h == raw.cluster_header || raw.debug_header.as_ref() == Some(h)
        {
            return Err(err(
                "tenant_header",
                "must be a lower-case header name distinct from cluster_header and debug_header",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn every_header_name_is_distinct_and_errors_name_both_fields() {
        const M: &str = r#""models":{"m":{"workers":["a"]}}"#;
        let cases = [
            (
                r#""tenant_header":"x-prefix-router-prefill-cluster""#,
                "tenant_header",
                "prefill_cluster_header",
            ),
            (
                r#""tenant_header":"x-t","prefill_cluster_header":"x-t""#,
                "tenant_header",
                "prefill_cluster_header",
            ),
            (
                r#""tenant_header":"x-gateway-destination-endpoint""#,
                "tenant_header",
                "destination_header",
            ),
            (
                r#""debug_header":"x-d","destination_header":"x-d""#,
                "debug_header",
                "destination_header",
            ),
            (
                r#""destination_header":"x-prefix-router-prefill-cluster""#,
                "destination_header",
                "prefill_cluster_header",
            ),
            (
                r#""tenant_header":"x-prefix-router-decision","debug_header":"x-prefix-router-decision""#,
                "tenant_header",
                "debug_header",
            ),
        ];
        for (fields, field, other) in cases {
            let json = format!("{{{M},{fields}}}");
            let e = Config::from_json(json.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.message.contains(other), "{json}: {e}");
        }
        let json = format!(
            r#"{{{M},"tenant_header":"x-tenant","debug_header":"x-prefix-router-decision"}}"#
        );
        assert!(Config::from_json(json.as_bytes()).is_ok());
    }
}
