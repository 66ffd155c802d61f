//! What a VM does besides routing, told by its configuration and its `root_id` (`Role`), and
//! each role's part in a decision and a tick.
//!
//! - `Vm` (`poller: vm`): polls every node itself and keeps its own books; nothing shared.
//! - `Service` (root_id `token_balancer_poller`, a bootstrap extension on Envoy's main
//!   thread, `poller: singleton`): polls every node, publishes the fleet snapshot for the
//!   workers, and owns the shared books' keys (see `share::sync::Service`). It routes nothing.
//! - `Reader` (a worker's filter VM with `poller: singleton`): polls nothing; it decides on the
//!   snapshot the service publishes and on the books every worker shares, and writes its own
//!   dispatches, progress and releases there (see `share::sync::Reader`).
//!
//! The protocol itself is in the core (`share::sync`); this file passes it the host and the
//! balancer and turns what it returns into counters and log lines.

use crate::host::Host;
use crate::metrics::Stat;
use crate::polls::Polls;
use crate::state::{Placement, State, PROMPT_RATIO_STEP};
use log::{debug, info, warn};
use token_balancer_core::config::{Config, Poller};
use token_balancer_core::fleet::node::Ticket;
use token_balancer_core::ingest::prompt::Chain;
use token_balancer_core::ingest::request::Weight;
use token_balancer_core::route::admission::Held;
use token_balancer_core::route::balancer::{MemberChange, Outcome, OwnBooks, Terms};
use token_balancer_core::route::beliefs;
use token_balancer_core::share::sync::{self, FleetEvent, Reads};
use token_balancer_core::share::{Change, Read};

/// What this VM is (see the module comment), with the state that role needs.
pub enum Role {
    /// `poller: vm`: polls, and keeps its own books.
    Vm(Polls),
    /// The poller service: polls, publishes the fleet, claims the books.
    Service(Polls, sync::Service),
    /// A worker VM with `poller: singleton`: reads the fleet, shares the books.
    Reader(sync::Reader),
}

impl Role {
    /// The role of a VM configured with `config`, `is_poller` when its root_id is the poller
    /// service's, started at `now_ms`. `None`: the poller service must be `singleton`.
    pub fn new(config: &Config, is_poller: bool, now_ms: u64) -> Option<Role> {
        match (is_poller, config.poller) {
            (true, Poller::Singleton) => Some(Role::Service(
                Polls::new(config),
                // The service's slots are the books' keys; a reader learns them from the
                // snapshot.
                sync::Service::new(config.nodes.iter().map(|n| n.address.as_str()), now_ms),
            )),
            (true, Poller::Vm) => None,
            (false, Poller::Singleton) => Some(Role::Reader(sync::Reader::default())),
            (false, Poller::Vm) => Some(Role::Vm(Polls::new(config))),
        }
    }

    /// The polls of a role that polls.
    pub fn polls(&mut self) -> Option<&mut Polls> {
        match self {
            Role::Vm(p) | Role::Service(p, _) => Some(p),
            Role::Reader(_) => None,
        }
    }
}

impl<H: Host> State<H> {
    /// The service's start: the books exist before any worker routes (workers never create
    /// them), and the first snapshot is out.
    pub fn start(&mut self, now_ms: u64) {
        if let Role::Service(_, service) = &self.role {
            let counts = service.claim_all(&mut self.host);
            self.metrics.count(&counts);
            self.publish(now_ms);
        }
    }

    /// Routes a request on its terms (`Balancer::route_on`): a reader weighs each drawn node
    /// by its shared books, any other role by its balancer's own. Returns the reads of the
    /// shared books made, for the dispatch.
    pub fn decide(
        &mut self,
        weight: Weight,
        model: Option<&str>,
        chain: &Chain,
        now_ms: u64,
        terms: Terms,
    ) -> (Outcome, Reads) {
        self.follow_placements(now_ms);
        let Role::Reader(reader) = &self.role else {
            let outcome = self.balancer.route_on(
                weight,
                model,
                chain,
                now_ms,
                &mut self.rng,
                terms,
                &mut OwnBooks,
            );
            return (outcome, Reads::default());
        };
        let mut books = reader.books(&mut self.host);
        let outcome = self.balancer.route_on(
            weight,
            model,
            chain,
            now_ms,
            &mut self.rng,
            terms,
            &mut books,
        );
        let (reads, counts) = books.finish();
        self.metrics.count(&counts);
        self.publish_placements(now_ms);
        (outcome, reads)
    }

    /// Reader: takes the other workers' placements into this VM's prefix index
    /// (`share::journal`).
    fn follow_placements(&mut self, now_ms: u64) {
        if let Role::Reader(reader) = &mut self.role {
            let c = reader.follow_placements(&mut self.host, &mut self.balancer, now_ms);
            self.metrics.count_journal(&c);
        }
    }

    /// Reader: publishes this VM's placements for the other workers (those gathered into a
    /// batch once it is due, `share::journal`).
    pub(crate) fn publish_placements(&mut self, now_ms: u64) {
        if let Role::Reader(reader) = &mut self.role {
            let c = reader.publish_placements(&mut self.host, &mut self.balancer, now_ms);
            self.metrics.count_journal(&c);
        }
    }

    /// The filter's beliefs at `now_ms` as JSON (see `route::beliefs`): a reader's with the
    /// books every worker shares, read once per node; the others with their own.
    pub fn beliefs(&mut self, now_ms: u64) -> Vec<u8> {
        let held = Some(self.held.len());
        let value = match &self.role {
            Role::Reader(reader) => {
                let mut books = reader.books(&mut self.host);
                let value = beliefs::render(&self.balancer, now_ms, &mut books, held);
                let (_, counts) = books.finish();
                self.metrics.count(&counts);
                value
            }
            _ => beliefs::render(&self.balancer, now_ms, &mut OwnBooks, held),
        };
        let mut body = value.to_string().into_bytes();
        body.push(b'\n');
        body
    }

    /// Takes the held requests that may now go out of the queue, with their outcomes
    /// (`HoldQueue::admit`, with the books `decide` uses).
    pub fn admit(&mut self, now_ms: u64) -> Vec<(Held<Placement>, Outcome)> {
        self.follow_placements(now_ms);
        let Role::Reader(reader) = &self.role else {
            return self
                .held
                .admit(now_ms, &mut self.balancer, &mut self.rng, &mut OwnBooks);
        };
        let mut books = reader.books(&mut self.host);
        let admitted = self
            .held
            .admit(now_ms, &mut self.balancer, &mut self.rng, &mut books);
        let (_, counts) = books.finish();
        self.metrics.count(&counts);
        self.publish_placements(now_ms);
        admitted
    }

    /// Reader: writes `change` to the shared books of `ticket`'s node (a dispatch, progress, a
    /// release), from `known`, a read of them just made. Other roles keep no shared books.
    pub fn share(&mut self, ticket: &Ticket, change: Change, known: Option<Read>) {
        if let Role::Reader(reader) = &mut self.role {
            let counts = reader.write(&mut self.host, &self.balancer, ticket, change, known);
            self.metrics.count(&counts);
        }
    }

    /// Reader: a prompt was just sent to `node`; if the poller service may be polling it less
    /// often than every tick (`NodeState::polled_late`), it is named on the wake list, once
    /// per report of it (`share::wake`), so the service polls it every tick again while the
    /// prompt waits.
    pub fn wake(&mut self, node: usize) {
        let Role::Reader(reader) = &mut self.role else {
            return;
        };
        let Some(state) = self.balancer.nodes().get(node) else {
            return;
        };
        if state.polled_late() {
            let counts = reader.wake(&mut self.host, node, state.epoch());
            self.metrics.count(&counts);
        }
    }

    /// The prompt ratio in use, into its gauge once it has moved by `PROMPT_RATIO_STEP`.
    pub fn note_prompt_ratio(&mut self) {
        let permille = self.balancer.prompt_permille();
        if self.prompt_permille == 0 || permille.abs_diff(self.prompt_permille) >= PROMPT_RATIO_STEP
        {
            self.metrics.record(Stat::PromptRatioPermille, permille);
            self.prompt_permille = permille;
        }
    }

    /// Reader: takes a new fleet snapshot if the version moved, and says whether there is a
    /// usable one, and whether a node got a new report. Other roles always have their fleet.
    pub fn sync_fleet(&mut self, now_ms: u64) -> (bool, bool) {
        let Role::Reader(reader) = &mut self.role else {
            return (true, false);
        };
        let synced = reader.sync(
            &mut self.host,
            &mut self.balancer,
            now_ms,
            self.config.stale_after_ms,
        );
        self.metrics.count(&synced.counts);
        // A snapshot may bring the engines' prompt ratio (see `route::prompt_scale`).
        if synced.new_reports && self.balancer.engine_prompt_ratio().is_some() {
            self.note_prompt_ratio();
        }
        // The per-node counters of a node followed from the poller's fleet are named after
        // it; the service counts and logs the joins and departures, once for the process.
        for &i in &synced.joined {
            if let Some(address) = self.balancer.nodes().get(i).map(|n| n.address()) {
                self.metrics.name_node(i, address);
                debug!("node {address} followed from the poller's fleet");
            }
        }
        if synced.lacking > 0 {
            warn!(
                "the poller's snapshot lacks {} of this filter's nodes: give the poller service the filter's configuration",
                synced.lacking
            );
        }
        match synced.event {
            Some(FleetEvent::InUse) => info!("fleet snapshot from the poller service in use"),
            Some(FleetEvent::Lost(why)) => {
                warn!("{why}: requests go to Envoy's own balancer until it is back")
            }
            None => {}
        }
        (synced.usable, synced.new_reports)
    }

    /// Reader: writes the book changes kept for later.
    pub fn flush_books(&mut self) {
        if let Role::Reader(reader) = &mut self.role {
            let counts = reader.flush(&mut self.host, &self.balancer);
            self.metrics.count(&counts);
        }
    }

    /// Service: publishes the fleet if it changed, and the heartbeat.
    pub fn publish(&mut self, now_ms: u64) {
        if let Role::Service(_, service) = &mut self.role {
            let counts = service.publish(&mut self.host, &self.balancer, now_ms);
            self.metrics.count(&counts);
        }
    }

    /// Service: the totals of the shared books, as gauges, and a pass of the engines' prompt
    /// counters against them (`sync::Service::read_books`).
    pub fn report_books(&mut self) {
        if let Role::Service(_, service) = &mut self.role {
            let t = service.read_books(&mut self.host, &self.balancer);
            self.metrics
                .record(Stat::SharedInflightRequests, t.inflight_requests);
            self.metrics
                .record(Stat::SharedInflightTokens, t.inflight_tokens);
        }
    }

    /// The cluster's members are now `addresses` (`Balancer::set_members`); the service
    /// reuses a slot only once its shared books are empty, and claims the books of the slots
    /// that change hands (`sync::Service::follow_members`).
    pub fn follow_members(&mut self, addresses: &[String]) -> MemberChange {
        match &mut self.role {
            Role::Service(_, service) => {
                let (change, counts) =
                    service.follow_members(&mut self.host, &mut self.balancer, addresses);
                self.metrics.count(&counts);
                change
            }
            _ => self.balancer.set_members(addresses, |_| false),
        }
    }
}
