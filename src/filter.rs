//! The proxy-wasm glue: moves bytes between Envoy and the pure core, and nothing else.
//!
//! Root context (one per VM, i.e. per Envoy worker): reads the plugin configuration, polls every
//! node's health endpoint on the tick timer with HTTP callouts (and, less often, its
//! `/v1/models`), and owns the `Balancer`. With `poller: singleton` a root plays one of two other
//! roles (`Role`, told by its `plugin_root_id`): the poller service (a bootstrap extension, main
//! thread) polls and publishes the fleet in shared data; a filter VM polls nothing, reads the
//! fleet, and writes its dispatches, progress and releases into the shared books (see
//! `shared`; the glue only moves their bytes through `HostStore`).
//! HTTP context (one per request): strips any client-supplied routing header, pauses the
//! headers, reads the body up to the limit, asks the balancer, writes the routing header and
//! lets the request go (or, for a model no node serves and `unknown_model: reject`, answers
//! 404 itself); when the stream ends it releases the request's in-flight booking.
//!
//! Every path that cannot decide continues the request untouched, so Envoy's own fallback
//! balancer routes it (fail-open). Host calls go through `proxy_wasm::hostcalls`, which return
//! errors instead of panicking like the SDK's convenience trait methods do; an error from Envoy
//! degrades to the fail-open path, since a panic would trap the VM and fail the traffic.

use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};
use token_balancer_core::config::{Config, Poller, UnknownModel};
use token_balancer_core::fleet::models::ListPoll;
use token_balancer_core::fleet::node::{tenant_of, Ticket, Transition};
use token_balancer_core::fleet::polling::{self, Schedule};
use token_balancer_core::ingest::members;
use token_balancer_core::ingest::request::{self, Api, Weight};
use token_balancer_core::ingest::response::OutputMeter;
use token_balancer_core::ingest::telemetry::Report;
use token_balancer_core::rng::SplitMix64;
use token_balancer_core::route::admission::HoldQueue;
use token_balancer_core::route::balancer::{
    Balancer, BookSource, HealthError, MemberChange, Outcome,
};
use token_balancer_core::share::{
    self, Books, Change, Ledger, Read, SetError, Snapshot, Store, StoreFailed, Version, Written,
};

/// Largest health answer read; a larger one is a broken node, not telemetry. Engines' Prometheus
/// text is far larger than the seed JSON: one vLLM engine's `/metrics` is about 35 KB with its
/// histograms, and a data-parallel vLLM repeats every series per engine (8 engines, ~300 KB).
/// Parsing costs about 4 ms per MiB under V8 (the parser reads ~250 MB/s as Wasm).
const MAX_HEALTH_BODY: usize = 1024 * 1024;
/// Largest admin `/clusters` answer read: about 1 KiB per host (with its stats) for every
/// cluster Envoy has, so 16 MiB is ten thousand hosts.
const MAX_MEMBERS_BODY: usize = 16 * 1024 * 1024;
/// Delay before the first poll, so a freshly started Envoy has data within a fraction of a
/// second instead of a whole tick.
const FIRST_POLL: Duration = Duration::from_millis(50);
/// Output tokens a stream delivers between two writes of its progress to the shared books: a
/// write is two host calls, and per token that would be most of a stream's cost.
const SHARED_PROGRESS_STEP: u64 = 16;

/// proxy-wasm shared data, which every VM with this plugin's `vm_id` sees (see `shared`).
struct HostStore;

impl Store for HostStore {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreFailed> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Ok(Some((bytes, cas.unwrap_or(0)))),
            Ok((None, _)) => Ok(None),
            Err(_) => Err(StoreFailed),
        }
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(proxy_wasm::types::Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Failed),
        }
    }
}

/// What this root context is, from its configuration and its `root_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// `poller: vm`: polls for itself and keeps its own books (one per VM).
    Vm,
    /// The poller service (root_id `token_balancer_poller`): polls, publishes the fleet.
    Service,
    /// A filter VM with `poller: singleton`: reads the fleet, shares the books.
    Reader,
}

/// How long a reader trusts its last look at the version record while the fleet is usable. A
/// new snapshot comes once a tick (>= 10 ms), so looking on every request would nearly always
/// cost a host call to learn that nothing moved; a snapshot or a lost heartbeat is noticed at
/// most this much later.
const VERSION_RECHECK_MS: u64 = 10;

/// Where a node's shared books are: its slot in the poller's fleet, and who it is.
struct BookKey {
    slot: usize,
    tenant: u64,
    /// `share::books_key(slot)`, made once.
    key: String,
}

impl BookKey {
    fn new(slot: usize, tenant: u64) -> BookKey {
        BookKey {
            slot,
            tenant,
            key: share::books_key(slot),
        }
    }
}

/// Whether the shared books under `key` have requests in flight (or cannot be read, which
/// counts as busy: a slot is never reused on a guess).
fn books_busy(key: &str) -> bool {
    match HostStore.get(key) {
        Ok(Some((bytes, _))) => Books::decode(&bytes).map_or(true, |b| b.inflight_requests > 0),
        Ok(None) => false,
        Err(StoreFailed) => true,
    }
}

/// The shared-data side of a VM in singleton mode.
#[derive(Default)]
struct Sharing {
    /// Reader: when the version record was last read.
    version_checked_ms: Option<u64>,
    /// Books key of each node, index for index with the balancer's nodes (`None`: a reader's
    /// node the poller's snapshot does not have).
    keys: Vec<Option<BookKey>>,
    ledger: Ledger,
    /// The reader's last imported version; the service's last published.
    version: Option<u64>,
    /// Reader: the snapshot is there and the poller alive.
    fleet_ok: bool,
    /// Reader: the loss of the snapshot has been logged (once until it is back).
    warned: bool,
    /// Service: added to every node's report epoch (its start time, see `fleet_view`).
    epoch_base: u64,
    /// Service: the bytes last published, so the version moves only when something changed.
    published: Vec<u8>,
}

pub fn start() {
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| {
        Box::new(Root {
            context_id,
            ..Root::default()
        })
    });
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Why a health callout brought no body to parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallFailure {
    /// No response at all (a reset).
    NoAnswer,
    /// A response other than 200.
    BadStatus,
    /// A 200 whose body is over the read limit.
    TooLarge,
}

/// A GET to `target` (`ip:port`) through the health cluster, which sends it to the address the
/// target header names: the only way the filter reaches a node outside a request.
fn callout(
    config: &Config,
    target: &str,
    path: &str,
    timeout: Duration,
) -> Result<u32, proxy_wasm::types::Status> {
    get(
        &config.health_cluster,
        target,
        Some((config.health_target_header.as_str(), target)),
        path,
        timeout,
    )
}

/// A GET through `cluster`, with the header that names its target when the cluster needs one.
fn get(
    cluster: &str,
    authority: &str,
    target_header: Option<(&str, &str)>,
    path: &str,
    timeout: Duration,
) -> Result<u32, proxy_wasm::types::Status> {
    let mut headers = vec![
        (":method", "GET"),
        (":path", path),
        (":authority", authority),
        (":scheme", "http"),
        ("user-agent", "token-balancer"),
    ];
    headers.extend(target_header);
    hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout)
}

/// The answer to the current HTTP callout: its status, and its body when that is a 200 within
/// the read limit, or why not. A reset callout has no :status; Envoy answers refused (503) and
/// timed-out (504) callouts itself, so those count as bad statuses.
fn call_answer(body_size: usize) -> (Option<String>, Option<Vec<u8>>, Option<CallFailure>) {
    call_answer_within(body_size, MAX_HEALTH_BODY)
}

fn call_answer_within(
    body_size: usize,
    limit: usize,
) -> (Option<String>, Option<Vec<u8>>, Option<CallFailure>) {
    let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten();
    let (body, failure) = match status.as_deref() {
        None => (None, Some(CallFailure::NoAnswer)),
        Some("200") if body_size > limit => (None, Some(CallFailure::TooLarge)),
        Some("200") => (
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .map(|b| b.unwrap_or_default()),
            None,
        ),
        Some(_) => (None, Some(CallFailure::BadStatus)),
    };
    (status, body, failure)
}

/// Envoy counters (they appear under `wasmcustom.` in Envoy's stats).
#[derive(Default)]
struct Metrics {
    routed: u32,
    routed_over_vram_ceiling: u32,
    fallback_no_fresh_nodes: u32,
    fallback_no_body: u32,
    fallback_body_unusable: u32,
    fallback_body_over_limit: u32,
    fallback_encoded_body: u32,
    fallback_internal: u32,
    fallback_unknown_model: u32,
    rejected_unknown_model: u32,
    client_routing_header_removed: u32,
    held: u32,
    held_routed_over_ceiling: u32,
    held_now: u32,
    inflight_now: u32,
    vm_memory_bytes: u32,
    health_ok: u32,
    health_failed: u32,
    health_unparsable: u32,
    health_no_answer: u32,
    health_bad_status: u32,
    health_too_large: u32,
    nodes_ejected: u32,
    nodes_readmitted: u32,
    models_ok: u32,
    models_failed: u32,
    models_unparsable: u32,
    members_ok: u32,
    members_failed: u32,
    nodes_joined: u32,
    nodes_left: u32,
    members_now: u32,
    fallback_no_fleet: u32,
    shared_failed: u32,
    shared_cas_retries: u32,
    shared_cas_exhausted: u32,
    shared_books_missing: u32,
    shared_books_gone: u32,
    shared_published: u32,
    shared_imported: u32,
    shared_inflight_requests: u32,
    shared_inflight_tokens: u32,
    node_picks: Vec<u32>,
    node_health_failures: Vec<u32>,
}

/// A per-node counter, named after the node's address.
fn node_counter(address: &str, what: &str) -> u32 {
    let safe: String = address
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    counter(&format!("token_balancer.node.{safe}.{what}"))
}

fn counter(name: &str) -> u32 {
    // 0 is never a valid metric id; incrementing it fails harmlessly.
    hostcalls::define_metric(MetricType::Counter, name).unwrap_or(0)
}

fn bump(id: u32) {
    if id != 0 {
        let _ = hostcalls::increment_metric(id, 1);
    }
}

impl Metrics {
    /// Node `i` has (a new) `address`: its counters are named after it.
    fn name_node(&mut self, i: usize, address: &str) {
        for (list, what) in [
            (&mut self.node_picks, "picks"),
            (&mut self.node_health_failures, "health_failures"),
        ] {
            if list.len() <= i {
                list.resize(i + 1, 0);
            }
            if let Some(id) = list.get_mut(i) {
                *id = node_counter(address, what);
            }
        }
    }

    fn define(cfg: &Config) -> Metrics {
        let p = "token_balancer";
        let node = node_counter;
        Metrics {
            routed: counter(&format!("{p}.routed")),
            routed_over_vram_ceiling: counter(&format!("{p}.routed_over_vram_ceiling")),
            fallback_no_fresh_nodes: counter(&format!("{p}.fallback.no_fresh_nodes")),
            fallback_no_body: counter(&format!("{p}.fallback.no_body")),
            fallback_body_unusable: counter(&format!("{p}.fallback.body_unusable")),
            fallback_body_over_limit: counter(&format!("{p}.fallback.body_over_limit")),
            fallback_encoded_body: counter(&format!("{p}.fallback.encoded_body")),
            fallback_internal: counter(&format!("{p}.fallback.internal")),
            fallback_unknown_model: counter(&format!("{p}.fallback.unknown_model")),
            rejected_unknown_model: counter(&format!("{p}.rejected.unknown_model")),
            client_routing_header_removed: counter(&format!("{p}.client_routing_header_removed")),
            held: counter(&format!("{p}.held")),
            held_routed_over_ceiling: counter(&format!("{p}.held_routed_over_ceiling")),
            held_now: hostcalls::define_metric(MetricType::Gauge, &format!("{p}.held_now"))
                .unwrap_or(0),
            inflight_now: hostcalls::define_metric(MetricType::Gauge, &format!("{p}.inflight_now"))
                .unwrap_or(0),
            vm_memory_bytes: hostcalls::define_metric(
                MetricType::Gauge,
                &format!("{p}.vm_memory_bytes"),
            )
            .unwrap_or(0),
            health_ok: counter(&format!("{p}.health.ok")),
            health_failed: counter(&format!("{p}.health.failed")),
            health_unparsable: counter(&format!("{p}.health.unparsable")),
            health_no_answer: counter(&format!("{p}.health.no_answer")),
            health_bad_status: counter(&format!("{p}.health.bad_status")),
            health_too_large: counter(&format!("{p}.health.too_large")),
            nodes_ejected: counter(&format!("{p}.nodes_ejected")),
            nodes_readmitted: counter(&format!("{p}.nodes_readmitted")),
            models_ok: counter(&format!("{p}.models.ok")),
            models_failed: counter(&format!("{p}.models.failed")),
            models_unparsable: counter(&format!("{p}.models.unparsable")),
            members_ok: counter(&format!("{p}.members.ok")),
            members_failed: counter(&format!("{p}.members.failed")),
            nodes_joined: counter(&format!("{p}.nodes_joined")),
            nodes_left: counter(&format!("{p}.nodes_left")),
            members_now: hostcalls::define_metric(MetricType::Gauge, &format!("{p}.members_now"))
                .unwrap_or(0),
            fallback_no_fleet: counter(&format!("{p}.fallback.no_fleet")),
            shared_failed: counter(&format!("{p}.shared.failed")),
            shared_cas_retries: counter(&format!("{p}.shared.cas_retries")),
            shared_cas_exhausted: counter(&format!("{p}.shared.cas_exhausted")),
            shared_books_missing: counter(&format!("{p}.shared.books_missing")),
            shared_books_gone: counter(&format!("{p}.shared.books_gone")),
            shared_published: counter(&format!("{p}.shared.published")),
            shared_imported: counter(&format!("{p}.shared.imported")),
            shared_inflight_requests: hostcalls::define_metric(
                MetricType::Gauge,
                &format!("{p}.shared.inflight_requests"),
            )
            .unwrap_or(0),
            shared_inflight_tokens: hostcalls::define_metric(
                MetricType::Gauge,
                &format!("{p}.shared.inflight_tokens"),
            )
            .unwrap_or(0),
            node_picks: cfg
                .nodes
                .iter()
                .map(|n| node(&n.address, "picks"))
                .collect(),
            node_health_failures: cfg
                .nodes
                .iter()
                .map(|n| node(&n.address, "health_failures"))
                .collect(),
        }
    }
}

/// What the root context and its requests share (one VM is single-threaded).
struct State {
    /// Shared with the requests by reference count: no per-request copies of its strings.
    config: Rc<Config>,
    balancer: Balancer,
    rng: SplitMix64,
    metrics: Metrics,
    /// Requests waiting for a node with VRAM room (see `admission`).
    held: HoldQueue<Placement>,
    role: Role,
    sharing: Sharing,
}

impl State {
    /// Writes `change` to the shared books of `ticket`'s node (a reader's dispatch, progress,
    /// release) and counts what became of it, from `known`, a read of the node's books just
    /// made if there is one (see `Ledger::update`). Does nothing outside the reader role. The
    /// change counts for the ticket's tenant: if its node's slot has gone to another address
    /// since, the change is dropped (`Written::Gone`), and a ticket of an earlier
    /// configuration changes the books of its address only (`Balancer::holder`).
    fn share(&mut self, ticket: &Ticket, change: Change, known: Option<Read>) {
        if self.role != Role::Reader {
            return;
        }
        // A ticket from before a reconfiguration still has its booking in the shared books,
        // which outlive this VM's balancer: it is found by its node's address.
        let Some(node) = self.balancer.holder(ticket) else {
            return;
        };
        let Some(Some(book)) = self.sharing.keys.get(node) else {
            return;
        };
        let epoch = self.balancer.nodes().get(node).map_or(0, |n| n.epoch());
        let written = self.sharing.ledger.update(
            &mut HostStore,
            &book.key,
            ticket.tenant,
            epoch,
            change,
            known,
        );
        self.count_written(written);
    }

    /// Reader: its nodes followed the poller's (`Balancer::mirror_fleet`). The per-node
    /// counters of a new node are named after it; the service counts and logs the joins and
    /// departures, once for the process.
    fn note_members(&mut self, change: &MemberChange) {
        for &i in &change.joined {
            if let Some(address) = self
                .balancer
                .nodes()
                .get(i)
                .map(|n| n.address().to_string())
            {
                self.metrics.name_node(i, &address);
                debug!("node {address} followed from the poller's fleet");
            }
        }
    }

    /// The cluster's members are now `addresses` (`Balancer::set_members`). The service routes
    /// nothing itself: whether a departed node's requests have ended is in the shared books,
    /// so a slot (and its books key) is not reused before they have, and a slot taken by a new
    /// address has its books claimed for it.
    fn follow_members(&mut self, addresses: &[String]) -> MemberChange {
        if self.role != Role::Service {
            return self.balancer.set_members(addresses, |_| false);
        }
        let keys = &self.sharing.keys;
        let busy = |i: usize| {
            keys.get(i)
                .and_then(Option::as_ref)
                .is_some_and(|b| books_busy(&b.key))
        };
        let change = self.balancer.set_members(addresses, busy);
        self.claim_books(&change.joined);
        change
    }

    /// Service: the books of the slots `joined` count for the addresses now holding them
    /// (kept when they already do: a node back in its slot finds its requests still there).
    /// Written before the snapshot that shows the new nodes, so no worker routes to a node
    /// whose books are missing or still count for the slot's former address.
    fn claim_books(&mut self, joined: &[usize]) {
        for &i in joined {
            let Some(tenant) = self.balancer.nodes().get(i).map(|n| n.tenant()) else {
                continue;
            };
            if self.sharing.keys.len() <= i {
                self.sharing.keys.resize_with(i + 1, || None);
            }
            let book = BookKey::new(i, tenant);
            if share::ensure_books(&mut HostStore, &book.key, tenant).is_err() {
                bump(self.metrics.shared_failed);
            }
            if let Some(k) = self.sharing.keys.get_mut(i) {
                *k = Some(book);
            }
        }
    }

    /// Reader: the books key of each of its nodes, from the slots of `snapshot`, matched by
    /// address. A key is made again only when its node's slot or address changed.
    fn map_books(&mut self, snapshot: &Snapshot) {
        let slots: HashMap<&str, usize> = snapshot
            .nodes
            .iter()
            .enumerate()
            .map(|(i, v)| (v.address.as_str(), i))
            .collect();
        let nodes = self.balancer.nodes();
        self.sharing.keys.resize_with(nodes.len(), || None);
        for (n, book) in nodes.iter().zip(self.sharing.keys.iter_mut()) {
            let Some(&slot) = slots.get(n.address()) else {
                *book = None;
                continue;
            };
            if !book
                .as_ref()
                .is_some_and(|b| b.slot == slot && b.tenant == n.tenant())
            {
                *book = Some(BookKey::new(slot, n.tenant()));
            }
        }
    }

    fn count_written(&self, written: Written) {
        let m = &self.metrics;
        match written {
            Written::Yes { retries, .. } => {
                if retries > 0 && m.shared_cas_retries != 0 {
                    let _ = hostcalls::increment_metric(m.shared_cas_retries, i64::from(retries));
                }
            }
            Written::Exhausted => {
                bump(m.shared_cas_exhausted);
                if m.shared_cas_retries != 0 {
                    let _ = hostcalls::increment_metric(
                        m.shared_cas_retries,
                        i64::from(share::MAX_CAS_RETRIES),
                    );
                }
            }
            Written::Missing => bump(m.shared_books_missing),
            Written::Gone => bump(m.shared_books_gone),
            Written::Failed => bump(m.shared_failed),
        }
    }

    /// Reader: takes a new fleet snapshot if the version moved, and says whether there is a
    /// usable one (present, and the poller's heartbeat younger than `stale_after_ms`).
    /// Returns (usable, a node got a new report). One host call when nothing changed, none
    /// within `VERSION_RECHECK_MS` of the last look while the fleet is usable.
    fn sync_fleet(&mut self, now: u64) -> (bool, bool) {
        if self.sharing.fleet_ok
            && self
                .sharing
                .version_checked_ms
                .is_some_and(|at| now.saturating_sub(at) < VERSION_RECHECK_MS)
        {
            return (true, false);
        }
        self.sharing.version_checked_ms = Some(now);
        let version = match HostStore.get(share::VERSION_KEY) {
            Ok(Some((bytes, _))) => Version::decode(&bytes),
            Ok(None) => None,
            Err(StoreFailed) => {
                bump(self.metrics.shared_failed);
                None
            }
        };
        let alive =
            version.filter(|v| now.saturating_sub(v.heartbeat_ms) <= self.config.stale_after_ms);
        let mut new_reports = false;
        let mut usable = false;
        let mut why = "no fleet snapshot from the poller service";
        if let Some(v) = alive {
            if self.sharing.version == Some(v.version) {
                usable = self.sharing.fleet_ok;
            } else {
                match HostStore.get(share::FLEET_KEY) {
                    Ok(Some((bytes, _))) => match Snapshot::decode(&bytes) {
                        Ok(snapshot) => {
                            bump(self.metrics.shared_imported);
                            let change = self.balancer.mirror_fleet(&snapshot);
                            self.note_members(&change);
                            let imported = self.balancer.import_fleet(&snapshot);
                            self.map_books(&snapshot);
                            if imported.missing > 0 && !self.sharing.fleet_ok {
                                warn!(
                                    "the poller's snapshot lacks {} of this filter's nodes: give the poller service the filter's configuration",
                                    imported.missing
                                );
                            }
                            new_reports = imported.new_reports > 0;
                            self.sharing.version = Some(v.version);
                            usable = true;
                        }
                        Err(_) => {
                            bump(self.metrics.shared_failed);
                            why = "the fleet snapshot is unreadable";
                        }
                    },
                    Ok(None) => {}
                    Err(StoreFailed) => bump(self.metrics.shared_failed),
                }
            }
        } else if version.is_some() {
            why = "the poller service's heartbeat is stale (service gone?)";
        }
        if usable != self.sharing.fleet_ok || (!usable && !self.sharing.warned) {
            if usable {
                info!("fleet snapshot from the poller service in use");
                self.sharing.warned = false;
            } else if !self.sharing.warned {
                warn!("{why}: requests go to Envoy's own balancer until it is back");
                self.sharing.warned = true;
            }
        }
        self.sharing.fleet_ok = usable;
        (usable, new_reports)
    }

    /// Reader: writes the changes kept for later (see `shared::Ledger`).
    fn flush_books(&mut self) {
        if self.role != Role::Reader || self.sharing.ledger.pending() == 0 {
            return;
        }
        let keys = &self.sharing.keys;
        let nodes = self.balancer.nodes();
        let epoch_of = |k: &str| {
            keys.iter()
                .position(|x| x.as_ref().is_some_and(|b| b.key == k))
                .and_then(|i| nodes.get(i))
                .map_or(0, |n| n.epoch())
        };
        let results = self.sharing.ledger.flush(&mut HostStore, epoch_of);
        for w in results {
            self.count_written(w);
        }
    }

    /// Service: publishes the fleet if it changed (and bumps the version), and the heartbeat.
    fn publish(&mut self, now: u64) {
        if self.role != Role::Service {
            return;
        }
        let bytes = Snapshot {
            nodes: self.balancer.fleet_view(self.sharing.epoch_base),
        }
        .encode();
        let mut version = self.sharing.version.unwrap_or(self.sharing.epoch_base);
        if bytes != self.sharing.published {
            match HostStore.set(share::FLEET_KEY, &bytes, None) {
                Ok(()) => {
                    version += 1;
                    self.sharing.version = Some(version);
                    self.sharing.published = bytes;
                    bump(self.metrics.shared_published);
                }
                Err(_) => bump(self.metrics.shared_failed),
            }
        }
        let record = Version {
            version,
            heartbeat_ms: now,
        };
        if HostStore
            .set(share::VERSION_KEY, &record.encode(), None)
            .is_err()
        {
            bump(self.metrics.shared_failed);
        }
    }

    /// Service: the totals of the shared books, as gauges.
    fn report_books(&self) {
        if self.role != Role::Service {
            return;
        }
        let keys = self.sharing.keys.iter().flatten().map(|b| b.key.as_str());
        let t = share::totals(&mut HostStore, keys);
        let _ =
            hostcalls::record_metric(self.metrics.shared_inflight_requests, t.inflight_requests);
        let _ = hostcalls::record_metric(self.metrics.shared_inflight_tokens, t.inflight_tokens);
    }
}

/// The books a decision weighs nodes by. A reader takes each weighed node's from shared data
/// (every worker's dispatches), one host call per node weighed: the drawn candidates, not the
/// fleet. Any other role decides alone and keeps its balancer's own.
struct SharedBooks<'a> {
    sharing: &'a Sharing,
    role: Role,
    failed: u32,
    /// The reads made, by node: the chosen node's is where its dispatch is written from,
    /// without reading it again.
    reads: Vec<(usize, Read)>,
}

impl<'a> SharedBooks<'a> {
    fn of(sharing: &'a Sharing, role: Role, metrics: &Metrics) -> Self {
        SharedBooks {
            sharing,
            role,
            failed: metrics.shared_failed,
            reads: Vec::new(),
        }
    }

    /// The read of node `node`'s books this decision made, if it made one.
    fn read_of(reads: Vec<(usize, Read)>, node: usize) -> Option<Read> {
        reads
            .into_iter()
            .find(|(n, _)| *n == node)
            .map(|(_, read)| read)
    }
}

impl BookSource for SharedBooks<'_> {
    fn books(&mut self, node: usize, report_epoch: u64) -> Option<Books> {
        if self.role != Role::Reader {
            return None;
        }
        let book = self.sharing.keys.get(node)?.as_ref()?;
        match self
            .sharing
            .ledger
            .view(&mut HostStore, &book.key, book.tenant, report_epoch)
        {
            Some((books, read)) => {
                if let Some(read) = read {
                    self.reads.push((node, read));
                }
                Some(books)
            }
            None => {
                bump(self.failed);
                None
            }
        }
    }
}

/// A routed request's booking and debug header value.
#[derive(Default)]
struct Placed {
    ticket: Option<Ticket>,
    debug: Option<String>,
    /// The filter answered the request itself: it must not be resumed.
    answered: bool,
}

/// vLLM's answer to a model it does not serve (OpenAI's error shape), as JSON.
fn model_not_found_body(model: &str) -> Vec<u8> {
    serde_json::json!({"error": {
        "message": format!("The model `{model}` does not exist."),
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }})
    .to_string()
    .into_bytes()
}

/// Where a held request finds its placement once it is admitted: written by whichever
/// callback admits it (a tick, a health answer, another request's end), read by the request.
type Placement = Rc<RefCell<Option<Placed>>>;

/// Applies a routing outcome to the current (effective) request: sets the routing header and
/// counts it, or answers the request itself. `model` is the body's; `held_ms` is how long the
/// request waited in the hold queue, if it did; `reads` are the shared-books reads its decision
/// made (the dispatch is written from the chosen node's).
fn place(
    s: &mut State,
    outcome: Outcome,
    cap: Weight,
    model: Option<&str>,
    held_ms: Option<u64>,
    reads: Vec<(usize, Read)>,
) -> Placed {
    let debug_on = s.config.debug_header.is_some();
    let held = held_ms
        .map(|ms| format!("; held_ms={ms}"))
        .unwrap_or_default();
    match outcome {
        Outcome::Routed {
            ticket,
            header_value,
            predicted_seconds,
            over_ceiling,
            inflight_before,
        } => {
            if hostcalls::set_map_value(
                MapType::HttpRequestHeaders,
                &s.config.routing_header,
                Some(&header_value),
            )
            .is_err()
            {
                // Without the header Envoy balances on its own; undo the booking.
                s.balancer.release(&ticket, 0);
                bump(s.metrics.fallback_internal);
                return Placed::default();
            }
            bump(s.metrics.routed);
            let known = SharedBooks::read_of(reads, ticket.node);
            s.share(&ticket, Change::dispatch(&ticket), known);
            shift(s.metrics.inflight_now, 1);
            bump(s.metrics.node_picks.get(ticket.node).copied().unwrap_or(0));
            if over_ceiling {
                bump(s.metrics.routed_over_vram_ceiling);
                if held_ms.is_some() {
                    bump(s.metrics.held_routed_over_ceiling);
                }
            }
            let debug = debug_on.then(|| {
                format!(
                    "node={header_value}; prompt_tokens={}; output_tokens={}; output_cap={}; predicted_ms={:.1}; inflight={inflight_before}{held}",
                    ticket.weight.prompt_tokens,
                    ticket.weight.output_tokens,
                    cap.output_tokens,
                    predicted_seconds * 1000.0
                )
            });
            Placed {
                ticket: Some(ticket),
                debug,
                answered: false,
            }
        }
        Outcome::UnknownModel if s.config.unknown_model == UnknownModel::Reject => {
            let debug = debug_on.then(|| format!("rejected=unknown_model{held}"));
            let body = model_not_found_body(model.unwrap_or_default());
            let mut headers = vec![("content-type", "application/json")];
            if let (Some(name), Some(value)) = (&s.config.debug_header, &debug) {
                headers.push((name.as_str(), value.as_str()));
            }
            if hostcalls::send_http_response(404, headers, Some(&body)).is_err() {
                // Envoy would not take the answer: let its balancer route the request instead.
                bump(s.metrics.fallback_internal);
                return Placed::default();
            }
            bump(s.metrics.rejected_unknown_model);
            Placed {
                ticket: None,
                debug,
                answered: true,
            }
        }
        Outcome::UnknownModel => {
            bump(s.metrics.fallback_unknown_model);
            Placed {
                ticket: None,
                debug: debug_on.then(|| format!("fallback=unknown_model{held}")),
                answered: false,
            }
        }
        Outcome::NoFreshNodes | Outcome::Saturated => {
            bump(s.metrics.fallback_no_fresh_nodes);
            Placed {
                ticket: None,
                debug: debug_on.then(|| format!("fallback=no_fresh_nodes{held}")),
                answered: false,
            }
        }
    }
}

/// Routes the held requests that now have a node (or have waited long enough) and lets them
/// go. Called from the root's callbacks and from a request's end, which frees room. Envoy
/// defers the resumption until this VM call returns, so no callback re-enters the VM here.
/// `current` is the context this runs in, restored as the effective context afterwards.
fn admit_held(state: &Shared, current: u32) {
    let Ok(mut guard) = state.try_borrow_mut() else {
        return;
    };
    let Some(s) = guard.as_mut() else { return };
    if s.held.is_empty() {
        return;
    }
    let now = now_ms();
    let mut books = SharedBooks::of(&s.sharing, s.role, &s.metrics);
    let admitted = s.held.admit(now, &mut s.balancer, &mut s.rng, &mut books);
    if admitted.is_empty() {
        return;
    }
    shift(s.metrics.held_now, -(admitted.len() as i64));
    for (held, outcome) in admitted {
        if hostcalls::set_effective_context(held.id).is_err() {
            // The stream is gone without its end being seen: give the booking back.
            if let Outcome::Routed { ticket, .. } = &outcome {
                s.balancer.release(ticket, 0);
            }
            continue;
        }
        let placed = place(
            s,
            outcome,
            held.weight,
            held.model.as_deref(),
            Some(now.saturating_sub(held.since_ms)),
            // Several may go at once, each changing the books the next read: no reuse.
            Vec::new(),
        );
        let answered = placed.answered;
        if let Ok(mut placement) = held.payload.try_borrow_mut() {
            *placement = Some(placed);
        }
        if !answered {
            let _ = hostcalls::resume_http_request();
        }
    }
    let _ = hostcalls::set_effective_context(current);
}

/// Moves a gauge by `delta`: every worker VM adds its own changes, so the gauge is the total.
fn shift(id: u32, delta: i64) {
    if id != 0 {
        let _ = hostcalls::increment_metric(id, delta);
    }
}

type Shared = Rc<RefCell<Option<State>>>;

#[derive(Default)]
struct Root {
    context_id: u32,
    state: Shared,
    /// Outstanding health callouts: token -> node index.
    pending: HashMap<u32, usize>,
    /// Outstanding `/v1/models` callouts: token -> node index.
    pending_models: HashMap<u32, usize>,
    /// When to ask each node for its model list (see `models::ListPoll`).
    list_polls: Vec<ListPoll>,
    /// The outstanding admin `/clusters` callout (see `membership`), and when the next is due.
    pending_members: Option<u32>,
    members_due_ms: u64,
    first_tick_done: bool,
    /// Which slices of the fleet to poll when (see `polling`), and the timer period set.
    schedule: Schedule,
    period_ms: u64,
    /// What this VM last added to the memory gauge.
    memory_reported: u64,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if let Some(node) = self.pending_models.remove(&token) {
            self.on_models(node, body_size);
            return;
        }
        if self.pending_members == Some(token) {
            self.pending_members = None;
            self.on_members(body_size);
            return;
        }
        let Some(node) = self.pending.remove(&token) else {
            return;
        };
        let (status, body, failure) = call_answer(body_size);
        {
            let Ok(mut guard) = self.state.try_borrow_mut() else {
                return;
            };
            let Some(s) = guard.as_mut() else { return };
            let result = s.balancer.on_health(node, body.as_deref(), now_ms());
            self.count_health(s, node, result, failure, status.as_deref());
            // The round is complete: publish it now rather than a tick later.
            if self.pending.is_empty() && self.schedule.round_polled() {
                s.publish(now_ms());
            }
        }
        // A fresh report may show room for held requests.
        admit_held(&self.state, self.context_id);
    }
}

/// This VM's linear memory, bytes: what the VM costs Envoy, since a Wasm heap only grows.
#[cfg(target_arch = "wasm32")]
fn vm_memory_bytes() -> u64 {
    core::arch::wasm32::memory_size(0) as u64 * 65_536
}

#[cfg(not(target_arch = "wasm32"))]
fn vm_memory_bytes() -> u64 {
    0
}

impl Root {
    fn role(&self) -> Option<Role> {
        let guard = self.state.try_borrow().ok()?;
        guard.as_ref().map(|s| s.role)
    }

    /// Reader's tick: the fleet snapshot if it moved, and the book changes kept for later.
    /// The tick period is the configured one from the first tick (no polls to hurry).
    fn read_fleet(&mut self) {
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let Some(s) = guard.as_mut() else { return };
        if !self.first_tick_done {
            self.first_tick_done = true;
            let _ = hostcalls::set_tick_period(Duration::from_millis(s.config.tick_ms));
        }
        s.sync_fleet(now_ms());
        s.flush_books();
    }

    /// Moves the `vm_memory_bytes` gauge by this VM's growth since its last report, so the
    /// gauge is the total over every VM of the plugin (one per worker, one on the main thread).
    fn report_memory(&mut self) {
        let now = vm_memory_bytes();
        if now != self.memory_reported {
            if let Ok(guard) = self.state.try_borrow() {
                if let Some(s) = guard.as_ref() {
                    shift(
                        s.metrics.vm_memory_bytes,
                        now as i64 - self.memory_reported as i64,
                    );
                    self.memory_reported = now;
                }
            }
        }
    }

    /// A node's `/v1/models` answer: a good list replaces the last one; anything else keeps it.
    fn on_models(&mut self, node: usize, body_size: usize) {
        let (status, body, failure) = call_answer(body_size);
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let Some(s) = guard.as_mut() else { return };
        let address = s
            .balancer
            .nodes()
            .get(node)
            .map(|n| n.address().to_string())
            .unwrap_or_default();
        let good = match body {
            None => {
                bump(s.metrics.models_failed);
                let why = match failure {
                    Some(CallFailure::NoAnswer) => "no answer (reset)".to_string(),
                    Some(CallFailure::TooLarge) => {
                        format!("over {MAX_HEALTH_BODY} bytes, not read")
                    }
                    Some(CallFailure::BadStatus) => {
                        format!("status {}", status.unwrap_or_default())
                    }
                    None => "body could not be read".to_string(),
                };
                debug!("model list of {address}: {why}");
                false
            }
            Some(body) => {
                let before = s
                    .balancer
                    .nodes()
                    .get(node)
                    .and_then(|n| n.models().listed().map(<[String]>::to_vec));
                match s.balancer.on_models(node, &body) {
                    Ok(_) => {
                        bump(s.metrics.models_ok);
                        let now = s
                            .balancer
                            .nodes()
                            .get(node)
                            .and_then(|n| n.models().listed());
                        if before.as_deref() != now {
                            info!(
                                "node {address} serves: {}",
                                now.unwrap_or_default().join(", ")
                            );
                        }
                        true
                    }
                    Err(e) => {
                        bump(s.metrics.models_unparsable);
                        debug!("model list of {address} not used: {e}");
                        false
                    }
                }
            }
        };
        if let Some(p) = self.list_polls.get_mut(node) {
            p.answered(good, now_ms());
        }
    }

    /// Asks every node of the slices `due` whose model list is due, and not configured, for its
    /// `/v1/models`. The list lives where requests are served, so the callout goes to
    /// `address`, not to a `health_address` (a metrics sidecar serves no model list).
    fn poll_models(&mut self, due: &[usize]) {
        let Ok(guard) = self.state.try_borrow() else {
            return;
        };
        let Some(s) = guard.as_ref() else { return };
        if s.config.models_poll_ms == 0 {
            return;
        }
        let slices = self.schedule.slices();
        let now = now_ms();
        let timeout = Duration::from_millis(s.config.health_timeout_ms);
        let outstanding: HashSet<usize> = self.pending_models.values().copied().collect();
        for (i, state) in s.balancer.nodes().iter().enumerate() {
            let Some(node) = s.balancer.node_config(i) else {
                continue;
            };
            let Some(p) = self.list_polls.get_mut(i) else {
                continue;
            };
            // Lists are asked in the slice their node's health is: a thousand nodes due at
            // once (at start) are asked a slice at a time too.
            if !state.member()
                || !s.balancer.learns_models(i)
                || !p.due(now)
                || !due.iter().any(|&slice| polling::in_slice(i, slice, slices))
                || outstanding.contains(&i)
            {
                continue;
            }
            let target = node.address.as_str();
            match callout(&s.config, target, "/v1/models", timeout) {
                Ok(token) => {
                    self.pending_models.insert(token, i);
                    p.sent(now);
                }
                Err(e) => {
                    bump(s.metrics.models_failed);
                    p.answered(false, now);
                    warn!("model list call to {target} could not start: {e:?}");
                }
            }
        }
    }

    /// Asks Envoy's admin for the members of the inference cluster, when due (see `membership`).
    fn poll_members(&mut self) {
        let Ok(guard) = self.state.try_borrow() else {
            return;
        };
        let Some(s) = guard.as_ref() else { return };
        let Some(m) = &s.config.membership else {
            return;
        };
        let now = now_ms();
        if self.pending_members.is_some() || now < self.members_due_ms {
            return;
        }
        self.members_due_ms = now.saturating_add(m.poll_ms);
        let timeout = Duration::from_millis(s.config.health_timeout_ms.max(1000));
        match get(
            &m.admin_cluster,
            "envoy-admin",
            None,
            "/clusters?format=json",
            timeout,
        ) {
            Ok(token) => self.pending_members = Some(token),
            Err(e) => {
                bump(s.metrics.members_failed);
                warn!(
                    "member list call via cluster {:?} could not start: {e:?}",
                    m.admin_cluster
                );
            }
        }
    }

    /// The admin `/clusters` answer: a good list becomes the node set; anything else keeps the
    /// last one (the nodes do not vanish because the admin did not answer once).
    fn on_members(&mut self, body_size: usize) {
        let (status, body, failure) = call_answer_within(body_size, MAX_MEMBERS_BODY);
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let Some(s) = guard.as_mut() else { return };
        let Some(m) = s.config.membership.clone() else {
            return;
        };
        let Some(body) = body else {
            bump(s.metrics.members_failed);
            warn!(
                "member list of cluster {:?} not read: {}",
                m.cluster,
                match failure {
                    Some(CallFailure::TooLarge) => format!("over {MAX_MEMBERS_BODY} bytes"),
                    Some(CallFailure::BadStatus) =>
                        format!("status {}", status.unwrap_or_default()),
                    _ => "no answer".to_string(),
                }
            );
            return;
        };
        let members = match members::parse_members(&body, &m.cluster) {
            Ok(members) => members,
            Err(e) => {
                bump(s.metrics.members_failed);
                warn!("member list of cluster {:?} not used: {e}", m.cluster);
                return;
            }
        };
        bump(s.metrics.members_ok);
        let change = s.follow_members(&members.addresses);
        for &i in &change.left {
            bump(s.metrics.nodes_left);
            let address = s.balancer.nodes().get(i).map(|n| n.address());
            info!(
                "node {} left cluster {:?}: no longer chosen",
                address.unwrap_or("?"),
                m.cluster
            );
        }
        let tick_ms = s.config.tick_ms;
        for &i in &change.joined {
            bump(s.metrics.nodes_joined);
            let address = s
                .balancer
                .nodes()
                .get(i)
                .map(|n| n.address().to_string())
                .unwrap_or_default();
            s.metrics.name_node(i, &address);
            if self.list_polls.len() <= i {
                self.list_polls
                    .resize(i + 1, ListPoll::new(tick_ms, s.config.models_poll_ms));
            } else if let Some(p) = self.list_polls.get_mut(i) {
                *p = ListPoll::new(tick_ms, s.config.models_poll_ms);
            }
            info!("node {address} joined cluster {:?} (slot {i})", m.cluster);
        }
        if change.over_limit > 0 {
            warn!(
                "cluster {:?} has more members than the {} followed: {} not followed",
                m.cluster,
                token_balancer_core::route::balancer::MAX_NODES,
                change.over_limit
            );
        }
        if members.unaddressable > 0 {
            debug!(
                "cluster {:?}: {} members without an ip:port address, not followed",
                m.cluster, members.unaddressable
            );
        }
        // Each VM sets the gauge to what it follows; they agree but for a poll's lag.
        let _ = hostcalls::record_metric(s.metrics.members_now, members.addresses.len() as u64);
    }

    /// Sends one health callout to every node of the slices now due (see `polling`) that has
    /// none outstanding. Returns the slices polled.
    fn poll(&mut self) -> Vec<usize> {
        let Ok(guard) = self.state.try_borrow() else {
            return Vec::new();
        };
        let Some(s) = guard.as_ref() else {
            return Vec::new();
        };
        // The fleet may grow or shrink (membership): the slices follow it.
        let due = self
            .schedule
            .due(s.balancer.nodes().len(), s.config.tick_ms, now_ms());
        let slices = self.schedule.slices();
        let period = self.schedule.period_ms();
        if !self.first_tick_done || period != self.period_ms {
            self.first_tick_done = true;
            self.period_ms = period;
            let _ = hostcalls::set_tick_period(Duration::from_millis(period));
        }
        let timeout = Duration::from_millis(s.config.health_timeout_ms);
        // A set, not a scan of the outstanding calls per node: with a thousand nodes slow to
        // answer, that scan alone is a million comparisons a tick.
        let outstanding: HashSet<usize> = self.pending.values().copied().collect();
        for (i, state) in s.balancer.nodes().iter().enumerate() {
            let Some(node) = s.balancer.node_config(i) else {
                continue;
            };
            // A node whose last poll is still outstanding is not polled again: slow nodes must
            // not pile up callouts. A node out of the cluster is not polled at all.
            if !state.member()
                || !due.iter().any(|&slice| polling::in_slice(i, slice, slices))
                || outstanding.contains(&i)
            {
                continue;
            }
            let target = node.health_target();
            match callout(&s.config, target, &node.health_path, timeout) {
                Ok(token) => {
                    self.pending.insert(token, i);
                }
                Err(e) => {
                    bump(s.metrics.health_failed);
                    warn!(
                        "health call to {target} via cluster {:?} could not start: {e:?}",
                        s.config.health_cluster
                    );
                }
            }
        }
        due
    }

    fn count_health(
        &self,
        s: &mut State,
        node: usize,
        result: Result<Report, HealthError>,
        failure: Option<CallFailure>,
        status: Option<&str>,
    ) {
        let address = s
            .balancer
            .nodes()
            .get(node)
            .map(|n| n.address().to_string())
            .unwrap_or_default();
        match result {
            Ok(_) => bump(s.metrics.health_ok),
            Err(e) => {
                bump(
                    s.metrics
                        .node_health_failures
                        .get(node)
                        .copied()
                        .unwrap_or(0),
                );
                match e {
                    HealthError::Unparsable(why) => {
                        bump(s.metrics.health_unparsable);
                        debug!("health answer from {address} not used: {why}");
                    }
                    HealthError::CallFailed | HealthError::UnknownNode => {
                        bump(s.metrics.health_failed);
                        match failure {
                            Some(CallFailure::NoAnswer) | None => {
                                bump(s.metrics.health_no_answer);
                                debug!("health call to {address}: no answer (refused, reset or timed out)");
                            }
                            Some(CallFailure::BadStatus) => {
                                bump(s.metrics.health_bad_status);
                                debug!(
                                    "health call to {address}: status {}",
                                    status.unwrap_or("?")
                                );
                            }
                            Some(CallFailure::TooLarge) => {
                                bump(s.metrics.health_too_large);
                                debug!("health answer from {address} over {MAX_HEALTH_BODY} bytes, not read");
                            }
                        }
                    }
                }
            }
        }
        match s.balancer.take_transition(node) {
            Some(Transition::Ejected) => {
                bump(s.metrics.nodes_ejected);
                warn!(
                    "node {address} taken out of the choice after {} failed health polls in a row",
                    s.config.unhealthy_after_failures
                );
            }
            Some(Transition::Readmitted) => {
                bump(s.metrics.nodes_readmitted);
                info!(
                    "node {address} back in the choice after {} good health polls in a row",
                    s.config.healthy_after_successes
                );
            }
            None => {}
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                // One line, naming the field: Envoy then refuses the plugin.
                error!("{e}");
                return false;
            }
        };
        let is_poller = hostcalls::get_property(vec!["plugin_root_id"])
            .ok()
            .flatten()
            .is_some_and(|id| id == share::POLLER_ROOT_ID.as_bytes());
        let role = match (is_poller, config.poller) {
            (true, Poller::Singleton) => Role::Service,
            (true, Poller::Vm) => {
                error!(
                    "invalid token-balancer configuration: `poller` must be \"singleton\" for the poller service (root_id {})",
                    share::POLLER_ROOT_ID
                );
                return false;
            }
            (false, Poller::Singleton) => Role::Reader,
            (false, Poller::Vm) => Role::Vm,
        };
        let now = now_ms();
        // The service's slots are the books' keys; a reader learns them from the snapshot.
        let keys = match role {
            Role::Service => config
                .nodes
                .iter()
                .enumerate()
                .map(|(i, n)| Some(BookKey::new(i, tenant_of(&n.address))))
                .collect(),
            _ => Vec::new(),
        };
        let sharing = Sharing {
            keys,
            epoch_base: now,
            ..Sharing::default()
        };
        // Each worker's VM gets its own sequence: time and this context's address differ.
        let seed = now ^ ((self as *const Root as u64) << 20);
        let mut state = State {
            role,
            sharing,
            balancer: Balancer::new(&config),
            rng: SplitMix64::new(seed),
            metrics: Metrics::define(&config),
            held: HoldQueue::new(config.max_held_requests, config.max_hold_ms),
            config: Rc::new(config),
        };
        match role {
            Role::Reader => info!(
                "token-balancer configured: {} nodes, read from the poller service's snapshot",
                state.config.nodes.len()
            ),
            _ => info!(
                "token-balancer {}configured: {} nodes, health via cluster {:?} every {} ms",
                if role == Role::Service {
                    "poller service "
                } else {
                    ""
                },
                state.config.nodes.len(),
                state.config.health_cluster,
                state.config.tick_ms
            ),
        }
        if role == Role::Service {
            // The books exist before any worker routes: workers never create them.
            for book in state.sharing.keys.iter().flatten() {
                if share::ensure_books(&mut HostStore, &book.key, book.tenant).is_err() {
                    bump(state.metrics.shared_failed);
                }
            }
            state.publish(now);
        }
        self.list_polls = state
            .config
            .nodes
            .iter()
            .map(|_| ListPoll::new(state.config.tick_ms, state.config.models_poll_ms))
            .collect();
        if let Ok(mut guard) = self.state.try_borrow_mut() {
            // Requests held by a previous configuration go on unrouted (Envoy's fallback)
            // rather than wait for a balancer that no longer exists.
            if let Some(mut old) = guard.take() {
                for held in old.held.drain() {
                    shift(old.metrics.held_now, -1);
                    if hostcalls::set_effective_context(held.id).is_ok() {
                        let _ = hostcalls::resume_http_request();
                    }
                }
                let _ = hostcalls::set_effective_context(self.context_id);
            }
            *guard = Some(state);
        }
        self.pending.clear();
        self.pending_models.clear();
        self.pending_members = None;
        self.members_due_ms = 0;
        self.first_tick_done = false;
        self.schedule = Schedule::default();
        let _ = hostcalls::set_tick_period(FIRST_POLL);
        true
    }

    fn on_tick(&mut self) {
        let role = self.role();
        if role == Some(Role::Reader) {
            self.read_fleet();
        } else {
            self.poll_members();
            let due = self.poll();
            self.poll_models(&due);
        }
        self.report_memory();
        // The service publishes once a round, when the last slice has been polled: the workers
        // then decode a new snapshot once a tick, however many slices there are.
        if role == Some(Role::Service) && self.schedule.round_polled() {
            if let Ok(mut guard) = self.state.try_borrow_mut() {
                if let Some(s) = guard.as_mut() {
                    s.publish(now_ms());
                    s.report_books();
                }
            }
        }
        // Held requests past their limit leave on the tick, whatever else happens.
        admit_held(&self.state, self.context_id);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            context_id,
            placement: None,
            state: self.state.clone(),
            api: Api::Other,
            ticket: None,
            debug: None,
            decided: false,
            received: 0,
            meter: OutputMeter::new(),
            shared_received: 0,
            status_ok: false,
            completed: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    context_id: u32,
    /// Set while the request is held, until its placement is adopted.
    placement: Option<Placement>,
    state: Shared,
    api: Api,
    ticket: Option<Ticket>,
    /// Value of the debug response header, when that header is configured.
    debug: Option<String>,
    /// The routing decision is made (or given up); later body chunks pass straight through.
    decided: bool,
    /// Output observed in the response so far (`meter.progress()` when last read), and what
    /// the response has shown of its output.
    received: u64,
    meter: OutputMeter,
    /// Output count last written to the shared books (reader role).
    shared_received: u64,
    /// The response was a 200 and its body reached its end: a complete sample of output length.
    status_ok: bool,
    completed: bool,
}

impl Request {
    /// The configuration; `None` when the plugin has none.
    fn config(&self) -> Option<Rc<Config>> {
        let guard = self.state.try_borrow().ok()?;
        guard.as_ref().map(|s| s.config.clone())
    }

    /// Runs `f` on the shared state; `None` when the plugin has no configuration.
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> Option<R> {
        let mut guard = self.state.try_borrow_mut().ok()?;
        guard.as_mut().map(f)
    }

    fn fallback(&mut self, why: &str, metric: impl Fn(&Metrics) -> u32) -> Action {
        self.decided = true;
        let debug_on = self
            .with(|s| {
                bump(metric(&s.metrics));
                s.config.debug_header.is_some()
            })
            .unwrap_or(false);
        if debug_on {
            self.debug = Some(format!("fallback={why}"));
        }
        Action::Continue
    }

    fn route(&mut self, weight: Weight, model: Option<String>) -> Action {
        let now = now_ms();
        // A reader decides on the poller's fleet and every worker's books, or not at all.
        let (usable, new_reports) = self
            .with(|s| {
                if s.role != Role::Reader {
                    return (true, false);
                }
                s.sync_fleet(now)
            })
            .unwrap_or((true, false));
        if new_reports {
            admit_held(&self.state, self.context_id);
        }
        if !usable {
            return self.fallback("no_fleet", |m| m.fallback_no_fleet);
        }
        self.decided = true;
        let id = self.context_id;
        let step = self.with(|s| {
            let may_hold = s.held.may_hold();
            let m = model.as_deref();
            let mut books = SharedBooks::of(&s.sharing, s.role, &s.metrics);
            let outcome = s
                .balancer
                .route(weight, m, now, &mut s.rng, may_hold, &mut books);
            let reads = books.reads;
            match outcome {
                Outcome::Saturated => {
                    let placement: Placement = Rc::new(RefCell::new(None));
                    // The queue keeps its own copy of the model: held requests are few.
                    match s
                        .held
                        .push(id, weight, model.clone(), now, placement.clone())
                    {
                        Ok(()) => {
                            bump(s.metrics.held);
                            shift(s.metrics.held_now, 1);
                            Err(placement)
                        }
                        // `may_hold` said there was room; route over the ceiling if not.
                        Err(_) => {
                            let mut books = SharedBooks::of(&s.sharing, s.role, &s.metrics);
                            let outcome = s
                                .balancer
                                .route(weight, m, now, &mut s.rng, false, &mut books);
                            let reads = books.reads;
                            Ok(place(s, outcome, weight, m, None, reads))
                        }
                    }
                }
                outcome => Ok(place(s, outcome, weight, m, None, reads)),
            }
        });
        match step {
            Some(Ok(placed)) => {
                self.ticket = placed.ticket;
                self.debug = placed.debug;
                if placed.answered {
                    // The local reply is on its way; the request goes no further.
                    Action::Pause
                } else {
                    Action::Continue
                }
            }
            Some(Err(placement)) => {
                // Held: whoever admits it sets the header and resumes the request.
                self.placement = Some(placement);
                Action::Pause
            }
            None => Action::Continue,
        }
    }

    /// Takes over the placement of a request that was held, once it has been admitted.
    fn adopt(&mut self) {
        let Some(placement) = &self.placement else {
            return;
        };
        let placed = placement.try_borrow_mut().ok().and_then(|mut p| p.take());
        if let Some(placed) = placed {
            self.ticket = placed.ticket;
            self.debug = placed.debug;
            self.placement = None;
        }
    }

    /// The stream ends: a request still held leaves the queue (nothing was booked for it).
    fn leave_queue(&mut self) {
        self.adopt();
        if self.placement.take().is_some() {
            let id = self.context_id;
            self.with(|s| {
                if s.held.remove(id).is_some() {
                    shift(s.metrics.held_now, -1);
                }
            });
        }
    }

    fn release(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let sample = self.meter.finish(self.status_ok, self.completed);
            // The books are released by the count they were advanced by, so they balance
            // exactly; the sample is the meter's (the server's own count when it gave one).
            let progressed = self.received;
            let written = self.shared_received;
            self.with(|s| {
                if let Some(output) = sample {
                    s.balancer
                        .observe_output(ticket.weight.prompt_tokens, output);
                }
                s.balancer.release(&ticket, progressed);
                s.share(&ticket, Change::release(&ticket, written), None);
                shift(s.metrics.inflight_now, -1);
            });
        }
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config() else {
            return Action::Continue;
        };
        let routing_header = config.routing_header.as_str();
        // Clients never pick their node: whatever they sent is dropped before anything else.
        if let Ok(Some(_)) = hostcalls::get_map_value(MapType::HttpRequestHeaders, routing_header) {
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, routing_header);
            self.with(|s| bump(s.metrics.client_routing_header_removed));
        }
        if let Some(h) = &config.debug_header {
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, h);
        }
        if end_of_stream {
            return self.fallback("no_body", |m| m.fallback_no_body);
        }
        // A compressed body cannot be read without inflating it; leave it to the fallback.
        if let Ok(Some(enc)) =
            hostcalls::get_map_value(MapType::HttpRequestHeaders, "content-encoding")
        {
            if !enc.eq_ignore_ascii_case("identity") {
                return self.fallback("encoded_body", |m| m.fallback_encoded_body);
            }
        }
        // A body announced over the limit streams on untouched from the start. Waiting for the
        // body callbacks to see it pass the limit is not enough: a body that arrives faster
        // than the worker reads can land in one large read, buffered on top of what the pause
        // already holds, and past the listener's buffer limit Envoy answers 413 and resets the
        // client (seen in CI with a 10 MiB body).
        if let Ok(Some(length)) =
            hostcalls::get_map_value(MapType::HttpRequestHeaders, "content-length")
        {
            if length
                .trim()
                .parse::<u64>()
                .is_ok_and(|n| n > config.max_body_bytes as u64)
            {
                return self.fallback("body_over_limit", |m| m.fallback_body_over_limit);
            }
        }
        // Header lookups one by one: inside Envoy an absent header costs 0.3 us and a present
        // one 1.4 us, while the whole map in one call costs 2 us with a handful of headers
        // and grows with every header a client sends.
        let path = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path")
            .ok()
            .flatten()
            .unwrap_or_default();
        self.api = Api::from_path(&path);
        // Needs `allow_on_headers_stop_iteration: true` in the Wasm filter config, or Envoy
        // stops all iteration and the body never comes (see README).
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        let Some((limit, default_max_tokens)) =
            self.with(|s| (s.config.max_body_bytes, s.config.default_max_tokens))
        else {
            return Action::Continue;
        };
        if body_size > limit {
            // Not buffered past the limit: the body streams on untouched.
            return self.fallback("body_over_limit", |m| m.fallback_body_over_limit);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        match request::read(self.api, &body, default_max_tokens) {
            Some(e) => self.route(e.weight, e.model),
            None => self.fallback("body_unusable", |m| m.fallback_body_unusable),
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.adopt();
        self.status_ok = matches!(
            hostcalls::get_map_value(MapType::HttpResponseHeaders, ":status"),
            Ok(Some(s)) if s == "200"
        );
        if let Some(value) = &self.debug {
            if let Some(name) = self.config().and_then(|c| c.debug_header.clone()) {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, &name, Some(value));
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Only requests this filter routed feed the books; the chunk is read, never held.
        if let Some(ticket) = self.ticket {
            if self.status_ok && body_size > 0 {
                if let Ok(Some(chunk)) =
                    hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
                {
                    let before = self.received;
                    self.meter.feed(&chunk);
                    self.received = self.meter.progress();
                    if self.received > before {
                        let (received, written) = (self.received, self.shared_received);
                        let wrote = self
                            .with(|s| {
                                s.balancer.progress(&ticket, before, received);
                                let due = received.saturating_sub(written) >= SHARED_PROGRESS_STEP
                                    || (received >= ticket.reserved_output
                                        && written < ticket.reserved_output);
                                if due && s.role == Role::Reader {
                                    s.share(
                                        &ticket,
                                        Change::progress(&ticket, written, received),
                                        None,
                                    );
                                }
                                due
                            })
                            .unwrap_or(false);
                        if wrote {
                            self.shared_received = received;
                        }
                    }
                }
            }
            self.completed |= end_of_stream;
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.leave_queue();
        self.release();
        // The room this stream held may let a held request go.
        admit_held(&self.state, self.context_id);
    }
}

impl Drop for Request {
    /// Belt and braces: a context destroyed without `on_log` still releases its booking.
    fn drop(&mut self) {
        self.leave_queue();
        self.release();
    }
}
