//! The callouts a polling VM sends on its tick: every node's health, less often its
//! `/v1/models`, and Envoy's admin list of the cluster's members (`membership`).
//!
//! A callout is a GET through a cluster: the health cluster, which sends it to the address
//! the target header names (the only way the filter reaches a node outside a request), or
//! the admin cluster. Each sent callout is remembered with the node (slot and tenant) it asks
//! about (`fleet::callouts::Outstanding`), so its answer (see `answers`) goes to that node or
//! is dropped if the node has left, and a node is not asked again while it has not answered.

use crate::host::Host;
use crate::metrics::{Metrics, Stat};
use crate::roles::Role;
use crate::state::State;
use log::warn;
use proxy_wasm::types::Status;
use std::time::Duration;
use token_balancer_core::config::Config;
use token_balancer_core::fleet::callouts::Outstanding;
use token_balancer_core::fleet::models::ListPoll;
use token_balancer_core::fleet::polling::{self, Schedule};
use token_balancer_core::route::balancer::Balancer;

/// What a polling VM (`Role::Vm`, `Role::Service`) keeps of its polls.
pub struct Polls {
    /// Health callouts in flight.
    pub health: Outstanding,
    /// `/v1/models` callouts in flight.
    pub models: Outstanding,
    /// When to ask each node for its model list (see `models::ListPoll`), by node.
    pub list_polls: Vec<ListPoll>,
    /// The admin `/clusters` callout in flight, and when the next is due.
    pub members: Option<u32>,
    pub members_due_ms: u64,
    /// Which slices of the fleet to poll when (see `polling`).
    pub schedule: Schedule,
    /// When the poller service last added up every node's shared books for its gauges
    /// (`State::report_books`), ms.
    books_reported_ms: Option<u64>,
}

/// How often, in ticks, the poller service adds up every node's shared books for the
/// `shared.inflight_*` gauges and the engines' prompt counters (`sync::Service::read_books`):
/// a read of each node's books (about 1 us of Envoy's each), so once a second at the shipped
/// 250 ms tick rather than every round. In ticks, so that a benchmark that scales the tick
/// with its time scale samples the counters as often in model time as a deployment does.
const BOOKS_REPORT_TICKS: u64 = 4;

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
            members: None,
            members_due_ms: 0,
            schedule: Schedule::default(),
            books_reported_ms: None,
        }
    }

    /// Whether the shared books' gauges are due at `now_ms` with ticks of `tick_ms` (see
    /// `BOOKS_REPORT_TICKS`); if so, they count as reported now.
    pub fn books_report_due(&mut self, now_ms: u64, tick_ms: u64) -> bool {
        let every = tick_ms.saturating_mul(BOOKS_REPORT_TICKS);
        let due = self
            .books_reported_ms
            .map_or(true, |at| now_ms >= at.saturating_add(every));
        if due {
            self.books_reported_ms = Some(now_ms);
        }
        due
    }

    /// Node `i` is new in its slot: its model list is asked afresh.
    pub fn joined(&mut self, i: usize, config: &Config) {
        let fresh = ListPoll::new(config.tick_ms, config.models_poll_ms);
        if self.list_polls.len() <= i {
            self.list_polls.resize(i + 1, fresh);
        } else if let Some(p) = self.list_polls.get_mut(i) {
            *p = fresh;
        }
    }
}

/// A GET to `target` (`ip:port`) through the health cluster, which sends it to the address
/// the target header names.
pub fn callout<H: Host>(
    host: &H,
    config: &Config,
    target: &str,
    path: &str,
    timeout: Duration,
) -> Result<u32, Status> {
    get(
        host,
        &config.health_cluster,
        target,
        Some((config.health_target_header.as_str(), target)),
        path,
        timeout,
    )
}

/// A GET through `cluster`, with the header that names its target when the cluster needs one.
fn get<H: Host>(
    host: &H,
    cluster: &str,
    authority: &str,
    target_header: Option<(&str, &str)>,
    path: &str,
    timeout: Duration,
) -> Result<u32, Status> {
    let mut headers = vec![
        (":method", "GET"),
        (":path", path),
        (":authority", authority),
        (":scheme", "http"),
        ("user-agent", "token-balancer"),
    ];
    headers.extend(target_header);
    host.dispatch(cluster, headers, timeout)
}

/// Sends node `i` its health callout, at the path its probe says (see `fleet::probe`).
pub fn send_health<H: Host>(
    host: &H,
    config: &Config,
    balancer: &Balancer,
    polls: &mut Polls,
    metrics: &Metrics<H>,
    i: usize,
) {
    let (Some(node), Some(state), Some(path)) = (
        balancer.node_config(i),
        balancer.nodes().get(i),
        balancer.health_path(i),
    ) else {
        return;
    };
    let target = node.health_target();
    let timeout = Duration::from_millis(config.health_timeout_ms);
    match callout(host, config, target, path, timeout) {
        Ok(token) => polls.health.sent(token, i, state.tenant()),
        Err(e) => {
            metrics.bump(Stat::HealthFailed);
            warn!(
                "health call to {target} via cluster {:?} could not start: {e:?}",
                config.health_cluster
            );
        }
    }
}

impl<H: Host> State<H> {
    /// Sends one health callout to every node of the slices now due (see `polling`) that has
    /// none outstanding. Returns the slices polled, and the timer period the schedule wants.
    pub fn poll_health(&mut self, now_ms: u64) -> (Vec<usize>, u64) {
        let State {
            host,
            config,
            balancer,
            metrics,
            role,
            ..
        } = self;
        let (polls, service) = match role {
            Role::Vm(polls) => (polls, None),
            Role::Service(polls, service) => {
                // The nodes the workers named since the last tick (`share::wake`).
                metrics.count(&service.take_woken(&mut *host));
                (polls, Some(&*service))
            }
            Role::Reader(_) => return (Vec::new(), config.tick_ms),
        };
        // The fleet may grow or shrink (membership): the slices follow it.
        let nodes = balancer.nodes();
        let due = polls.schedule.due(nodes.len(), config.tick_ms, now_ms);
        let slices = polls.schedule.slices();
        for i in due
            .iter()
            .flat_map(|&slice| polling::slice_nodes(slice, slices, nodes.len()))
        {
            let Some(state) = nodes.get(i) else { continue };
            // A node whose last poll is still outstanding is not polled again: slow nodes must
            // not pile up callouts. A node out of the cluster is not polled at all, a quiet
            // one only once its longer period is up (see `polling`).
            if !state.member() || polls.health.is_asked(i, state.tenant()) {
                continue;
            }
            // Prompts sent there whose first token has not come back: this VM's own books,
            // or (the poller service) the shared books of a node a worker named.
            let prefilling = || match service {
                Some(service) => service.waiting(&mut *host, i),
                None => balancer.books(i).is_some_and(|b| b.prefilling()),
            };
            if !state.poll_due(now_ms, prefilling) {
                continue;
            }
            send_health(host, config, balancer, polls, metrics, i);
        }
        // The gauge once a round: counting the quiet nodes is a walk over the whole fleet.
        if polls.schedule.round_polled() {
            let quiet = nodes
                .iter()
                .filter(|n| n.member() && n.quiet_reports() > 0)
                .count();
            metrics.record(Stat::HealthQuietNodes, quiet as u64);
        }
        (due, polls.schedule.period_ms())
    }

    /// Asks every node of the slices `due` whose model list is due, and not configured, for
    /// its `/v1/models`. The list lives where requests are served, so the callout goes to
    /// `address`, not to a `health_address` (a metrics sidecar serves no model list).
    pub fn poll_models(&mut self, due: &[usize], now_ms: u64) {
        let State {
            host,
            config,
            balancer,
            metrics,
            role,
            ..
        } = self;
        let Some(polls) = role.polls() else { return };
        if config.models_poll_ms == 0 {
            return;
        }
        let slices = polls.schedule.slices();
        let timeout = Duration::from_millis(config.health_timeout_ms);
        let nodes = balancer.nodes();
        for i in due
            .iter()
            .flat_map(|&slice| polling::slice_nodes(slice, slices, nodes.len()))
        {
            let (Some(state), Some(node), Some(p)) = (
                nodes.get(i),
                balancer.node_config(i),
                polls.list_polls.get_mut(i),
            ) else {
                continue;
            };
            // Lists are asked in the slice their node's health is: a thousand nodes due at
            // once (at start) are asked a slice at a time too.
            if !state.member()
                || !balancer.learns_models(i)
                || !p.due(now_ms)
                || polls.models.is_asked(i, state.tenant())
            {
                continue;
            }
            let target = node.address.as_str();
            match callout(host, config, target, "/v1/models", timeout) {
                Ok(token) => {
                    polls.models.sent(token, i, state.tenant());
                    p.sent(now_ms);
                }
                Err(e) => {
                    metrics.bump(Stat::ModelsFailed);
                    p.answered(false, now_ms);
                    warn!("model list call to {target} could not start: {e:?}");
                }
            }
        }
    }

    /// Asks Envoy's admin for the members of the inference cluster, when due (see
    /// `membership`).
    pub fn poll_members(&mut self, now_ms: u64) {
        let State {
            host,
            config,
            metrics,
            role,
            ..
        } = self;
        let Some(polls) = role.polls() else { return };
        let Some(m) = &config.membership else {
            return;
        };
        if polls.members.is_some() || now_ms < polls.members_due_ms {
            return;
        }
        polls.members_due_ms = now_ms.saturating_add(m.poll_ms);
        let timeout = Duration::from_millis(config.health_timeout_ms.max(1000));
        match get(
            host,
            &m.admin_cluster,
            "envoy-admin",
            None,
            "/clusters?format=json",
            timeout,
        ) {
            Ok(token) => polls.members = Some(token),
            Err(e) => {
                metrics.bump(Stat::MembersFailed);
                warn!(
                    "member list call via cluster {:?} could not start: {e:?}",
                    m.admin_cluster
                );
            }
        }
    }
}
