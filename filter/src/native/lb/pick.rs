//! One attempt's host ([`pick`]): the first host the filter listed that is a healthy member and
//! that this request has not tried yet; when none is left, the healthy host with the fewest
//! requests in flight among those not tried (among all healthy hosts when every one was tried).
//!
//! The filter lists the chosen worker, then its fallbacks by how much of the prompt each is
//! predicted to hold (`Router::destination`), in the destination header. So the first attempt
//! goes to the filter's choice and a retry to the next holder by cached prefix, skipping the
//! host that failed: Envoy's `previous_hosts` retry predicate (on every route envoy/gen writes)
//! is what `LbHost::rejected` asks. Unlike override_host (Envoy 1.40), a listed host Envoy
//! holds unhealthy (health checks, outlier ejection) is skipped rather than tried.
//!
//! Cost of a first attempt whose first listed host is healthy: one header read, one address
//! check, one retry-predicate call; no allocation. A retry adds one check and one predicate
//! call per listed host it skips. The least-busy fallback reads every healthy host's gauge.

use super::hosts::{LbHost, Table};

/// Hosts read from the header at most (the filter lists at most 1 + 16 fallbacks).
pub(crate) const MAX_LISTED: usize = 17;

/// What one attempt picked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pick {
    /// The `rank`-th host of the list (0: the filter's choice), at healthy position `healthy`.
    Listed { healthy: u32, rank: usize },
    /// No listed host was usable: the least busy healthy host.
    Unlisted { healthy: u32 },
    /// No healthy host.
    Nothing,
}

/// The host for this attempt; `header` is the destination header's name (lower case).
pub(crate) fn pick(h: &impl LbHost, table: &mut Table, header: &[u8]) -> Pick {
    let mut rebuilt = false;
    if let Some(list) = h.header(header) {
        let listed = list
            .split(|&b| b == b',')
            .map(trim)
            .filter(|a| !a.is_empty())
            .take(MAX_LISTED);
        for (rank, address) in listed.enumerate() {
            let Some(slot) = table.find(h, address, &mut rebuilt) else {
                continue;
            };
            if !h.rejected(slot.member as usize) {
                return Pick::Listed {
                    healthy: slot.healthy,
                    rank,
                };
            }
        }
    }
    least_busy(h, table, &mut rebuilt)
}

/// The healthy host with the fewest requests in flight, preferring those not tried; ties go to
/// the lower position.
fn least_busy(h: &impl LbHost, table: &mut Table, rebuilt: &mut bool) -> Pick {
    table.refresh(h, rebuilt);
    let mut best: Option<(bool, u64, u32)> = None;
    for i in 0..h.healthy_count().min(u32::MAX as usize) {
        let Some(member) = table.member_of_healthy(i) else {
            break;
        };
        let key = (
            h.rejected(member as usize),
            h.active_requests(member as usize),
            i as u32,
        );
        if best.is_none_or(|b| key < b) {
            best = Some(key);
        }
    }
    match best {
        Some((_, _, healthy)) => Pick::Unlisted { healthy },
        None => Pick::Nothing,
    }
}

fn trim(s: &[u8]) -> &[u8] {
    let start = s
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(s.len());
    let end = s
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    s.get(start..end).unwrap_or(&[])
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeLb;
    use super::*;

    const H: &[u8] = b"x-gateway-destination-endpoint";

    fn lb(hosts: &[&str]) -> FakeLb {
        FakeLb::new(hosts)
    }

    #[test]
    fn the_first_attempt_goes_to_the_filters_choice() {
        let mut f = lb(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        f.header = Some("10.0.0.2:80,10.0.0.3:80".into());
        let mut t = Table::new();
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 1,
                rank: 0
            }
        );
    }

    #[test]
    fn a_retry_goes_to_the_next_listed_host_skipping_the_one_that_failed() {
        let mut f = lb(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        f.header = Some("10.0.0.2:80, 10.0.0.3:80 ,10.0.0.1:80".into());
        f.tried.insert(1);
        let mut t = Table::new();
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 2,
                rank: 1
            }
        );
        f.tried.insert(2);
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 0,
                rank: 2
            }
        );
    }

    #[test]
    fn an_unhealthy_listed_host_is_skipped_and_answers_count_healthy_positions() {
        let mut f = lb(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        f.header = Some("10.0.0.1:80,10.0.0.3:80".into());
        let mut t = Table::new();
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 0,
                rank: 0
            }
        );
        f.unhealthy.insert(0); // healthy hosts are now 10.0.0.2, 10.0.0.3
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 1,
                rank: 1
            }
        );
        f.unhealthy.clear(); // back: seen at its first listing, no membership event needed
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 0,
                rank: 0
            }
        );
    }

    #[test]
    fn a_membership_change_is_followed() {
        let mut f = lb(&["10.0.0.1:80", "10.0.0.2:80"]);
        f.header = Some("10.0.0.9:80".into());
        let mut t = Table::new();
        assert!(matches!(pick(&f, &mut t, H), Pick::Unlisted { .. }));
        f.hosts.insert(0, "10.0.0.9:80".into());
        t.invalidate();
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 0,
                rank: 0
            }
        );
    }

    #[test]
    fn without_a_usable_listed_host_the_least_busy_untried_host_serves() {
        let mut f = lb(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        f.active = vec![0, 5, 2];
        let mut t = Table::new();
        assert_eq!(pick(&f, &mut t, H), Pick::Unlisted { healthy: 0 }); // no header
        f.header = Some("10.0.0.1:80".into());
        f.tried.insert(0);
        assert_eq!(pick(&f, &mut t, H), Pick::Unlisted { healthy: 2 });
        f.tried.extend([1, 2]); // every host tried: still the least busy, not no host
        assert_eq!(pick(&f, &mut t, H), Pick::Unlisted { healthy: 0 });
    }

    #[test]
    fn garbage_in_the_header_and_no_healthy_host_give_defined_answers() {
        let mut f = lb(&["10.0.0.1:80"]);
        let mut t = Table::new();
        for junk in [
            "",
            ",,,",
            " , ",
            "not an address",
            "\u{0}\u{ff}",
            &"1,".repeat(10_000),
        ] {
            f.header = Some(junk.into());
            assert_eq!(
                pick(&f, &mut t, H),
                Pick::Unlisted { healthy: 0 },
                "{junk:?}"
            );
        }
        f.unhealthy.insert(0);
        assert_eq!(pick(&f, &mut t, H), Pick::Nothing);
        let empty = lb(&[]);
        assert_eq!(pick(&empty, &mut Table::new(), H), Pick::Nothing);
    }

    #[test]
    fn an_unhealthy_or_unknown_listed_host_costs_one_call_not_a_rebuild() {
        let mut f = lb(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        f.unhealthy.insert(0);
        f.header = Some("10.0.0.1:80,10.0.0.9:80,10.0.0.2:80".into());
        let mut t = Table::new();
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 0,
                rank: 2
            }
        );
        let reads = f.address_reads.get();
        for _ in 0..10 {
            assert_eq!(
                pick(&f, &mut t, H),
                Pick::Listed {
                    healthy: 0,
                    rank: 2
                }
            );
        }
        assert_eq!(f.address_reads.get() - reads, 10); // the one check of 10.0.0.2
                                                       // A member added without a membership event is still found (the member count moved).
        f.hosts.push("10.0.0.9:80".into());
        assert_eq!(
            pick(&f, &mut t, H),
            Pick::Listed {
                healthy: 2,
                rank: 1
            }
        );
    }

    #[test]
    fn steady_state_picks_do_not_rebuild_the_table() {
        let mut f = lb(&["10.0.0.1:80", "10.0.0.2:80"]);
        f.header = Some("10.0.0.2:80,10.0.0.1:80".into());
        let mut t = Table::new();
        pick(&f, &mut t, H);
        let reads = f.address_reads.get();
        for _ in 0..10 {
            assert_eq!(
                pick(&f, &mut t, H),
                Pick::Listed {
                    healthy: 1,
                    rank: 0
                }
            );
        }
        // One address check per pick, no rebuild (a rebuild reads every host twice).
        assert_eq!(f.address_reads.get() - reads, 10);
    }
}
