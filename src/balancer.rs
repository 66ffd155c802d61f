//! The balancer: the fleet of nodes and the three things that happen to it — a health answer
//! arrives, a request is routed, a request ends.
//!
//! This is the whole decision core the Envoy glue drives. It is plain Rust: time comes in as
//! `now_ms` and randomness as a `Rng`, so every behaviour is tested natively and, compiled to
//! wasm32-wasip1, in the same instruction set the filter ships in.

use crate::choice::{self, Decision, Params};
use crate::config::Config;
use crate::node::{NodeState, Ticket};
use crate::rng::Rng;
use crate::telemetry::{self, Report, ReportError};
use crate::weight::Weight;

/// Weight of the newest request in the running mean of request size (used to turn a reported
/// queue depth into tokens). An exponentially weighted mean forgets old traffic mixes in about
/// 1/alpha requests.
const MEAN_ALPHA: f64 = 0.05;
/// Completed streams needed before the learned output length replaces the body's cap: a
/// mean of a handful is noise.
const MIN_OUTPUT_SAMPLES: u64 = 20;
/// Standard deviations above the mean output reserved as KV growth (1.3: about the 90th
/// percentile of a normal; output lengths are skewed right, so this is a floor, not a bound).
const RESERVE_SIGMAS: f64 = 1.3;

/// How a routed request left the filter.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Routed to the first node of the list; the value is the routing header.
    Routed {
        ticket: Ticket,
        header_value: String,
        predicted_seconds: f64,
        /// Every fresh node would overflow its VRAM; this is the least bad.
        over_ceiling: bool,
        /// Requests this filter had in flight on the chosen node before this one (visibility).
        inflight_before: u64,
    },
    /// No basis to choose: the routing header is not set and Envoy's fallback balancer routes.
    NoFreshNodes,
    /// Every fresh node would pass its VRAM ceiling and the caller may hold the request:
    /// nothing was booked; ask again when a stream ends or a report arrives (see `admission`).
    Saturated,
}

#[derive(Debug, Clone)]
pub struct Balancer {
    nodes: Vec<NodeState>,
    params: Params,
    max_hosts: usize,
    mean_request_tokens: Option<f64>,
    /// Mean and variance of the output length of the streams seen to completion, and how many.
    mean_output_tokens: f64,
    var_output_tokens: f64,
    output_samples: u64,
}

impl Balancer {
    pub fn new(cfg: &Config) -> Self {
        Balancer {
            nodes: cfg
                .nodes
                .iter()
                .map(|n| NodeState::new(&n.address, n.capacity_tokens_per_sec, n.kv_cache_tokens))
                .collect(),
            params: Params {
                rule: cfg.policy,
                stale_after_ms: cfg.stale_after_ms,
                vram_ceiling: cfg.vram_ceiling,
                kv_bytes_per_token: cfg.kv_bytes_per_token,
            },
            max_hosts: cfg.max_hosts_in_header,
            mean_request_tokens: None,
            mean_output_tokens: 0.0,
            var_output_tokens: 0.0,
            output_samples: 0,
        }
    }

    pub fn nodes(&self) -> &[NodeState] {
        &self.nodes
    }

    /// A health answer for node `node`: `Some(body)` for an HTTP 200, `None` for a failed or
    /// timed-out call or another status. A good report replaces the old one; anything else
    /// leaves the last good report in place.
    pub fn on_health(
        &mut self,
        node: usize,
        body: Option<&[u8]>,
        now_ms: u64,
    ) -> Result<Report, HealthError> {
        let Some(state) = self.nodes.get_mut(node) else {
            return Err(HealthError::UnknownNode);
        };
        let Some(body) = body else {
            state.note_failure();
            return Err(HealthError::CallFailed);
        };
        match telemetry::parse_health(body) {
            Ok(report) => {
                state.accept_report(report, now_ms);
                Ok(report)
            }
            Err(e) => {
                state.note_failure();
                Err(HealthError::Unparsable(e))
            }
        }
    }

    /// What a request is expected to cost: its prompt, and as output the smaller of its cap and
    /// the mean output length learned from completed streams (clients set caps far above what
    /// models generate; the Azure trace's outputs average a fifth of a typical 1024 cap). Until
    /// enough streams have completed, the cap stands: the safe side for the VRAM guard.
    pub fn expected(&self, weight: Weight) -> Weight {
        if self.output_samples < MIN_OUTPUT_SAMPLES {
            return weight;
        }
        Weight {
            prompt_tokens: weight.prompt_tokens,
            output_tokens: weight
                .output_tokens
                .min(self.mean_output_tokens.ceil() as u64),
        }
    }

    /// Output tokens to reserve as KV growth for a request capped at `cap`: the learned mean
    /// plus `RESERVE_SIGMAS` standard deviations (about the 90th percentile), never above the
    /// cap; the cap itself until enough streams have completed.
    pub fn reserved_output(&self, cap: u64) -> u64 {
        if self.output_samples < MIN_OUTPUT_SAMPLES {
            return cap;
        }
        let high = self.mean_output_tokens + RESERVE_SIGMAS * self.var_output_tokens.sqrt();
        cap.min(high.ceil() as u64)
    }

    /// A stream completed normally with `tokens` output tokens.
    pub fn observe_output(&mut self, tokens: u64) {
        self.output_samples = self.output_samples.saturating_add(1);
        // Plain moments while few samples exist, then exponentially weighted so the estimate
        // follows a changing traffic mix (West's incremental form).
        let alpha = (1.0 / self.output_samples as f64).max(MEAN_ALPHA);
        let diff = tokens as f64 - self.mean_output_tokens;
        self.mean_output_tokens += alpha * diff;
        self.var_output_tokens = (1.0 - alpha) * (self.var_output_tokens + alpha * diff * diff);
    }

    /// Chooses the nodes for a request and books it as in flight on the first. `weight` is
    /// the request's estimate with its output cap; the books hold its expected cost. With
    /// `may_hold`, a request every node would overflow is not routed: the answer is
    /// `Saturated` and the caller holds it; without, it goes to the node that overflows least.
    pub fn route(
        &mut self,
        weight: Weight,
        now_ms: u64,
        rng: &mut dyn Rng,
        may_hold: bool,
    ) -> Outcome {
        let reserved = self.reserved_output(weight.output_tokens);
        let weight = self.expected(weight);
        let mean = self.mean_request_tokens.unwrap_or(weight.total() as f64);
        let (ranked, over_ceiling) = match choice::decide(
            &self.nodes,
            weight,
            reserved,
            mean,
            now_ms,
            &self.params,
            rng,
        ) {
            Decision::Route(r) => (r, false),
            Decision::AllOverCeiling(_) if may_hold => return Outcome::Saturated,
            Decision::AllOverCeiling(r) => (r, true),
            Decision::NoFreshNodes => return Outcome::NoFreshNodes,
        };
        let Some(first) = ranked.first().copied() else {
            return Outcome::NoFreshNodes;
        };
        let header_value = ranked
            .iter()
            .take(self.max_hosts)
            .filter_map(|r| self.nodes.get(r.node).map(|n| n.address.as_str()))
            .collect::<Vec<_>>()
            .join(",");
        let Some(state) = self.nodes.get_mut(first.node) else {
            return Outcome::NoFreshNodes;
        };
        let inflight_before = state.inflight_requests;
        let ticket = state.dispatch_reserving(first.node, weight, reserved);
        self.mean_request_tokens = Some(mean + MEAN_ALPHA * (weight.total() as f64 - mean));
        Outcome::Routed {
            ticket,
            header_value,
            predicted_seconds: first.seconds,
            over_ceiling,
            inflight_before,
        }
    }

    /// The request's stream has delivered `after` output tokens (it had `before`).
    pub fn progress(&mut self, ticket: &Ticket, before: u64, after: u64) {
        if let Some(state) = self.nodes.get_mut(ticket.node) {
            state.progress(ticket, before, after);
        }
    }

    /// The request's stream ended (completed, failed, reset or timed out) after `received`
    /// output tokens.
    pub fn release(&mut self, ticket: &Ticket, received: u64) {
        if let Some(state) = self.nodes.get_mut(ticket.node) {
            state.release(ticket, received);
        }
    }
}

/// Why a health answer did not update a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthError {
    UnknownNode,
    CallFailed,
    Unparsable(ReportError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn cfg(n: usize, extra: &str) -> Config {
        let nodes: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"address":"127.0.0.1:{}"}}"#, 8001 + i))
            .collect();
        Config::parse(
            format!(
                r#"{{"nodes":[{}],"health_cluster":"h"{extra}}}"#,
                nodes.join(",")
            )
            .as_bytes(),
        )
        .unwrap()
    }

    const W: Weight = Weight {
        prompt_tokens: 100,
        output_tokens: 100,
    };

    #[test]
    fn header_lists_the_ranking_up_to_the_limit() {
        let mut b = Balancer::new(&cfg(4, r#","max_hosts_in_header":3"#));
        for (i, load) in [400, 100, 300, 200].iter().enumerate() {
            let body =
                format!(r#"{{"tokens_per_sec_load":{load},"tokens_per_sec_capacity":1000}}"#);
            b.on_health(i, Some(body.as_bytes()), 0).unwrap();
        }
        match b.route(W, 10, &mut SplitMix64::new(1), false) {
            Outcome::Routed {
                header_value,
                ticket,
                over_ceiling,
                ..
            } => {
                assert_eq!(header_value, "127.0.0.1:8002,127.0.0.1:8004,127.0.0.1:8003");
                assert_eq!(ticket.node, 1);
                assert!(!over_ceiling);
            }
            o => panic!("{o:?}"),
        }
        assert_eq!(b.nodes()[1].inflight_requests, 1);
    }

    #[test]
    fn failed_or_garbage_polls_keep_the_last_good_report() {
        let mut b = Balancer::new(&cfg(1, ""));
        assert_eq!(
            b.route(W, 0, &mut SplitMix64::new(1), false),
            Outcome::NoFreshNodes
        );
        b.on_health(0, Some(br#"{"tokens_per_sec_load":5}"#), 0)
            .unwrap();
        assert_eq!(b.on_health(0, None, 100), Err(HealthError::CallFailed));
        assert_eq!(
            b.on_health(0, Some(b"<html>"), 200),
            Err(HealthError::Unparsable(ReportError::NotJson))
        );
        assert_eq!(b.on_health(7, None, 200), Err(HealthError::UnknownNode));
        assert_eq!(b.nodes()[0].failures_in_row, 2);
        assert!(matches!(
            b.route(W, 3000, &mut SplitMix64::new(1), false),
            Outcome::Routed { .. }
        ));
        // The good report is now stale, and nothing replaced it.
        assert_eq!(
            b.route(W, 3001, &mut SplitMix64::new(1), false),
            Outcome::NoFreshNodes
        );
    }

    #[test]
    fn release_returns_inflight_to_zero() {
        let mut b = Balancer::new(&cfg(2, ""));
        for i in 0..2 {
            b.on_health(i, Some(br#"{"tokens_per_sec_load":0}"#), 0)
                .unwrap();
        }
        let mut rng = SplitMix64::new(3);
        let tickets: Vec<Ticket> = (0..10)
            .filter_map(|_| match b.route(W, 1, &mut rng, false) {
                Outcome::Routed { ticket, .. } => Some(ticket),
                _ => None,
            })
            .collect();
        assert_eq!(tickets.len(), 10);
        let total: u64 = b.nodes().iter().map(|n| n.inflight_requests).sum();
        assert_eq!(total, 10);
        // A report arrives half way; releases still balance.
        b.on_health(0, Some(br#"{"tokens_per_sec_load":0}"#), 2)
            .unwrap();
        for t in &tickets {
            b.release(t, 0);
        }
        for n in b.nodes() {
            assert_eq!(
                (n.inflight_requests, n.inflight_tokens, n.unreflected_tokens),
                (0, 0, 0)
            );
        }
    }

    #[test]
    fn learned_output_length_replaces_the_cap_once_enough_streams_completed() {
        let mut b = Balancer::new(&cfg(1, ""));
        let capped = Weight {
            prompt_tokens: 10,
            output_tokens: 1024,
        };
        for i in 0..MIN_OUTPUT_SAMPLES {
            assert_eq!(
                b.expected(capped),
                capped,
                "after {i} samples the cap stands"
            );
            b.observe_output(if i % 2 == 0 { 100 } else { 300 });
        }
        assert_eq!(b.expected(capped).output_tokens, 200);
        // Outputs of 100 and 300: sd 100, so 200 + 1.3 * 100 is reserved as growth.
        assert_eq!(b.reserved_output(1024), 330);
        assert_eq!(b.reserved_output(250), 250);
        // Never above the request's own cap.
        let small = Weight {
            prompt_tokens: 10,
            output_tokens: 50,
        };
        assert_eq!(b.expected(small), small);
        // Routing books the expected cost, and progress plus release return it all.
        b.on_health(0, Some(br#"{"tokens_per_sec_load":0}"#), 0)
            .unwrap();
        let Outcome::Routed { ticket, .. } = b.route(capped, 1, &mut SplitMix64::new(1), false)
        else {
            panic!("not routed")
        };
        assert_eq!(ticket.weight.output_tokens, 200);
        assert_eq!(b.nodes()[0].growth_tokens, 330);
        b.progress(&ticket, 0, 150);
        assert_eq!(b.nodes()[0].growth_tokens, 180);
        b.release(&ticket, 150);
        assert_eq!(
            (b.nodes()[0].growth_tokens, b.nodes()[0].inflight_tokens),
            (0, 0)
        );
    }

    #[test]
    fn all_over_ceiling_still_routes_and_says_so() {
        let mut b = Balancer::new(&cfg(2, r#","kv_bytes_per_token":1"#));
        for i in 0..2 {
            b.on_health(
                i,
                Some(br#"{"tokens_per_sec_load":0,"vram_used_bytes":950,"vram_total_bytes":1000}"#),
                0,
            )
            .unwrap();
        }
        assert!(matches!(
            b.route(W, 1, &mut SplitMix64::new(1), false),
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
    }
}
