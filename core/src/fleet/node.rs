//! Node state: what the filter knows about one GPU node between two health reports.
//!
//! Two sources are combined. The node's last good report is the ground truth at the moment it
//! was taken; it is trusted until it is older than the staleness limit, and a failed poll never
//! overwrites it. The filter's own in-flight accounting covers the gap between reports: every
//! request sent to the node is added at dispatch and removed when its stream ends, whatever the
//! outcome. Work dispatched *after* the last report is not in that report yet, so it is kept
//! apart ("unreflected") and added to the reported load by the choice; this is what stops the
//! herding that other routers suffer, where every request between two scrapes lands on the node
//! that looked idlest at the last scrape.
//!
//! The books also carry each in-flight request's expected output still to come ("growth"):
//! a report's KV use is what the running sequences hold now, and they keep growing by one KV
//! slot per generated token until they finish. Engines admit on the KV in use, so a balancer
//! that only compares the present use with a ceiling fills a node until its running sequences
//! outgrow the cache and the engine preempts (the VRAM overflow). Counting the growth still to
//! come is what makes the ceiling predictive.
//!
//! Health has hysteresis, as Envoy's own active health checking does (unhealthy_threshold,
//! healthy_threshold): a node is taken out of the choice after a number of failed polls in a
//! row, well before its last report goes stale, and comes back only after a number of good
//! polls in a row, so a flapping node does not swing traffic back and forth on every answer.
//!
//! The node also carries the models it serves (`models`), which the choice uses to keep a
//! request off nodes that would answer it 404 `model_not_found`.

use crate::fleet::models::ServedModels;
use crate::ingest::engine::HealthFormat;
use crate::ingest::rates::Tracker;
use crate::ingest::request::Weight;
use crate::ingest::telemetry::Report;

/// A node's identity where slots are reused for other addresses (the balancer's node slots,
/// the shared books' keys): FNV-1a, 64 bits, of the address. Two addresses of one fleet
/// colliding is a 1 in 2^64 event per pair; a collision would only let one node's stale release
/// reach the other's books.
pub fn tenant_of(address: &str) -> u64 {
    address.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Proof of one dispatch, handed back at release so the books balance exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub node: usize,
    /// Who held the node's slot at dispatch (`tenant_of` its address): a slot reused for
    /// another address (membership churn) must not take the old one's release.
    pub tenant: u64,
    /// The node's report epoch at dispatch: if no report has arrived since, the request's work
    /// is still counted as unreflected and must be taken out of that sum too.
    pub epoch: u64,
    /// Expected cost: prompt tokens and the output expected (not the cap).
    pub weight: Weight,
    /// Output tokens booked as KV growth: a high estimate, since a request longer than
    /// expected is what overflows a cache packed to the mean.
    pub reserved_output: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NodeState {
    pub address: String,
    /// `tenant_of(address)`, kept so a ticket can be matched to the node that issued it.
    pub tenant: u64,
    /// Configured capacity, which wins over a reported one.
    pub capacity_override: Option<f64>,
    /// Configured KV-cache size in tokens.
    pub kv_cache_tokens: Option<u64>,
    /// What the node's health endpoint serves.
    pub format: HealthFormat,
    /// Counter memory between scrapes, for engines that publish counters instead of a load.
    pub tracker: Tracker,
    /// What is known of the models the node serves.
    pub models: ServedModels,
    report: Option<(Report, u64)>,
    epoch: u64,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    /// Tokens (prompt + output) dispatched since the last report.
    pub unreflected_tokens: u64,
    /// Requests dispatched since the last report.
    pub unreflected_requests: u64,
    /// Prompt tokens dispatched since the last report (KV the report does not show yet).
    pub unreflected_prompt_tokens: u64,
    /// Output tokens the in-flight requests are still expected to generate (KV still to come).
    pub growth_tokens: u64,
    /// Health polls failed in a row (reset by a good one).
    pub failures_in_row: u32,
    /// Good polls in a row (reset by a failed one).
    pub successes_in_row: u32,
    /// Taken out of the choice by failed polls, until enough good ones bring it back.
    pub ejected: bool,
    unhealthy_after: u32,
    healthy_after: u32,
    /// The last change of health not yet taken by the glue (for its stats and log).
    transition: Option<Transition>,
    /// A member of the Envoy cluster (see `membership`): a node that is not is never chosen,
    /// since override_host would ignore it.
    pub member: bool,
}

/// A change of a node's health, for the stats and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Ejected,
    Readmitted,
}

impl NodeState {
    pub fn new(
        address: &str,
        capacity_override: Option<f64>,
        kv_cache_tokens: Option<u64>,
    ) -> Self {
        NodeState {
            address: address.to_string(),
            tenant: tenant_of(address),
            capacity_override,
            kv_cache_tokens,
            format: HealthFormat::Auto,
            tracker: Tracker::default(),
            models: ServedModels::default(),
            report: None,
            epoch: 0,
            inflight_requests: 0,
            inflight_tokens: 0,
            unreflected_tokens: 0,
            unreflected_requests: 0,
            unreflected_prompt_tokens: 0,
            growth_tokens: 0,
            failures_in_row: 0,
            successes_in_row: 0,
            ejected: false,
            unhealthy_after: 2,
            healthy_after: 2,
            transition: None,
            member: true,
        }
    }

    /// Sets the hysteresis: ejected after `unhealthy_after` failed polls in a row, readmitted
    /// after `healthy_after` good ones (each at least 1).
    pub fn with_hysteresis(mut self, unhealthy_after: u32, healthy_after: u32) -> Self {
        self.unhealthy_after = unhealthy_after.max(1);
        self.healthy_after = healthy_after.max(1);
        self
    }

    /// A good report replaces the previous one; work dispatched so far is now in it. An
    /// ejected node keeps its report fresh but stays out until enough good polls in a row.
    pub fn accept_report(&mut self, report: Report, now_ms: u64) -> Option<Transition> {
        self.report = Some((report, now_ms));
        self.epoch += 1;
        self.unreflected_tokens = 0;
        self.unreflected_requests = 0;
        self.unreflected_prompt_tokens = 0;
        self.failures_in_row = 0;
        self.successes_in_row = self.successes_in_row.saturating_add(1);
        if self.ejected && self.successes_in_row >= self.healthy_after {
            self.ejected = false;
            self.transition = Some(Transition::Readmitted);
            return self.transition;
        }
        None
    }

    /// A failed or unparsable poll: the last good report stays, but enough failures in a row
    /// take the node out of the choice before that report goes stale.
    pub fn note_failure(&mut self) -> Option<Transition> {
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        self.successes_in_row = 0;
        if !self.ejected && self.failures_in_row >= self.unhealthy_after {
            self.ejected = true;
            self.transition = Some(Transition::Ejected);
            return self.transition;
        }
        None
    }

    /// The last change of health since this was last asked.
    pub fn take_transition(&mut self) -> Option<Transition> {
        self.transition.take()
    }

    /// The last report, if it is younger than `stale_after_ms` and the node is neither ejected
    /// nor out of the cluster.
    pub fn fresh_report(&self, now_ms: u64, stale_after_ms: u64) -> Option<&Report> {
        if self.ejected || !self.member {
            return None;
        }
        match &self.report {
            Some((r, at)) if now_ms.saturating_sub(*at) <= stale_after_ms => Some(r),
            _ => None,
        }
    }

    /// Drops the last report and the counter baseline: the node has left the cluster, and
    /// if it comes back (perhaps restarted) only a new report is to be trusted.
    pub fn forget_report(&mut self) {
        self.report = None;
        self.tracker = Tracker::default();
        self.epoch += 1;
        self.unreflected_tokens = 0;
        self.unreflected_requests = 0;
        self.unreflected_prompt_tokens = 0;
    }

    /// When the last good report arrived.
    pub fn reported_at(&self) -> Option<u64> {
        self.report.as_ref().map(|(_, at)| *at)
    }

    /// The report epoch: grows with every report taken (and when the report is forgotten).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The last good report and when it was taken.
    pub fn report_taken(&self) -> Option<(Report, u64)> {
        self.report
    }

    /// Takes a report and its epoch from elsewhere (the fleet snapshot another VM publishes,
    /// see `shared`): the node's state as the poller has it, without the polling.
    pub fn adopt_report(&mut self, report: Option<(Report, u64)>, epoch: u64) {
        self.report = report;
        self.epoch = epoch;
    }

    /// Books a request whose KV growth is reserved at its expected output.
    pub fn dispatch(&mut self, node: usize, weight: Weight) -> Ticket {
        self.dispatch_reserving(node, weight, weight.output_tokens)
    }

    /// Books a request, reserving `reserved_output` tokens of KV growth for it.
    pub fn dispatch_reserving(
        &mut self,
        node: usize,
        weight: Weight,
        reserved_output: u64,
    ) -> Ticket {
        let t = weight.total();
        self.inflight_requests += 1;
        self.inflight_tokens = self.inflight_tokens.saturating_add(t);
        self.unreflected_requests += 1;
        self.unreflected_tokens = self.unreflected_tokens.saturating_add(t);
        self.unreflected_prompt_tokens = self
            .unreflected_prompt_tokens
            .saturating_add(weight.prompt_tokens);
        self.growth_tokens = self.growth_tokens.saturating_add(reserved_output);
        Ticket {
            node,
            tenant: self.tenant,
            epoch: self.epoch,
            weight,
            reserved_output,
        }
    }

    /// The request's stream has delivered `before` output tokens so far and now `after`:
    /// that much of its expected growth has happened (and is in the node's KV use).
    pub fn progress(&mut self, ticket: &Ticket, before: u64, after: u64) {
        let reserved = ticket.reserved_output;
        let done = after.min(reserved).saturating_sub(before.min(reserved));
        self.growth_tokens = self.growth_tokens.saturating_sub(done);
    }

    /// The request's stream ended; `received` is the output count `progress` was last given.
    pub fn release(&mut self, ticket: &Ticket, received: u64) {
        let t = ticket.weight.total();
        self.inflight_requests = self.inflight_requests.saturating_sub(1);
        self.inflight_tokens = self.inflight_tokens.saturating_sub(t);
        let remaining = ticket.reserved_output.saturating_sub(received);
        self.growth_tokens = self.growth_tokens.saturating_sub(remaining);
        if ticket.epoch == self.epoch {
            self.unreflected_requests = self.unreflected_requests.saturating_sub(1);
            self.unreflected_tokens = self.unreflected_tokens.saturating_sub(t);
            self.unreflected_prompt_tokens = self
                .unreflected_prompt_tokens
                .saturating_sub(ticket.weight.prompt_tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(p: u64, o: u64) -> Weight {
        Weight {
            prompt_tokens: p,
            output_tokens: o,
        }
    }

    fn report(load: f64) -> Report {
        Report {
            load_tokens_per_sec: load,
            ..Report::default()
        }
    }

    /// (polls, expected ejected after each) for a node ejected after 2 failures and readmitted
    /// after 3 successes.
    #[test]
    fn hysteresis_table() {
        let cases: &[(&str, &[bool])] = &[
            // one failure is not enough; two in a row are
            ("ok x ok x x", &[false, false, false, false, true]),
            // back only after three good polls in a row; a failure restarts the count
            (
                "x x ok ok x ok ok ok",
                &[false, true, true, true, true, true, true, false],
            ),
            // a flapping node stays out once it is out
            (
                "x x ok x ok x ok",
                &[false, true, true, true, true, true, true],
            ),
        ];
        for (polls, expected) in cases {
            let mut n = NodeState::new("a", None, None).with_hysteresis(2, 3);
            n.accept_report(report(1.0), 0);
            let mut t = 0;
            for (poll, want) in polls.split(' ').zip(expected.iter()) {
                t += 100;
                let transition = if poll == "ok" {
                    n.accept_report(report(1.0), t)
                } else {
                    n.note_failure()
                };
                assert_eq!(n.ejected, *want, "{polls}: after {t} ms");
                assert_eq!(n.fresh_report(t, 1_000).is_none(), *want, "{polls}");
                if let Some(tr) = transition {
                    assert_eq!(tr == Transition::Ejected, *want, "{polls}");
                }
            }
        }
    }

    #[test]
    fn freshness_follows_the_staleness_limit() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        assert!(n.fresh_report(0, 1000).is_none());
        n.accept_report(report(5.0), 100);
        for (now, fresh) in [(100, true), (1100, true), (1101, false), (50, true)] {
            assert_eq!(n.fresh_report(now, 1000).is_some(), fresh, "now={now}");
        }
        // One failed poll leaves the last report in use (below the ejection threshold).
        n.note_failure();
        assert_eq!(n.failures_in_row, 1);
        assert_eq!(
            n.fresh_report(200, 1000).map(|r| r.load_tokens_per_sec),
            Some(5.0)
        );
        n.accept_report(report(6.0), 300);
        assert_eq!(n.failures_in_row, 0);
        assert_eq!(n.reported_at(), Some(300));
    }

    #[test]
    fn inflight_books_balance_across_reports() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let a = n.dispatch(0, w(100, 10));
        let b = n.dispatch(0, w(5, 5));
        assert_eq!((n.inflight_requests, n.inflight_tokens), (2, 120));
        assert_eq!((n.unreflected_requests, n.unreflected_tokens), (2, 120));
        // A report now covers a and b.
        n.accept_report(report(1.0), 10);
        assert_eq!((n.unreflected_requests, n.unreflected_tokens), (0, 0));
        let c = n.dispatch(0, w(1, 1));
        n.progress(&a, 0, 10);
        n.release(&a, 10);
        assert_eq!(n.unreflected_tokens, 2, "a was reflected already");
        assert_eq!(n.unreflected_prompt_tokens, 1);
        n.release(&c, 0);
        assert_eq!(n.unreflected_tokens, 0);
        n.progress(&b, 0, 2);
        n.release(&b, 2);
        assert_eq!(
            (n.inflight_requests, n.inflight_tokens, n.growth_tokens),
            (0, 0, 0)
        );
        // Releasing twice never underflows.
        n.release(&b, 5);
        assert_eq!((n.inflight_requests, n.inflight_tokens), (0, 0));
    }

    #[test]
    fn growth_follows_the_reservation_not_the_expectation() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let t = n.dispatch_reserving(0, w(10, 100), 250);
        assert_eq!(n.growth_tokens, 250);
        n.progress(&t, 0, 120);
        assert_eq!(n.growth_tokens, 130);
        n.release(&t, 120);
        assert_eq!((n.growth_tokens, n.inflight_tokens), (0, 0));
    }

    #[test]
    fn growth_is_the_expected_output_still_to_come() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let a = n.dispatch(0, w(100, 50));
        let b = n.dispatch(0, w(100, 20));
        assert_eq!(n.growth_tokens, 70);
        n.progress(&a, 0, 30);
        assert_eq!(n.growth_tokens, 40);
        // Output past the expectation grows nothing the books hold.
        n.progress(&b, 0, 25);
        assert_eq!(n.growth_tokens, 20);
        n.release(&b, 25);
        assert_eq!(n.growth_tokens, 20);
        // A stream that ends early (aborted) returns what it never generated.
        n.release(&a, 30);
        assert_eq!(n.growth_tokens, 0);
    }
}
