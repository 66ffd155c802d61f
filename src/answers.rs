//! The answers to the root context's callouts (see `polls`): a node's health becomes its
//! report (or a failure that may eject it), a model list replaces the node's last one, and
//! the admin's member list becomes the node set.
//!
//! An answer goes to the node it was asked of: if membership gave the node's slot to another
//! address while the call was out, the answer is about a node that left, and is dropped
//! (`callouts::Answer::Departed`). Anything unreadable keeps what was known: a node does not
//! lose its report, its model list or its place because one answer was bad.

use crate::host::Host;
use crate::metrics::{NodeStat, Stat};
use crate::polls::{send_health, Polls};
use crate::roles::Role;
use crate::state::State;
use log::{debug, info, warn};
use token_balancer_core::config::DEFAULT_HEALTH_PATH;
use token_balancer_core::fleet::callouts::{Answer, Outstanding};
use token_balancer_core::fleet::node::{Polled, Transition};
use token_balancer_core::fleet::probe::{Seen, Step, RETRY_MS};
use token_balancer_core::ingest::engine::Engine;
use token_balancer_core::ingest::members;
use token_balancer_core::ingest::telemetry::Report;
use token_balancer_core::route::balancer::{Balancer, HealthError, MAX_NODES};

/// Largest health answer read; a larger one is a broken node, not telemetry. Engines'
/// Prometheus text is far larger than the seed JSON: one vLLM engine's `/metrics` is about
/// 35 KB with its histograms, and a data-parallel vLLM repeats every series per engine (8
/// engines, ~300 KB). Parsing costs about 4 ms per MiB under V8 (the parser reads ~250 MB/s
/// as Wasm).
pub const MAX_HEALTH_BODY: usize = 1024 * 1024;
/// Largest admin `/clusters` answer read: about 1 KiB per host (with its stats) for every
/// cluster Envoy has, so 16 MiB is ten thousand hosts.
pub const MAX_MEMBERS_BODY: usize = 16 * 1024 * 1024;

/// Why a callout brought no body to parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallFailure {
    /// No response at all (a reset).
    NoAnswer,
    /// A response other than 200.
    BadStatus,
    /// A 200 whose body is over the read limit.
    TooLarge,
}

/// The callout being answered: its status, and its body when that is a 200 within `limit`,
/// or why not. A reset callout has no :status; Envoy answers refused (503) and timed-out
/// (504) callouts itself, so those count as bad statuses.
struct CallAnswer {
    status: Option<String>,
    body: Option<Vec<u8>>,
    failure: Option<CallFailure>,
}

fn read_answer<H: Host>(host: &H, body_size: usize, limit: usize) -> CallAnswer {
    let status = host.call_status();
    let (body, failure) = match status.as_deref() {
        None => (None, Some(CallFailure::NoAnswer)),
        Some("200") if body_size > limit => (None, Some(CallFailure::TooLarge)),
        Some("200") => (host.call_body(body_size), None),
        Some(_) => (None, Some(CallFailure::BadStatus)),
    };
    CallAnswer {
        status,
        body,
        failure,
    }
}

/// An engine as users know it.
fn engine_name(e: Engine) -> &'static str {
    match e {
        Engine::Vllm => "vLLM",
        Engine::Sglang => "SGLang",
        Engine::Tgi => "TGI",
        Engine::Trtllm => "trtllm-serve",
        Engine::LlamaCpp => "llama.cpp",
    }
}

/// Who holds node slot `slot` now (`tenant_of` its address).
fn tenant_at(balancer: &Balancer, slot: usize) -> Option<u64> {
    balancer.nodes().get(slot).map(|n| n.tenant())
}

/// The model list node `node` gave last, if any.
fn listed(balancer: &Balancer, node: usize) -> Option<&[String]> {
    balancer.nodes().get(node).and_then(|n| n.models().listed())
}

/// Which of the calls in flight an answer is.
enum Kind {
    Health,
    Models,
    Members,
}

impl<H: Host> State<H> {
    /// The answer to callout `token` came, with a body of `body_size` bytes. Returns whether
    /// a node has a new report (held requests may now find room).
    pub fn on_answer(&mut self, token: u32, body_size: usize) -> bool {
        let Some(polls) = self.role.polls() else {
            return false;
        };
        let kind = if polls.models.contains(token) {
            Kind::Models
        } else if polls.members == Some(token) {
            polls.members = None;
            Kind::Members
        } else if polls.health.contains(token) {
            Kind::Health
        } else {
            return false;
        };
        match kind {
            Kind::Health => self.on_health(token, body_size),
            Kind::Models => {
                self.on_models(token, body_size);
                false
            }
            Kind::Members => {
                self.on_members(body_size);
                false
            }
        }
    }

    /// Takes the call `token` out of `table` of the polls: the node it is for, if that node
    /// still holds its slot.
    fn answered(&mut self, token: u32, table: fn(&mut Polls) -> &mut Outstanding) -> Option<usize> {
        let balancer = &self.balancer;
        let polls = self.role.polls()?;
        match table(polls).answer(token, |slot| tenant_at(balancer, slot)) {
            Answer::Current(node) => Some(node),
            Answer::Departed(call) => {
                debug!(
                    "answer for slot {} dropped: its node left the cluster since the call",
                    call.slot
                );
                None
            }
            Answer::Unknown => None,
        }
    }

    /// A node's health answer: a good one is its new report; anything else is a failed poll;
    /// and for a node whose telemetry is looked for, a step of that (see `fleet::probe`): the
    /// next path is asked at once, and what is found (or not) is said once.
    /// A complete round is published at once rather than a tick later.
    fn on_health(&mut self, token: u32, body_size: usize) -> bool {
        let node = self.answered(token, |p| &mut p.health);
        let now = self.host.now_ms();
        let fresh = match node {
            Some(node) => {
                let answer = read_answer(&self.host, body_size, MAX_HEALTH_BODY);
                let polled = match (&answer.body, answer.failure) {
                    (Some(body), _) => Polled::Body(body),
                    (None, Some(CallFailure::TooLarge)) => Polled::Failed(Seen::TooLarge),
                    (None, _) => Polled::Failed(Seen::of_status(answer.status.as_deref())),
                };
                let path = self
                    .balancer
                    .health_path(node)
                    .unwrap_or_default()
                    .to_string();
                let answered = self.balancer.on_health_answer(node, polled, now);
                self.check_waiting(node);
                let state = self.balancer.nodes().get(node);
                if let Some((hits, queries)) = state.and_then(|n| n.engine_prefix()) {
                    self.metrics
                        .record_node(node, NodeStat::EngineHitTokens, hits as u64);
                    self.metrics
                        .record_node(node, NodeStat::EngineQueryTokens, queries as u64);
                }
                if let Some(rate) = state.and_then(|n| n.engine_hit_rate()) {
                    let permille = (rate * 1000.0).round() as u64;
                    self.metrics
                        .record_node(node, NodeStat::EngineHitPermille, permille);
                }
                if let Some(result) = answered.result {
                    self.count_health(
                        node,
                        result,
                        answer.failure,
                        answer.status.as_deref(),
                        &path,
                    );
                }
                self.tell_discovery(node, &answered.step);
                if answered.step.asks_again() {
                    let State {
                        host,
                        config,
                        balancer,
                        metrics,
                        role,
                        ..
                    } = self;
                    if let Some(polls) = role.polls() {
                        send_health(host, config, balancer, polls, metrics, node);
                    }
                }
                true
            }
            None => false,
        };
        let round_done = self
            .role
            .polls()
            .is_some_and(|p| p.health.is_empty() && p.schedule.round_polled());
        if round_done {
            self.publish(now);
        }
        fresh
    }

    /// The poller service, at node `node`'s answer: whether it still follows the prompts the
    /// workers sent there (`sync::Service::answered`).
    fn check_waiting(&mut self, node: usize) {
        let State {
            host,
            balancer,
            role,
            ..
        } = self;
        if let Role::Service(_, service) = role {
            let late = balancer.nodes().get(node).is_some_and(|n| n.grace_ms() > 0);
            service.answered(&mut *host, node, late);
        }
    }

    /// Says, once per node, where its telemetry was found or that it was not (see
    /// `fleet::probe`), and keeps the gauge of nodes without telemetry.
    fn tell_discovery(&mut self, node: usize, step: &Step) {
        let address = self
            .balancer
            .nodes()
            .get(node)
            .map(|n| n.address().to_string())
            .unwrap_or_default();
        match step {
            Step::Found(d) => {
                if let (true, Some((path, engine)), Some(health)) =
                    (d.announce, d.found(), d.health_said())
                {
                    self.metrics.bump(Stat::TelemetryDiscovered);
                    let what = engine.map_or("the health format".to_string(), |e| {
                        format!("{} metrics", engine_name(e))
                    });
                    warn!(
                        "node {address}: {DEFAULT_HEALTH_PATH} is not telemetry ({health}); reading {path} ({what}) instead; set its health_path to \"{path}\" to silence this"
                    );
                }
            }
            Step::NotFound(d) => {
                if d.announce {
                    self.metrics.bump(Stat::TelemetryNotFound);
                    let tried: Vec<String> = d
                        .tried
                        .iter()
                        .map(|(path, seen)| format!("{path}: {seen}"))
                        .collect();
                    warn!(
                        "node {address}: no telemetry found ({}), so it is never chosen: start llama-server with --metrics, SGLang with --enable-metrics, or set this node's health_path (and format); the metrics paths are tried again every {} s",
                        tried.join("; "),
                        RETRY_MS / 1000
                    );
                }
            }
            Step::Unfiltered(seen) => {
                self.metrics.bump(Stat::TelemetryUnfiltered);
                warn!(
                    "node {address}: asked for the metrics read alone (name[] filters), it answered {seen}; polling its whole page from now on (set its filter_metrics to false to skip the try)"
                );
                return;
            }
            Step::Poll | Step::Next => return,
        }
        self.metrics.record(
            Stat::TelemetryNotFoundNow,
            self.balancer.without_telemetry() as u64,
        );
    }

    /// A node's `/v1/models` answer: a good list replaces the last one; anything else keeps it.
    fn on_models(&mut self, token: u32, body_size: usize) {
        let Some(node) = self.answered(token, |p| &mut p.models) else {
            return;
        };
        let answer = read_answer(&self.host, body_size, MAX_HEALTH_BODY);
        let address = self
            .balancer
            .nodes()
            .get(node)
            .map(|n| n.address().to_string())
            .unwrap_or_default();
        let good = match answer.body {
            None => {
                self.metrics.bump(Stat::ModelsFailed);
                let why = match answer.failure {
                    Some(CallFailure::NoAnswer) => "no answer (reset)".to_string(),
                    Some(CallFailure::TooLarge) => {
                        format!("over {MAX_HEALTH_BODY} bytes, not read")
                    }
                    Some(CallFailure::BadStatus) => {
                        format!("status {}", answer.status.unwrap_or_default())
                    }
                    None => "body could not be read".to_string(),
                };
                debug!("model list of {address}: {why}");
                false
            }
            Some(body) => {
                let before = listed(&self.balancer, node).map(<[String]>::to_vec);
                match self.balancer.on_models(node, &body) {
                    Ok(_) => {
                        self.metrics.bump(Stat::ModelsOk);
                        let now = listed(&self.balancer, node);
                        if before.as_deref() != now {
                            info!(
                                "node {address} serves: {}",
                                now.unwrap_or_default().join(", ")
                            );
                        }
                        true
                    }
                    Err(e) => {
                        self.metrics.bump(Stat::ModelsUnparsable);
                        debug!("model list of {address} not used: {e}");
                        false
                    }
                }
            }
        };
        let now = self.host.now_ms();
        if let Some(p) = self
            .role
            .polls()
            .and_then(|polls| polls.list_polls.get_mut(node))
        {
            p.answered(good, now);
        }
    }

    /// The admin `/clusters` answer: a good list becomes the node set; anything else keeps
    /// the last one (the nodes do not vanish because the admin did not answer once).
    fn on_members(&mut self, body_size: usize) {
        let answer = read_answer(&self.host, body_size, MAX_MEMBERS_BODY);
        let Some(m) = self.config.membership.clone() else {
            return;
        };
        let Some(body) = answer.body else {
            self.metrics.bump(Stat::MembersFailed);
            warn!(
                "member list of cluster {:?} not read: {}",
                m.cluster,
                match answer.failure {
                    Some(CallFailure::TooLarge) => format!("over {MAX_MEMBERS_BODY} bytes"),
                    Some(CallFailure::BadStatus) =>
                        format!("status {}", answer.status.unwrap_or_default()),
                    _ => "no answer".to_string(),
                }
            );
            return;
        };
        let members = match members::parse_members(&body, &m.cluster) {
            Ok(members) => members,
            Err(e) => {
                self.metrics.bump(Stat::MembersFailed);
                warn!("member list of cluster {:?} not used: {e}", m.cluster);
                return;
            }
        };
        self.metrics.bump(Stat::MembersOk);
        let change = self.follow_members(&members.addresses);
        for &i in &change.left {
            self.metrics.bump(Stat::NodesLeft);
            let address = self.balancer.nodes().get(i).map(|n| n.address());
            info!(
                "node {} left cluster {:?}: no longer chosen",
                address.unwrap_or("?"),
                m.cluster
            );
        }
        for &i in &change.joined {
            self.metrics.bump(Stat::NodesJoined);
            let address = self
                .balancer
                .nodes()
                .get(i)
                .map(|n| n.address())
                .unwrap_or_default();
            self.metrics.name_node(i, address);
            if let Some(polls) = self.role.polls() {
                polls.joined(i, &self.config);
            }
            info!("node {address} joined cluster {:?} (slot {i})", m.cluster);
        }
        if change.over_limit > 0 {
            warn!(
                "cluster {:?} has more members than the {MAX_NODES} followed: {} not followed",
                m.cluster, change.over_limit
            );
        }
        if members.unaddressable > 0 {
            debug!(
                "cluster {:?}: {} members without an ip:port address, not followed",
                m.cluster, members.unaddressable
            );
        }
        // Each VM sets the gauge to what it follows; they agree but for a poll's lag.
        self.metrics
            .record(Stat::MembersNow, members.addresses.len() as u64);
        // A node without telemetry that left is no longer one to worry about.
        if !change.left.is_empty() {
            self.metrics.record(
                Stat::TelemetryNotFoundNow,
                self.balancer.without_telemetry() as u64,
            );
        }
    }

    fn count_health(
        &mut self,
        node: usize,
        result: Result<Report, HealthError>,
        failure: Option<CallFailure>,
        status: Option<&str>,
        path: &str,
    ) {
        let m = &self.metrics;
        let address = self
            .balancer
            .nodes()
            .get(node)
            .map(|n| n.address())
            .unwrap_or_default();
        // Why the poll failed, for the line that takes the node out.
        let why = match result {
            Ok(_) => {
                m.bump(Stat::HealthOk);
                String::new()
            }
            Err(e) => {
                m.bump_node(node, NodeStat::HealthFailures);
                match e {
                    HealthError::Unparsable(why) => {
                        m.bump(Stat::HealthUnparsable);
                        debug!("health answer from {address} not used: {why}");
                        why.to_string()
                    }
                    HealthError::CallFailed | HealthError::UnknownNode => {
                        m.bump(Stat::HealthFailed);
                        match failure {
                            Some(CallFailure::NoAnswer) | None => {
                                m.bump(Stat::HealthNoAnswer);
                                debug!("health call to {address}: no answer (refused, reset or timed out)");
                                "no answer (refused, reset or timed out)".to_string()
                            }
                            Some(CallFailure::BadStatus) => {
                                m.bump(Stat::HealthBadStatus);
                                let status = status.unwrap_or("?");
                                debug!("health call to {address}: status {status}");
                                format!("status {status}")
                            }
                            Some(CallFailure::TooLarge) => {
                                m.bump(Stat::HealthTooLarge);
                                debug!("health answer from {address} over {MAX_HEALTH_BODY} bytes, not read");
                                format!("over {MAX_HEALTH_BODY} bytes")
                            }
                        }
                    }
                }
            }
        };
        let address = address.to_string();
        match self.balancer.take_transition(node) {
            Some(Transition::Ejected) => {
                self.metrics.bump(Stat::NodesEjected);
                warn!(
                    "node {address} taken out of the choice after {} failed health polls in a row (the last, GET {path}: {why})",
                    self.config.unhealthy_after_failures
                );
            }
            Some(Transition::Readmitted) => {
                self.metrics.bump(Stat::NodesReadmitted);
                info!(
                    "node {address} back in the choice after {} good health polls in a row",
                    self.config.healthy_after_successes
                );
            }
            None => {}
        }
    }
}
