//! What a request claims at admission: how important it is, whose it is, and how soon its first
//! token must come. Read from request headers (and the body's `user`), with the names the
//! Kubernetes inference gateway uses where it has them: `x-gateway-inference-objective` names
//! an objective whose priority the configuration gives (as an `InferenceObjective` does),
//! `x-gateway-inference-fairness-id` names the tenant, and `x-slo-ttft-ms` and `x-slo-tpot-ms`
//! the time-to-first-token and time-per-output-token budgets. `route::admission` decides with them.
//!
//! Reading is total: a value that does not parse is ignored (the claim falls back to its
//! default) and reported as such, so the glue can count it; a client cannot make the filter
//! fail by sending garbage. These headers are claims the client makes: a gateway in front that
//! authenticates tenants should set or strip them, as it would for the inference gateway.

use crate::config::AdmissionConfig;
use crate::ingest::prompt::hash_str;

/// Seed of tenant hashes: the same name from the header or the body is the same tenant.
const TENANT_SEED: u64 = 0x7e4a_4e75_5eed_0001;

/// Longest budget taken (an hour); longer ones are as good as none.
pub const MAX_TTFT_MS: u64 = 3_600_000;

/// A request's claims at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Claim {
    /// Higher goes first; below 0 the request may be shed under saturation.
    pub priority: i32,
    /// The tenant, hashed; requests that name none share the tenant `Claim::NO_TENANT`.
    pub tenant: u64,
    /// The first token must come within this many milliseconds of arrival.
    pub ttft_ms: Option<u64>,
    /// Output tokens must come at most this many milliseconds apart.
    pub tpot_ms: Option<u64>,
}

impl Claim {
    /// The tenant of requests that name none (one shared flow, as the inference gateway's
    /// default flow).
    pub const NO_TENANT: u64 = 0;

    /// May be shed (answered at once) rather than held when the fleet is saturated.
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }
}

/// The tenant id of a name (header value or body `user`).
pub fn tenant_of(name: &str) -> u64 {
    if name.is_empty() {
        Claim::NO_TENANT
    } else {
        // Never the shared flow's id, whatever the hash.
        hash_str(TENANT_SEED, name).max(1)
    }
}

/// The headers' claims; `header` looks a request header up by name (each is looked up only
/// where the configuration makes it matter: the fairness header only with `fair`, since a
/// tenant only matters to a hold queue). `user` is the body's `user` field, when it has one.
/// Also says whether a header was present but unreadable (`bad`).
pub fn read(
    cfg: &AdmissionConfig,
    fair: bool,
    mut header: impl FnMut(&str) -> Option<String>,
    user: Option<&str>,
) -> (Claim, bool) {
    let mut bad = false;
    let mut priority = 0;
    if !cfg.objectives.is_empty() {
        if let Some(name) = header(&cfg.objective_header) {
            let name = name.trim();
            // A name not listed is priority 0, as the inference gateway treats an objective
            // it has no resource for.
            if let Some((_, p)) = cfg.objectives.iter().find(|(n, _)| n == name) {
                priority = *p;
            }
        }
    }
    if let Some(h) = &cfg.priority_header {
        if let Some(v) = header(h) {
            match v.trim().parse::<i32>() {
                Ok(p) if p.unsigned_abs() <= 1_000_000 => priority = p,
                _ => bad = true,
            }
        }
    }
    let mut budget = |name: &str| match header(name) {
        None => None,
        Some(v) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Some(ms.min(MAX_TTFT_MS)),
            _ => {
                bad = true;
                None
            }
        },
    };
    let ttft_ms = budget(&cfg.ttft_header);
    let tpot_ms = budget(&cfg.tpot_header);
    let tenant = if fair {
        match header(&cfg.fairness_header) {
            Some(name) => tenant_of(name.trim()),
            None if cfg.fairness_from_user => user.map_or(Claim::NO_TENANT, tenant_of),
            None => Claim::NO_TENANT,
        }
    } else {
        Claim::NO_TENANT
    };
    (
        Claim {
            priority,
            tenant,
            ttft_ms,
            tpot_ms,
        },
        bad,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AdmissionConfig {
        AdmissionConfig {
            objectives: vec![("premium".into(), 100), ("batch".into(), -10)],
            priority_header: Some("x-priority".into()),
            ..AdmissionConfig::default()
        }
    }

    fn claim(headers: &[(&str, &str)], user: Option<&str>, fair: bool) -> (Claim, bool) {
        read(
            &cfg(),
            fair,
            |name| {
                headers
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            },
            user,
        )
    }

    #[test]
    fn table_of_claims() {
        let alice = tenant_of("alice");
        type Case = (
            &'static str,
            Vec<(&'static str, &'static str)>,
            Option<&'static str>,
            Claim,
            bool,
        );
        let none = Claim::default();
        let cases: Vec<Case> = vec![
            ("no headers: the defaults", vec![], None, none, false),
            (
                "a listed objective gives its priority",
                vec![("x-gateway-inference-objective", "premium")],
                None,
                Claim {
                    priority: 100,
                    ..none
                },
                false,
            ),
            (
                "an objective not listed is priority 0",
                vec![("x-gateway-inference-objective", "gold")],
                None,
                none,
                false,
            ),
            (
                "the priority header wins over the objective",
                vec![
                    ("x-gateway-inference-objective", "premium"),
                    ("x-priority", "-3"),
                ],
                None,
                Claim {
                    priority: -3,
                    ..none
                },
                false,
            ),
            (
                "an unreadable priority is ignored and reported",
                vec![
                    ("x-gateway-inference-objective", "batch"),
                    ("x-priority", "urgent"),
                ],
                None,
                Claim {
                    priority: -10,
                    ..none
                },
                true,
            ),
            (
                "a TTFT budget in milliseconds",
                vec![("x-slo-ttft-ms", " 800 ")],
                None,
                Claim {
                    ttft_ms: Some(800),
                    ..none
                },
                false,
            ),
            (
                "a zero or unreadable budget is none, reported",
                vec![("x-slo-ttft-ms", "0")],
                None,
                none,
                true,
            ),
            (
                "a huge budget is capped",
                vec![("x-slo-ttft-ms", "99999999999")],
                None,
                Claim {
                    ttft_ms: Some(MAX_TTFT_MS),
                    ..none
                },
                false,
            ),
            (
                "a time-per-output-token budget",
                vec![("x-slo-tpot-ms", "50")],
                None,
                Claim {
                    tpot_ms: Some(50),
                    ..none
                },
                false,
            ),
            (
                "the fairness header names the tenant",
                vec![("x-gateway-inference-fairness-id", "alice")],
                Some("bob"),
                Claim {
                    tenant: alice,
                    ..none
                },
                false,
            ),
            (
                "without it the body's user does",
                vec![],
                Some("alice"),
                Claim {
                    tenant: alice,
                    ..none
                },
                false,
            ),
        ];
        for (name, headers, user, want, bad) in cases {
            assert_eq!(claim(&headers, user, true), (want, bad), "{name}");
        }
    }

    #[test]
    fn the_tenant_is_read_only_where_it_matters() {
        let mut asked = Vec::new();
        let (c, _) = read(
            &AdmissionConfig::default(),
            false,
            |name| {
                asked.push(name.to_string());
                Some("alice".into())
            },
            Some("alice"),
        );
        assert_eq!(c.tenant, Claim::NO_TENANT);
        // No objectives listed and no priority header: only the budgets are looked up.
        assert_eq!(
            asked,
            vec!["x-slo-ttft-ms".to_string(), "x-slo-tpot-ms".to_string()]
        );
    }

    #[test]
    fn user_is_not_the_tenant_when_turned_off() {
        let c = AdmissionConfig {
            fairness_from_user: false,
            ..AdmissionConfig::default()
        };
        let (claim, _) = read(&c, true, |_| None, Some("alice"));
        assert_eq!(claim.tenant, Claim::NO_TENANT);
        assert_ne!(tenant_of("alice"), Claim::NO_TENANT);
        assert_eq!(tenant_of(""), Claim::NO_TENANT);
    }

    #[test]
    fn sheddable_below_zero() {
        assert!(Claim {
            priority: -1,
            ..Claim::default()
        }
        .sheddable());
        assert!(!Claim::default().sheddable());
    }
}
