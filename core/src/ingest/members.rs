//! Cluster membership: which nodes exist, as the Envoy cluster the requests go to says.
//!
//! Envoy's override_host policy only sends a request to a host that is a member of the
//! cluster; any other address in the routing header is ignored and the fallback balancer
//! routes (see ../shared/NOTES.md). So a balancer that keeps its own list drifts from the
//! truth whenever the cluster changes — a node added by EDS gets nothing, a node removed keeps
//! being "chosen" and the choice silently becomes the fallback's. The filter cannot ask Envoy
//! for a cluster's hosts through the proxy-wasm ABI, but Envoy's admin endpoint lists them
//! (`GET /clusters?format=json`, the `envoy.admin.v3.Clusters` message), and a callout through
//! a cluster that points at the admin listener reads it. This module reads that answer: the
//! members of one cluster, as `ip:port` in the form the routing header needs (IPv6 bracketed).
//!
//! A host that Envoy itself will not route to is not a member for the choice either: EDS can
//! mark it `UNHEALTHY`, `DRAINING` or `TIMEOUT`, and Envoy's active health checking can fail
//! it (`failed_active_health_check`). `DEGRADED` stays: Envoy still routes to it.

use serde_json::Value;
use std::collections::HashSet;

/// The members of one cluster, and what was left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members {
    /// `ip:port` of each host Envoy routes to, in the answer's order, without repeats.
    pub addresses: Vec<String>,
    /// Hosts left out because Envoy does not route to them (EDS status, health checks).
    pub unroutable: usize,
    /// Hosts whose address is not an IP socket address (a pipe, an internal address).
    pub unaddressable: usize,
}

/// Why an admin answer gave no member list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipError {
    NotJson(String),
    /// The answer has no `cluster_statuses` list.
    NotClusters,
    /// No cluster of that name: a typo in `membership.cluster`, or not loaded (yet).
    NoSuchCluster(String),
}

impl std::fmt::Display for MembershipError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MembershipError::NotJson(e) => write!(f, "not JSON: {e}"),
            MembershipError::NotClusters => {
                write!(f, "no cluster_statuses (not /clusters?format=json)")
            }
            MembershipError::NoSuchCluster(c) => write!(f, "Envoy has no cluster named {c:?}"),
        }
    }
}

/// Reads the members of `cluster` from an admin `/clusters?format=json` answer.
pub fn parse_members(body: &[u8], cluster: &str) -> Result<Members, MembershipError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| MembershipError::NotJson(e.to_string()))?;
    let statuses = v
        .get("cluster_statuses")
        .and_then(Value::as_array)
        .ok_or(MembershipError::NotClusters)?;
    let c = statuses
        .iter()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(cluster))
        .ok_or_else(|| MembershipError::NoSuchCluster(cluster.to_string()))?;
    let mut members = Members::default();
    // A cluster with no hosts has no `host_statuses` at all.
    let hosts = c.get("host_statuses").and_then(Value::as_array);
    // Repeats are dropped by a set of the addresses taken so far: a cluster can have
    // thousands of hosts, and a search of the list for each one would grow with the square.
    let mut taken = HashSet::with_capacity(hosts.map_or(0, Vec::len));
    for h in hosts.into_iter().flatten() {
        let Some(address) = socket_address(h) else {
            members.unaddressable += 1;
            continue;
        };
        if !routable(h) {
            members.unroutable += 1;
            continue;
        }
        if taken.insert(address.clone()) {
            members.addresses.push(address);
        }
    }
    Ok(members)
}

/// `ip:port` of a host status, bracketing IPv6 as Envoy's override_host expects.
fn socket_address(h: &Value) -> Option<String> {
    let sa = h.get("address")?.get("socket_address")?;
    let ip = sa.get("address")?.as_str()?;
    let port = sa.get("port_value")?.as_u64()?;
    if port == 0 || port > 65_535 {
        return None;
    }
    let address = if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    };
    crate::config::is_ip_port(&address).then_some(address)
}

fn routable(h: &Value) -> bool {
    let Some(status) = h.get("health_status") else {
        return true;
    };
    let eds = status.get("eds_health_status").and_then(Value::as_str);
    if matches!(eds, Some("UNHEALTHY" | "DRAINING" | "TIMEOUT")) {
        return false;
    }
    // Flags Envoy sets when its own health checking or outlier detection takes a host out.
    let failed = |k: &str| status.get(k).and_then(Value::as_bool) == Some(true);
    !(failed("failed_active_health_check")
        || failed("failed_outlier_check")
        || failed("pending_dynamic_removal"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(ip: &str, port: u64, health: &str) -> String {
        format!(
            r#"{{"address":{{"socket_address":{{"address":"{ip}","port_value":{port}}}}},
               "stats":[{{"name":"cx_total"}}],"health_status":{health},"weight":1,"locality":{{}}}}"#
        )
    }

    fn answer(hosts: &[String]) -> String {
        format!(
            r#"{{"cluster_statuses":[{{"name":"gpu_health","observability_name":"gpu_health"}},
               {{"name":"gpu_nodes","host_statuses":[{}],"observability_name":"gpu_nodes"}}]}}"#,
            hosts.join(",")
        )
    }

    const OK: &str = r#"{"eds_health_status":"HEALTHY"}"#;

    #[test]
    fn members_of_the_named_cluster() {
        type Host<'a> = (&'a str, u64, &'a str);
        // (hosts, members, unroutable, unaddressable)
        let cases: &[(&[Host], &[&str], usize, usize)] = &[
            (
                &[("127.0.0.1", 8001, OK), ("127.0.0.1", 8002, OK)],
                &["127.0.0.1:8001", "127.0.0.1:8002"],
                0,
                0,
            ),
            (&[("::1", 8003, OK)], &["[::1]:8003"], 0, 0),
            (
                &[("10.0.0.1", 80, OK), ("10.0.0.1", 80, OK)],
                &["10.0.0.1:80"],
                0,
                0,
            ),
            (
                &[("10.0.0.1", 80, r#"{"eds_health_status":"DRAINING"}"#)],
                &[],
                1,
                0,
            ),
            (
                &[("10.0.0.1", 80, r#"{"eds_health_status":"UNHEALTHY"}"#)],
                &[],
                1,
                0,
            ),
            (
                &[("10.0.0.1", 80, r#"{"eds_health_status":"DEGRADED"}"#)],
                &["10.0.0.1:80"],
                0,
                0,
            ),
            (
                &[(
                    "10.0.0.1",
                    80,
                    r#"{"failed_active_health_check":true,"eds_health_status":"HEALTHY"}"#,
                )],
                &[],
                1,
                0,
            ),
            (&[("10.0.0.1", 80, "{}")], &["10.0.0.1:80"], 0, 0),
            (&[("gpu-1.example", 80, OK)], &[], 0, 1),
            (&[("10.0.0.1", 0, OK)], &[], 0, 1),
        ];
        for (hosts, want, unroutable, unaddressable) in cases {
            let hosts: Vec<String> = hosts
                .iter()
                .map(|(ip, port, h)| host(ip, *port, h))
                .collect();
            let m = parse_members(answer(&hosts).as_bytes(), "gpu_nodes").unwrap();
            assert_eq!(m.addresses, *want, "{hosts:?}");
            assert_eq!(
                (m.unroutable, m.unaddressable),
                (*unroutable, *unaddressable),
                "{hosts:?}"
            );
        }
    }

    /// The address of member `i` of a large cluster: distinct for every `i` below 2^24.
    fn nth(i: usize) -> (String, u64) {
        (
            format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255),
            8000 + (i % 7) as u64,
        )
    }

    #[test]
    fn repeats_keep_the_first_occurrence_order() {
        // (hosts by index into `nth`, members by index)
        let cases: &[(&[usize], &[usize])] = &[
            (&[], &[]),
            (&[0], &[0]),
            (&[0, 0, 0], &[0]),
            (&[0, 1, 0, 2, 1], &[0, 1, 2]),
            (&[3, 2, 1, 0, 1, 2, 3], &[3, 2, 1, 0]),
            (&[5, 4, 5, 4, 6], &[5, 4, 6]),
        ];
        for (hosts, want) in cases {
            let body: Vec<String> = hosts
                .iter()
                .map(|&i| {
                    let (ip, port) = nth(i);
                    host(&ip, port, OK)
                })
                .collect();
            let m = parse_members(answer(&body).as_bytes(), "gpu_nodes").unwrap();
            let want: Vec<String> = want
                .iter()
                .map(|&i| {
                    let (ip, port) = nth(i);
                    format!("{ip}:{port}")
                })
                .collect();
            assert_eq!(m.addresses, want, "{hosts:?}");
        }
        // The same address with another port, or an unroutable repeat, is not a repeat of a
        // member; an unroutable first occurrence does not hide a routable repeat.
        let drain = r#"{"eds_health_status":"DRAINING"}"#;
        let body = [
            host("10.0.0.1", 80, drain),
            host("10.0.0.1", 81, OK),
            host("10.0.0.1", 80, OK),
            host("10.0.0.1", 81, drain),
            host("10.0.0.1", 80, OK),
        ];
        let m = parse_members(answer(&body).as_bytes(), "gpu_nodes").unwrap();
        assert_eq!(m.addresses, ["10.0.0.1:81", "10.0.0.1:80"]);
        assert_eq!(m.unroutable, 2);
    }

    #[test]
    fn a_large_cluster_with_repeats_parses_quickly() {
        const N: usize = 20_000;
        // Every fifth host repeats an earlier one: 16,000 distinct members.
        let order: Vec<usize> = (0..N)
            .map(|i| {
                let fresh = i - i / 5;
                if i % 5 == 4 {
                    (i * 7919) % fresh
                } else {
                    fresh
                }
            })
            .collect();
        let hosts: Vec<String> = order
            .iter()
            .map(|&i| {
                let (ip, port) = nth(i);
                format!(
                    r#"{{"address":{{"socket_address":{{"address":"{ip}","port_value":{port}}}}}}}"#
                )
            })
            .collect();
        let body = answer(&hosts);
        // The time is taken against the time to read the same answer as JSON, the floor of
        // any reading of it, so that the bound holds on a slow machine (or under wasm) too:
        // a search of the list for each host takes many times that.
        let fastest = |f: &dyn Fn()| {
            (0..3)
                .map(|_| {
                    let start = std::time::Instant::now();
                    f();
                    start.elapsed()
                })
                .min()
                .unwrap_or_default()
        };
        let json = fastest(&|| {
            let _: Value = serde_json::from_slice(body.as_bytes()).unwrap();
        });
        let took = fastest(&|| {
            parse_members(body.as_bytes(), "gpu_nodes").unwrap();
        });
        let m = parse_members(body.as_bytes(), "gpu_nodes").unwrap();
        let distinct = N - N / 5;
        assert_eq!(m.addresses.len(), distinct);
        for (i, a) in m.addresses.iter().enumerate() {
            let (ip, port) = nth(i);
            assert_eq!(*a, format!("{ip}:{port}"));
        }
        assert!(
            took < json * 4 + std::time::Duration::from_millis(50),
            "{distinct} members took {took:?}, reading the JSON {json:?}"
        );
    }

    #[test]
    fn an_empty_cluster_has_no_members() {
        let m = parse_members(answer(&[]).as_bytes(), "gpu_nodes").unwrap();
        assert!(m.addresses.is_empty());
        // Envoy leaves the field out when the cluster has no hosts.
        let m = parse_members(
            br#"{"cluster_statuses":[{"name":"gpu_nodes"}]}"#,
            "gpu_nodes",
        )
        .unwrap();
        assert!(m.addresses.is_empty());
    }

    #[test]
    fn bad_answers_are_errors() {
        let cases: &[(&[u8], MembershipError)] = &[
            (b"<html>", MembershipError::NotJson(String::new())),
            (br#"{"stats":[]}"#, MembershipError::NotClusters),
            (
                br#"{"cluster_statuses":[{"name":"other"}]}"#,
                MembershipError::NoSuchCluster("gpu_nodes".into()),
            ),
        ];
        for (body, want) in cases {
            let got = parse_members(body, "gpu_nodes").unwrap_err();
            match (want, &got) {
                (MembershipError::NotJson(_), MembershipError::NotJson(_)) => {}
                _ => assert_eq!(&got, want),
            }
        }
    }
}
