//! Which polls are due and what their answers do to the balancer: the bookkeeping of the
//! filter's poller (`src/polls.rs` and `src/answers.rs` of the filter), without the HTTP,
//! which `poller` does.
//!
//! The same core calls, in the same order: each tick the slices of the fleet now due
//! (`fleet::polling::Schedule`) get one health poll per node that has none outstanding
//! (`fleet::callouts::Outstanding`) and whose period is up (a quiet node's is longer,
//! `NodeState::poll_due`), at the path the node's probe says (`Balancer::health_path`);
//! every answer goes to `Balancer::on_health_answer`, and a discovery step that asks for the
//! next path is polled at once. Nodes whose models are not configured are asked for
//! `/v1/models` in their health slice when their `ListPoll` says so, and the list goes to
//! `Balancer::on_models`. The cluster's membership (`membership`) is not followed: that needs
//! Envoy's admin, and `main` refuses such a configuration.

use crate::picker::Picker;
use std::time::Duration;
use token_balancer_core::config::Config;
use token_balancer_core::fleet::callouts::{Answer, Outstanding};
use token_balancer_core::fleet::models::ListPoll;
use token_balancer_core::fleet::node::Polled;
use token_balancer_core::fleet::polling::{self, Schedule};
use token_balancer_core::fleet::probe::Seen;

/// Largest health or model-list answer read, as the filter's (`MAX_HEALTH_BODY`).
pub const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// The polls of the picker: those in flight, and when each kind is due.
#[derive(Debug)]
pub struct Polls {
    health: Outstanding,
    models: Outstanding,
    list_polls: Vec<ListPoll>,
    schedule: Schedule,
    next_token: u32,
}

/// What a poll asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Health,
    Models,
}

/// One GET to send: `http://{target}{path}`, answered with its `token`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poll {
    pub token: u32,
    pub kind: Kind,
    pub target: String,
    pub path: String,
    pub timeout: Duration,
}

/// What a GET brought back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// A 200 within `MAX_ANSWER_BYTES`, and its body.
    Body(Vec<u8>),
    /// A 200 over the limit.
    TooLarge,
    /// Another status.
    Status(u16),
    /// No answer: refused, reset or timed out.
    NoAnswer,
}

impl Fetched {
    /// The answer as the core reads a health poll. A timeout is `Down`, as Envoy's 504 for a
    /// callout that timed out is to the filter.
    fn polled(&self) -> Polled<'_> {
        match self {
            Fetched::Body(b) => Polled::Body(b),
            Fetched::TooLarge => Polled::Failed(Seen::TooLarge),
            Fetched::Status(s) => Polled::Failed(Seen::of_status(Some(&s.to_string()))),
            Fetched::NoAnswer => Polled::Failed(Seen::of_status(None)),
        }
    }
}

impl Polls {
    pub fn new(config: &Config) -> Polls {
        Polls {
            health: Outstanding::default(),
            models: Outstanding::default(),
            list_polls: config
                .nodes
                .iter()
                .map(|_| ListPoll::new(config.tick_ms, config.models_poll_ms))
                .collect(),
            schedule: Schedule::default(),
            next_token: 0,
        }
    }

    fn token(&mut self) -> u32 {
        self.next_token = self.next_token.wrapping_add(1);
        self.next_token
    }

    /// Health polls in flight.
    #[cfg(test)]
    pub fn health_outstanding(&self) -> usize {
        self.health.len()
    }
}

impl Picker {
    /// The polls due at `now_ms`, each remembered as outstanding, and the timer period the
    /// schedule wants.
    pub fn due_polls(&mut self, now_ms: u64) -> (Vec<Poll>, u64) {
        let Picker {
            config,
            balancer,
            polls,
            ..
        } = self;
        let due = polls
            .schedule
            .due(balancer.nodes().len(), config.tick_ms, now_ms);
        let slices = polls.schedule.slices();
        let timeout = Duration::from_millis(config.health_timeout_ms);
        let mut out = Vec::new();
        let nodes = balancer.nodes();
        for i in due
            .iter()
            .flat_map(|&s| polling::slice_nodes(s, slices, nodes.len()))
        {
            let Some(state) = nodes.get(i).filter(|n| n.member()) else {
                continue;
            };
            let (Some(node), Some(path)) = (balancer.node_config(i), balancer.health_path(i))
            else {
                continue;
            };
            // A quiet or slack node (reports that move nothing the choice reads, or show room
            // to spare) only once its longer period is up, as the filter's poller
            // (`NodeState::poll_due`).
            if !polls.health.is_asked(i, state.tenant())
                && state.poll_due(now_ms, || balancer.books(i).is_some_and(|b| b.prefilling()))
            {
                let token = polls.token();
                polls.health.sent(token, i, state.tenant());
                out.push(Poll {
                    token,
                    kind: Kind::Health,
                    target: node.health_target().to_string(),
                    path: path.to_string(),
                    timeout,
                });
            }
            if config.models_poll_ms == 0
                || !balancer.learns_models(i)
                || polls.models.is_asked(i, state.tenant())
            {
                continue;
            }
            if let Some(p) = polls.list_polls.get_mut(i).filter(|p| p.due(now_ms)) {
                p.sent(now_ms);
                let token = polls.token();
                polls.models.sent(token, i, state.tenant());
                out.push(Poll {
                    token,
                    kind: Kind::Models,
                    target: node.address.clone(),
                    path: "/v1/models".to_string(),
                    timeout,
                });
            }
        }
        (out, polls.schedule.period_ms())
    }

    /// The answer to poll `token` of `kind` came at `now_ms`. Returns the poll to send at once
    /// when node discovery asks for another path.
    pub fn on_answer(
        &mut self,
        token: u32,
        kind: Kind,
        fetched: &Fetched,
        now_ms: u64,
    ) -> Option<Poll> {
        match kind {
            Kind::Health => self.on_health(token, fetched, now_ms),
            Kind::Models => {
                self.on_models(token, fetched, now_ms);
                None
            }
        }
    }

    fn answered(&mut self, token: u32, kind: Kind) -> Option<usize> {
        let Picker {
            balancer, polls, ..
        } = self;
        let table = match kind {
            Kind::Health => &mut polls.health,
            Kind::Models => &mut polls.models,
        };
        match table.answer(token, |slot| balancer.nodes().get(slot).map(|n| n.tenant())) {
            Answer::Current(node) => Some(node),
            Answer::Departed(_) | Answer::Unknown => None,
        }
    }

    fn on_health(&mut self, token: u32, fetched: &Fetched, now_ms: u64) -> Option<Poll> {
        let node = self.answered(token, Kind::Health)?;
        let answered = self
            .balancer
            .on_health_answer(node, fetched.polled(), now_ms);
        match answered.result {
            Some(Ok(_)) => self.counts.health_ok += 1,
            Some(Err(_)) => self.counts.health_failed += 1,
            None => {}
        }
        if let Some(t) = self.balancer.take_transition(node) {
            let address = self.balancer.nodes().get(node).map(|n| n.address());
            eprintln!("node {}: {t:?}", address.unwrap_or("?"));
        }
        if !answered.step.asks_again() {
            return None;
        }
        let Picker {
            config,
            balancer,
            polls,
            ..
        } = self;
        let (Some(state), Some(cfg), Some(path)) = (
            balancer.nodes().get(node),
            balancer.node_config(node),
            balancer.health_path(node),
        ) else {
            return None;
        };
        let token = polls.token();
        polls.health.sent(token, node, state.tenant());
        Some(Poll {
            token,
            kind: Kind::Health,
            target: cfg.health_target().to_string(),
            path: path.to_string(),
            timeout: Duration::from_millis(config.health_timeout_ms),
        })
    }

    fn on_models(&mut self, token: u32, fetched: &Fetched, now_ms: u64) {
        let Some(node) = self.answered(token, Kind::Models) else {
            return;
        };
        let good = match fetched {
            Fetched::Body(b) => self.balancer.on_models(node, b).is_ok(),
            _ => false,
        };
        if let Some(p) = self.polls.list_polls.get_mut(node) {
            p.answered(good, now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    const T0: u64 = 5_000_000;
    const GOOD: &[u8] = br#"{"tokens_per_sec_load": 10, "tokens_per_sec_capacity": 1000,
                             "kv_cache_usage": 0.2, "queue_depth": 0}"#;

    fn picker(n: usize, extra: serde_json::Value) -> Picker {
        let nodes: Vec<_> = (0..n)
            .map(|i| serde_json::json!({"address": format!("10.0.{}.{}:8000", i / 200, i % 200 + 1), "models": ["m"]}))
            .collect();
        let mut config = serde_json::json!({"nodes": nodes, "health_cluster": "h", "tick_ms": 250});
        if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
        Picker::new(Config::parse(config.to_string().as_bytes()).unwrap(), 1)
    }

    #[test]
    fn every_node_is_polled_once_per_tick_and_not_again_while_asked() {
        let mut p = picker(3, serde_json::json!({}));
        let (due, period) = p.due_polls(T0);
        assert_eq!(period, 250);
        let targets: Vec<_> = due.iter().map(|d| d.target.as_str()).collect();
        assert_eq!(targets, ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]);
        assert!(due
            .iter()
            .all(|d| d.kind == Kind::Health && d.path == "/health"));
        // A tick later, nobody has answered: nobody is asked again.
        let (again, _) = p.due_polls(T0 + 250);
        assert!(again.is_empty(), "{again:?}");
        assert_eq!(p.polls.health_outstanding(), 3);
    }

    #[test]
    fn a_good_answer_makes_a_fresh_report_and_a_failure_does_not() {
        let mut p = picker(2, serde_json::json!({}));
        let (due, _) = p.due_polls(T0);
        let next = p.on_answer(
            due[0].token,
            Kind::Health,
            &Fetched::Body(GOOD.to_vec()),
            T0 + 2,
        );
        assert_eq!(next, None);
        p.on_answer(due[1].token, Kind::Health, &Fetched::NoAnswer, T0 + 2);
        let stale = p.config.stale_after_ms;
        assert!(p.balancer.nodes()[0].fresh_report(T0 + 3, stale).is_some());
        assert!(p.balancer.nodes()[1].fresh_report(T0 + 3, stale).is_none());
        assert_eq!((p.counts.health_ok, p.counts.health_failed), (1, 1));
        // Both answered: both are polled on the next tick.
        let (due, _) = p.due_polls(T0 + 250);
        assert_eq!(due.len(), 2);
    }

    #[test]
    fn a_quiet_node_is_polled_less_often_than_every_tick() {
        let mut p = picker(1, serde_json::json!({}));
        let (tick, quiet_poll) = (p.config.tick_ms, p.config.quiet_poll_ms);
        assert!(
            quiet_poll > tick,
            "the shipped settings poll quiet nodes less often"
        );
        // The same report every tick: after a few, the node's period grows past one tick.
        let mut now = T0;
        let mut polled = Vec::new();
        while now < T0 + 20 * tick {
            for d in p.due_polls(now).0 {
                polled.push(now);
                p.on_answer(
                    d.token,
                    Kind::Health,
                    &Fetched::Body(GOOD.to_vec()),
                    now + 1,
                );
            }
            now += tick;
        }
        assert!(polled.len() < 20, "polled at every tick: {polled:?}");
        // Never longer apart than quiet_poll_ms (and a tick of slice alignment).
        for w in polled.windows(2) {
            assert!(w[1] - w[0] <= quiet_poll + tick, "{polled:?}");
        }
        assert!(p.balancer.nodes()[0]
            .fresh_report(now, p.config.stale_after_ms)
            .is_some());
    }

    #[test]
    fn an_unknown_token_changes_nothing() {
        let mut p = picker(1, serde_json::json!({}));
        p.due_polls(T0);
        let next = p.on_answer(999, Kind::Health, &Fetched::Body(GOOD.to_vec()), T0);
        assert_eq!(next, None);
        assert_eq!(p.counts.health_ok, 0);
        assert_eq!(p.polls.health_outstanding(), 1);
    }

    #[test]
    fn a_large_fleet_is_polled_in_slices_over_the_tick() {
        let mut p = picker(1000, serde_json::json!({}));
        let (first, period) = p.due_polls(T0);
        let slices = polling::slices(1000, 250);
        assert!(slices > 1);
        assert_eq!(period, polling::slice_period_ms(250, slices));
        assert!(first.len() < 1000 && !first.is_empty());
        let mut asked = first.len();
        let mut now = T0;
        while asked < 1000 && now < T0 + 250 {
            now += period;
            asked += p.due_polls(now).0.len();
        }
        assert_eq!(asked, 1000);
    }

    #[test]
    fn an_empty_health_answer_sends_discovery_to_the_metrics_path_at_once() {
        // No models configured: the list is asked too.
        let config = serde_json::json!({"nodes": [{"address": "10.0.0.1:8000"}],
                                        "health_cluster": "h", "tick_ms": 250});
        let mut p = Picker::new(Config::parse(config.to_string().as_bytes()).unwrap(), 1);
        let (due, _) = p.due_polls(T0);
        let kinds: Vec<_> = due.iter().map(|d| d.kind).collect();
        assert_eq!(kinds, [Kind::Health, Kind::Models]);
        let next = p
            .on_answer(
                due[0].token,
                Kind::Health,
                &Fetched::Body(Vec::new()),
                T0 + 1,
            )
            .expect("the next path is asked at once");
        assert_eq!(next.kind, Kind::Health);
        assert_eq!(next.path, "/metrics");
        let list = br#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
        p.on_answer(
            due[1].token,
            Kind::Models,
            &Fetched::Body(list.to_vec()),
            T0 + 1,
        );
        assert!(!p.balancer.model_unknown("m"));
        assert!(p.balancer.model_unknown("other"));
    }
}
