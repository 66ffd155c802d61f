//! The root context, one per VM (one per Envoy worker, one on the main thread): it reads the
//! plugin configuration into the VM's `State`, runs the tick, and takes the callouts'
//! answers.
//!
//! - Configure: the configuration is parsed (a bad one is refused in one log line naming the
//!   field, and Envoy then refuses the plugin), the role chosen from it and the `root_id`
//!   (`roles`), the stats defined, and requests held by a previous configuration let go
//!   unrouted rather than wait for a balancer that no longer exists.
//! - Tick: a polling role sends the polls now due (`polls`); the service then publishes the
//!   fleet once a round; a reader looks at the snapshot and writes the book changes kept for
//!   later. Every tick moves the VM-memory gauge and lets out held requests that have room or
//!   have waited long enough.
//! - Callout answers go to `answers`; a fresh report may admit held requests.

use crate::host::Host;
use crate::metrics::Stat;
use crate::request::Request;
use crate::roles::Role;
use crate::state::{admit_held, Replies, Shared, State};
use log::error;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::time::Duration;
use token_balancer_core::config::Config;
use token_balancer_core::share::POLLER_ROOT_ID;

/// Delay before the first poll, so a freshly started Envoy has data within a fraction of a
/// second instead of a whole tick.
const FIRST_POLL: Duration = Duration::from_millis(50);

pub struct Root<H: Host> {
    context_id: u32,
    host: H,
    state: Shared<H>,
    /// The timer period last set after the first tick (`None`: still `FIRST_POLL`).
    timer_ms: Option<u64>,
    /// What this VM last added to the memory gauge.
    memory_reported: u64,
    /// What this VM last added to the prefix index gauges (blocks, bytes).
    prefix_reported: (u64, u64),
}

impl<H: Host> Root<H> {
    pub fn new(context_id: u32, host: H) -> Root<H> {
        Root {
            context_id,
            host,
            state: Shared::default(),
            timer_ms: None,
            memory_reported: 0,
            prefix_reported: (0, 0),
        }
    }

    /// The context of a new request.
    pub fn request(&self, context_id: u32) -> Request<H> {
        Request::new(context_id, self.host.clone(), self.state.clone())
    }

    /// The VM's state, for the tests.
    #[cfg(test)]
    pub fn state(&self) -> &Shared<H> {
        &self.state
    }
}

/// Moves the `vm_memory_bytes` gauge by this VM's growth since its last report
/// (`reported`), so the gauge is the total over every VM of the plugin (one per worker, one
/// on the main thread).
fn report_memory<H: Host>(reported: &mut u64, s: &State<H>) {
    let now = vm_memory_bytes();
    if now != *reported {
        s.metrics
            .shift(Stat::VmMemoryBytes, now as i64 - *reported as i64);
        *reported = now;
    }
}

/// Moves the `prefix.blocks` and `prefix.bytes` gauges by this VM's prefix index's change
/// since its last report (`reported`), so each is the total over every VM.
fn report_prefixes<H: Host>(reported: &mut (u64, u64), s: &State<H>) {
    let now = s
        .balancer
        .prefixes()
        .map_or((0, 0), |ix| (ix.len() as u64, ix.bytes() as u64));
    for (stat, was, is) in [
        (Stat::PrefixBlocks, reported.0, now.0),
        (Stat::PrefixBytes, reported.1, now.1),
    ] {
        if was != is {
            s.metrics.shift(stat, is as i64 - was as i64);
        }
    }
    *reported = now;
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

impl<H: Host> State<H> {
    /// One tick of this VM's role at `now_ms`; returns the timer period it wants.
    fn tick(&mut self, now_ms: u64) -> u64 {
        if let Role::Reader(_) = self.role {
            // No polls to hurry: the configured tick from the first on.
            self.sync_fleet(now_ms);
            self.flush_books();
            // Placements gathered in the last moments of a burst go out.
            self.publish_placements(now_ms);
            return self.config.tick_ms;
        }
        self.poll_members(now_ms);
        let (due, period) = self.poll_health(now_ms);
        self.poll_models(&due, now_ms);
        // The service publishes once a round, when the last slice has been polled: the
        // workers then decode a new snapshot once a tick, however many slices there are.
        let round_polled = self.role.polls().is_some_and(|p| p.schedule.round_polled());
        if matches!(self.role, Role::Service(..)) && round_polled {
            self.publish(now_ms);
            let tick_ms = self.config.tick_ms;
            if self
                .role
                .polls()
                .is_some_and(|p| p.books_report_due(now_ms, tick_ms))
            {
                self.report_books();
            }
        }
        period
    }
}

impl<H: Host> Context for Root<H> {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let fresh = {
            let Ok(mut guard) = self.state.try_borrow_mut() else {
                return;
            };
            let Some(s) = guard.as_mut() else { return };
            s.on_answer(token, body_size)
        };
        if fresh {
            // A fresh report may show room for held requests.
            admit_held(&self.state, self.context_id, Replies::Now);
        }
    }
}

impl<H: Host> RootContext for Root<H> {
    fn on_configure(&mut self, _size: usize) -> bool {
        self.host.follow_log_level();
        let config = match Config::parse(&self.host.plugin_configuration()) {
            Ok(c) => c,
            Err(e) => {
                // One line, naming the field: Envoy then refuses the plugin.
                error!("{e}");
                return false;
            }
        };
        let is_poller = self
            .host
            .root_id()
            .is_some_and(|id| id == POLLER_ROOT_ID.as_bytes());
        let now = self.host.now_ms();
        let Some(role) = Role::new(&config, is_poller, now) else {
            error!(
                "invalid token-balancer configuration: `poller` must be \"singleton\" for the poller service (root_id {POLLER_ROOT_ID})"
            );
            return false;
        };
        // Each worker's VM gets its own sequence: time and this context's address differ.
        let seed = now ^ ((self as *const Self as u64) << 20);
        let mut state = State::new(self.host.clone(), config, role, seed);
        state.log_configured();
        state.start(now);
        if let Ok(mut guard) = self.state.try_borrow_mut() {
            // Requests held by a previous configuration go on unrouted (Envoy's fallback)
            // rather than wait for a balancer that no longer exists.
            if let Some(mut old) = guard.take() {
                for held in old.held.drain() {
                    old.metrics.shift(Stat::HeldNow, -1);
                    old.metrics.bump(Stat::HeldReconfigured);
                    if self.host.set_effective_context(held.id).is_ok() {
                        self.host.resume_request();
                    }
                }
                // Those waiting to be answered go on too (they already left the queue).
                for (held, _) in old.unanswered.drain(..) {
                    old.metrics.bump(Stat::HeldReconfigured);
                    if self.host.set_effective_context(held.id).is_ok() {
                        self.host.resume_request();
                    }
                }
                let _ = self.host.set_effective_context(self.context_id);
            }
            *guard = Some(state);
        }
        self.timer_ms = None;
        self.host.set_tick_period(FIRST_POLL);
        true
    }

    fn on_tick(&mut self) {
        let period = {
            let Ok(mut guard) = self.state.try_borrow_mut() else {
                return;
            };
            let Some(s) = guard.as_mut() else { return };
            let period = s.tick(s.host.now_ms());
            report_memory(&mut self.memory_reported, s);
            report_prefixes(&mut self.prefix_reported, s);
            period
        };
        if self.timer_ms != Some(period) {
            self.timer_ms = Some(period);
            self.host.set_tick_period(Duration::from_millis(period));
        }
        // Held requests past their limit leave on the tick, whatever else happens.
        admit_held(&self.state, self.context_id, Replies::Now);
    }

    /// A stream's callback let held requests go that the filter answers (see
    /// `state::Replies`): they are answered now.
    fn on_queue_ready(&mut self, _queue_id: u32) {
        admit_held(&self.state, self.context_id, Replies::Now);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(self.request(context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
