//! Admission: who waits at the gateway, who goes first, and who is told to come back.
//!
//! Holding. A request is held while every node is predicted over its VRAM ceiling, and bound
//! to a node only when one has room (late binding). Without this, a request that no node can
//! take still has to go somewhere: it lands in the least-full node's own queue, the engine
//! admits it as soon as the prompt fits, and when the running sequences then grow past the
//! cache the engine preempts one (a VRAM-overflow event, and the recompute costs the whole
//! batch). Holding the request in the filter keeps the choice open until a stream ends or a
//! fresh report shows room, and then gives it to the node that has room at that moment. This
//! is the late-binding argument of Llumnix (OSDI '24) and of the Kubernetes inference
//! gateway's flow control, applied inside one Envoy worker.
//!
//! Order. Held requests leave by priority first (`ingest::claim`: higher first), and within a
//! priority by token-weighted fair queuing among tenants: the tenant that has been served the
//! fewest tokens goes next, and its oldest request first. This is the virtual token counter of
//! VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24): every request
//! routed (held or not) adds its expected prompt and output tokens to its tenant's counter, and
//! a tenant that starts waiting is lifted to the smallest counter among the tenants waiting
//! (or, when none is, to the counter of the tenant served last), so idle time banks no credit.
//! A tenant sending long prompts in a burst then pays for each of them in its counter, and a
//! tenant sending short chat between them goes ahead of the burst's remainder. The request
//! chosen next is the only one tried: when it does not fit, nothing behind it overtakes it
//! (a large prompt is not starved by smaller ones), and the next event tries again.
//!
//! Budgets. A request with a time-to-first-token budget that no node would start in time, or
//! a time-per-output-token budget that every node compared is seen decoding slower than, is
//! answered at once (`Outcome::TooLate`, see `Balancer::route_on`) rather than held until it
//! times out; a held request whose first-token budget runs out while it waits leaves the same
//! way, on the next event that tries the queue. A request below priority 0 is shed rather than held: the
//! glue answers it at once when the fleet is saturated. Either way `wait_ms` says when to come
//! back: the held work at its priority or above, drained at the fleet's capacity.
//!
//! Limits. The queue is bounded in requests and in body bytes (what Envoy buffers for a
//! paused request); a request that finds it full sheds held requests of a lower priority to
//! make room (the glue answers them as shed), or, when there are none, is not held. A
//! request held for `max_hold_ms` is routed anyway, to the node that overflows least; with
//! `admission.when_full: reject` it is answered instead (`Outcome::Full`) when no node has
//! room for it yet, as is one that finds the queue full, so that no request is sent where a
//! cache would overflow (Dynamo's router answers a full queue the same way). A request that
//! no node would hold even with an empty cache is not held (`Outcome::Oversized`): no stream
//! ending makes room for it, so it goes at once, or is answered at once with `reject`; a held
//! one that the fleet can no longer hold (the nodes large enough fell silent) leaves the same
//! way. A stream that ends while held leaves (`remove`), and a reconfiguration lets every held
//! request go (`drain`). The queue is generic over what the glue keeps per request, so it is
//! tested natively.
//!
//! A held request keeps its model: it is admitted only to a node serving it, with the sets
//! known when it leaves (a list learned meanwhile counts), so it may also leave as
//! `UnknownModel` if the last node serving its model stopped listing it.

use crate::config::WhenFull;
use crate::ingest::claim::Claim;
use crate::ingest::prompt::Chain;
use crate::ingest::request::Weight;
use crate::rng::Rng;
use crate::route::balancer::{Balancer, BookSource, Outcome, Terms};
use crate::route::choice::Pin;
use std::collections::HashMap;

/// A tenant served within this many milliseconds is active: other tenants leave it a short
/// lane (`Terms::lane`).
pub const ACTIVE_MS: u64 = 10_000;

/// Tenants whose served tokens are remembered at most; past it, a tenant with nothing held
/// and the smallest counter is forgotten (it would be lifted to the waiting minimum anyway).
pub const MAX_TENANTS: usize = 4096;

/// One request waiting for a node.
#[derive(Debug)]
pub struct Held<T> {
    /// The glue's handle for the request (its proxy-wasm context id).
    pub id: u32,
    pub weight: Weight,
    /// The body's model, which restricts the nodes it may go to.
    pub model: Option<String>,
    /// The prompt's prefix chain, which prices it on each node.
    pub chain: Chain,
    /// Its priority, tenant and budget.
    pub claim: Claim,
    /// Body bytes Envoy buffers while it waits.
    pub bytes: u64,
    pub since_ms: u64,
    /// The one node it may go to (a turn continuing a conversation stored there): it waits
    /// for room there alone, beside the queue's order (see `admit`).
    pub pin: Option<Pin>,
    pub payload: T,
}

impl<T> Held<T> {
    /// A request with no claims and no body bytes counted (see `claiming`).
    pub fn new(
        id: u32,
        weight: Weight,
        model: Option<String>,
        chain: Chain,
        since_ms: u64,
        payload: T,
    ) -> Held<T> {
        Held {
            id,
            weight,
            model,
            chain,
            claim: Claim::default(),
            bytes: 0,
            since_ms,
            pin: None,
            payload,
        }
    }

    /// The same request, pinned to one node (`None`: not pinned).
    pub fn pinned(self, pin: Option<Pin>) -> Held<T> {
        Held { pin, ..self }
    }

    /// The same request with its claims and body size.
    pub fn claiming(self, claim: Claim, bytes: u64) -> Held<T> {
        Held {
            claim,
            bytes,
            ..self
        }
    }

    /// Where the balancer would send it now, on `terms` (and its pin).
    fn route(
        &self,
        terms: Terms,
        now_ms: u64,
        balancer: &mut Balancer,
        rng: &mut dyn Rng,
        books: &mut dyn BookSource,
    ) -> Outcome {
        let terms = Terms {
            pin: self.pin,
            ..terms
        };
        balancer.route_on(
            self.weight,
            self.model.as_deref(),
            &self.chain,
            now_ms,
            rng,
            terms,
            books,
        )
    }

    /// Milliseconds of its first-token budget left at `now_ms` (none without a budget).
    fn ttft_left_ms(&self, now_ms: u64) -> Option<u64> {
        let ttft = self.claim.ttft_ms?;
        Some(ttft.saturating_sub(now_ms.saturating_sub(self.since_ms)))
    }
}

/// The requests held by one filter instance, in order of arrival, and the tokens each tenant
/// has been served.
#[derive(Debug)]
pub struct HoldQueue<T> {
    entries: Vec<Held<T>>,
    max_len: usize,
    max_bytes: u64,
    max_hold_ms: u64,
    /// What becomes of a request held `max_hold_ms` that still finds no room.
    when_full: WhenFull,
    bytes: u64,
    /// Virtual token counters: tokens served per tenant (see the module).
    served: HashMap<u64, f64>,
    /// The two tenants served last, each with when (latest first): the first's counter lifts
    /// a tenant that starts waiting alone, and the two tell whether a tenant other than any
    /// given one was served recently.
    recent: [Option<(u64, u64)>; 2],
}

impl<T> HoldQueue<T> {
    /// A queue of at most `max_len` requests, each held at most `max_hold_ms`. Either at zero
    /// disables holding. Body bytes are not bounded (see `with_max_bytes`).
    pub fn new(max_len: usize, max_hold_ms: u64) -> Self {
        HoldQueue {
            entries: Vec::new(),
            max_len,
            max_bytes: u64::MAX,
            max_hold_ms,
            when_full: WhenFull::Route,
            bytes: 0,
            served: HashMap::new(),
            recent: [None; 2],
        }
    }

    /// The same queue, holding at most `max_bytes` of request bodies at once.
    pub fn with_max_bytes(self, max_bytes: u64) -> Self {
        HoldQueue { max_bytes, ..self }
    }

    /// The same queue, answering as `Outcome::Full` a request held `max_hold_ms` that still
    /// finds no room, with `WhenFull::Reject` (it is routed over the ceiling otherwise).
    pub fn when_full(self, when_full: WhenFull) -> Self {
        HoldQueue { when_full, ..self }
    }

    /// Whether a request that no node has room for, and that cannot wait here, is answered
    /// rather than routed over the ceiling.
    pub fn rejects_when_full(&self) -> bool {
        self.when_full == WhenFull::Reject
    }

    /// Whether a request that finds every node over the ceiling may wait here now.
    pub fn may_hold(&self) -> bool {
        self.max_hold_ms > 0 && self.entries.len() < self.max_len && self.bytes < self.max_bytes
    }

    /// Whether holding is on at all (tenants' service is counted only then).
    pub fn holds(&self) -> bool {
        self.max_hold_ms > 0 && self.max_len > 0
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Body bytes held now.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Holds a request. A full queue makes room by shedding its lowest-priority requests
    /// (the latest first) when they are below this one's priority: they are given back in
    /// the `Ok`, to be answered. A queue that stays full, or is disabled, gives the request
    /// back: route it now.
    pub fn push(&mut self, held: Held<T>) -> Result<Vec<Held<T>>, Box<Held<T>>> {
        if !self.holds() {
            return Err(Box::new(held));
        }
        // The lowest priorities first, the latest of each first, until it fits.
        let mut lower: Vec<(usize, i32, u64)> = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, h)| h.claim.priority < held.claim.priority)
            .map(|(i, h)| (i, h.claim.priority, h.bytes))
            .collect();
        lower.sort_by_key(|(i, p, _)| (*p, std::cmp::Reverse(*i)));
        let (mut len, mut bytes) = (self.entries.len(), self.bytes);
        let fits = |len: usize, bytes: u64| {
            len < self.max_len && bytes.saturating_add(held.bytes) <= self.max_bytes
        };
        let mut chosen = Vec::new();
        for (i, _, b) in lower {
            if fits(len, bytes) {
                break;
            }
            chosen.push(i);
            len -= 1;
            bytes = bytes.saturating_sub(b);
        }
        if !fits(len, bytes) {
            return Err(Box::new(held));
        }
        // Taken out from the back, so the indices still hold.
        chosen.sort_unstable_by(|a, b| b.cmp(a));
        let shed: Vec<Held<T>> = chosen.into_iter().map(|i| self.take(i)).collect();
        let tenant = held.claim.tenant;
        if !self.entries.iter().any(|h| h.claim.tenant == tenant) {
            // Starting to wait: no credit for the time it was not waiting.
            let floor = self
                .entries
                .iter()
                .map(|h| self.counter(h.claim.tenant))
                .reduce(f64::min)
                .or_else(|| self.recent[0].map(|(t, _)| self.counter(t)));
            if let Some(floor) = floor {
                let own = self.counter(tenant);
                if floor > own {
                    self.set_counter(tenant, floor);
                }
            }
        }
        self.bytes = self.bytes.saturating_add(held.bytes);
        self.entries.push(held);
        Ok(shed)
    }

    /// Counts `tokens` served to `tenant` at `now_ms` (a request routed, held or not).
    /// Nothing is counted while holding is off.
    pub fn served(&mut self, tenant: u64, tokens: u64, now_ms: u64) {
        if !self.holds() {
            return;
        }
        let c = self.counter(tenant) + tokens as f64;
        self.set_counter(tenant, c);
        match self.recent {
            [Some((t, _)), _] if t == tenant => {}
            [latest, _] => self.recent = [None, latest],
        }
        self.recent[0] = Some((tenant, now_ms));
    }

    /// Whether a tenant other than `tenant` is active at `now_ms`: it has a request held, or
    /// was served within `ACTIVE_MS`.
    pub fn others_active(&self, tenant: u64, now_ms: u64) -> bool {
        self.recent
            .iter()
            .flatten()
            .any(|&(t, at)| t != tenant && now_ms.saturating_sub(at) <= ACTIVE_MS)
            || self.entries.iter().any(|h| h.claim.tenant != tenant)
    }

    /// The tokens `tenant` has been served (as counted, lifts included).
    pub fn counter(&self, tenant: u64) -> f64 {
        self.served.get(&tenant).copied().unwrap_or(0.0)
    }

    fn set_counter(&mut self, tenant: u64, value: f64) {
        if self.served.len() >= MAX_TENANTS && !self.served.contains_key(&tenant) {
            let idle = self
                .served
                .iter()
                .filter(|(t, _)| !self.entries.iter().any(|h| h.claim.tenant == **t))
                .min_by(|a, b| a.1.total_cmp(b.1))
                .map(|(t, _)| *t);
            match idle {
                Some(t) => {
                    self.served.remove(&t);
                }
                // Every remembered tenant is waiting (more tenants than requests held
                // cannot be): keep the table as it is.
                None => return,
            }
        }
        self.served.insert(tenant, value);
    }

    /// Tenants whose served tokens are remembered.
    pub fn tenants(&self) -> usize {
        self.served.len()
    }

    /// Takes a request out of the queue without routing it (its stream ended while held).
    pub fn remove(&mut self, id: u32) -> Option<Held<T>> {
        let at = self.entries.iter().position(|h| h.id == id)?;
        Some(self.take(at))
    }

    fn take(&mut self, at: usize) -> Held<T> {
        let held = self.entries.remove(at);
        self.bytes = self.bytes.saturating_sub(held.bytes);
        held
    }

    /// Empties the queue, oldest first (the plugin is being reconfigured: its requests must
    /// not wait for a balancer that is gone).
    pub fn drain(&mut self) -> impl Iterator<Item = Held<T>> + '_ {
        self.bytes = 0;
        self.entries.drain(..)
    }

    /// When a request of `priority` and `weight` should come back, in milliseconds: the work
    /// held at its priority or above and its own (at their expected output, not their caps),
    /// at the fleet's capacity (at least a second).
    pub fn wait_ms(&self, priority: i32, weight: Weight, balancer: &Balancer, now_ms: u64) -> u64 {
        let ahead: u64 = self
            .entries
            .iter()
            .filter(|h| h.claim.priority >= priority)
            .map(|h| balancer.expected(h.weight).total())
            .sum();
        balancer
            .drain_ms(
                ahead.saturating_add(balancer.expected(weight).total()),
                now_ms,
            )
            .unwrap_or(1000)
            .max(1000)
    }

    /// The request that leaves next if it can: the highest priority, then the tenant served
    /// least, then the oldest.
    fn next(&self) -> Option<usize> {
        let queued = || self.entries.iter().filter(|h| h.pin.is_none());
        let top = queued().map(|h| h.claim.priority).max()?;
        let mut best: Option<(usize, f64)> = None;
        for (i, h) in self.entries.iter().enumerate() {
            if h.claim.priority != top || h.pin.is_some() {
                continue;
            }
            let c = self.counter(h.claim.tenant);
            if best.map_or(true, |(_, b)| c < b) {
                best = Some((i, c));
            }
        }
        best.map(|(i, _)| i)
    }

    fn leave(
        &mut self,
        at: usize,
        outcome: Outcome,
        now_ms: u64,
        out: &mut Vec<(Held<T>, Outcome)>,
    ) {
        let held = self.take(at);
        if let Outcome::Routed { ticket, .. } = &outcome {
            self.served(held.claim.tenant, ticket.weight.total(), now_ms);
        }
        out.push((held, outcome));
    }

    /// Where held request `h`, which may wait no longer (held `max_hold_ms`, or no node would
    /// hold it even empty), goes: routed, over the ceiling if need be, or, with
    /// `WhenFull::Reject`, answered as `Full` when no node has room for it. It is asked as if
    /// it could wait, so that "no room" comes back as such rather than as the least-bad node;
    /// a cold start is not a full fleet.
    fn without_waiting(
        &self,
        h: &Held<T>,
        lane: bool,
        now_ms: u64,
        balancer: &mut Balancer,
        rng: &mut dyn Rng,
        books: &mut dyn BookSource,
    ) -> Outcome {
        let reject = self.rejects_when_full() && !balancer.warming(now_ms);
        let terms = Terms {
            may_hold: reject,
            ttft_left_ms: h.ttft_left_ms(now_ms),
            tpot_ms: h.claim.tpot_ms,
            lane,
            pin: None,
        };
        match h.route(terms, now_ms, balancer, rng, books) {
            outcome @ (Outcome::Saturated | Outcome::Oversized) if reject => Outcome::Full {
                retry_after_ms: self.wait_ms(h.claim.priority, h.weight, balancer, now_ms),
                fits: outcome == Outcome::Saturated,
            },
            outcome => outcome,
        }
    }

    /// Lets out what can go now, deciding with the books `books` gives (see
    /// `Balancer::route`): first the requests whose first-token budget has run out (`TooLate`,
    /// to be answered), then those held `max_hold_ms` (routed even over the ceiling, or with
    /// `WhenFull::Reject` answered as `Full` when no node has room), then, in
    /// the queue's order, every request the balancer finds a node with room for, until one
    /// must keep waiting.
    pub fn admit(
        &mut self,
        now_ms: u64,
        balancer: &mut Balancer,
        rng: &mut dyn Rng,
        books: &mut dyn BookSource,
    ) -> Vec<(Held<T>, Outcome)> {
        let mut out = Vec::new();
        while let Some(at) = self
            .entries
            .iter()
            .position(|h| h.ttft_left_ms(now_ms) == Some(0))
        {
            let retry_after_ms = self.entries.get(at).map_or(1000, |h| {
                self.wait_ms(h.claim.priority, h.weight, balancer, now_ms)
            });
            self.leave(at, Outcome::TooLate { retry_after_ms }, now_ms, &mut out);
        }
        while let Some(at) = self
            .entries
            .iter()
            .position(|h| now_ms.saturating_sub(h.since_ms) >= self.max_hold_ms)
        {
            let Some(h) = self.entries.get(at) else { break };
            let outcome = self.without_waiting(h, false, now_ms, balancer, rng, books);
            self.leave(at, outcome, now_ms, &mut out);
        }
        // A pinned request waits for room on its node alone: it goes when that node has room,
        // whatever waits before it for the others, and never keeps them waiting.
        let mut at = 0;
        while let Some(h) = self.entries.get(at) {
            if h.pin.is_none() {
                at += 1;
                continue;
            }
            let terms = Terms {
                may_hold: true,
                ttft_left_ms: h.ttft_left_ms(now_ms),
                tpot_ms: h.claim.tpot_ms,
                lane: false,
                pin: h.pin,
            };
            let outcome = match h.route(terms, now_ms, balancer, rng, books) {
                Outcome::Saturated => {
                    at += 1;
                    continue;
                }
                Outcome::Oversized => self.without_waiting(h, false, now_ms, balancer, rng, books),
                outcome => outcome,
            };
            self.leave(at, outcome, now_ms, &mut out);
        }
        while let Some(at) = self.next() {
            let Some(h) = self.entries.get(at) else { break };
            let terms = Terms {
                may_hold: true,
                ttft_left_ms: h.ttft_left_ms(now_ms),
                tpot_ms: h.claim.tpot_ms,
                lane: self.others_active(h.claim.tenant, now_ms),
                pin: None,
            };
            let outcome = match h.route(terms, now_ms, balancer, rng, books) {
                Outcome::Saturated => break,
                // No node would hold it even empty (the fleet changed since it came): it waits
                // no longer, as at its deadline.
                Outcome::Oversized => {
                    self.without_waiting(h, terms.lane, now_ms, balancer, rng, books)
                }
                outcome => outcome,
            };
            self.leave(at, outcome, now_ms, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::ingest::telemetry::Report;
    use crate::rng::SplitMix64;
    use crate::route::balancer::OwnBooks;
    use crate::route::testing::stored;

    /// One node with a 1,000-token cache and a 0.9 ceiling.
    fn balancer() -> Balancer {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","nodes":[{"address":"10.0.0.1:8000","kv_cache_tokens":1000}],
                 "hold_kv_ceiling":0.9}"#,
        )
        .unwrap();
        Balancer::new(&cfg)
    }

    fn report(balancer: &mut Balancer, kv_used: f64, now_ms: u64) {
        let body = format!(
            r#"{{"tokens_per_sec_load":10,"tokens_per_sec_capacity":1000,"kv_cache_usage":{kv_used}}}"#
        );
        let r: Report = balancer
            .on_health(0, Some(body.as_bytes()), now_ms)
            .unwrap();
        assert_eq!(r.kv_cache_usage, Some(kv_used));
    }

    /// Node `node` reports the JSON object's `fields` at `now_ms`.
    fn health(b: &mut Balancer, node: usize, fields: &str, now_ms: u64) {
        let body = format!("{{{fields}}}");
        b.on_health(node, Some(body.as_bytes()), now_ms).unwrap();
    }

    /// A balancer of `nodes` nodes (at most two) with 100,000 tokens of cache each, every node
    /// compared, reports stale after 2 s: the fleet of the time-per-token tests.
    fn budget_fleet(nodes: usize) -> Balancer {
        let all = [
            r#"{"address":"10.0.0.1:8000","kv_cache_tokens":100000}"#,
            r#"{"address":"10.0.0.2:8000","kv_cache_tokens":100000}"#,
        ];
        let json = format!(
            r#"{{"health_cluster":"h","choices":0,"stale_after_ms":2000,"nodes":[{}]}}"#,
            all[..nodes].join(",")
        );
        Balancer::new(&Config::parse(json.as_bytes()).unwrap())
    }

    /// Node `node` reports no load, `cap` tokens/s of capacity and an empty cache at `now_ms`.
    fn idle(b: &mut Balancer, node: usize, cap: u32, now_ms: u64) {
        let fields = format!(
            r#""tokens_per_sec_load":0,"tokens_per_sec_capacity":{cap},"kv_cache_usage":0"#
        );
        health(b, node, &fields, now_ms);
    }

    /// A stream of a `prompt`-token prompt completed on node `node` at `seconds` a token.
    fn completed(b: &mut Balancer, node: usize, prompt: u64, seconds: f64, now_ms: u64) {
        let ticket = crate::fleet::node::Ticket {
            node,
            tenant: 0,
            generation: b.generation(),
            epoch: 0,
            weight: w(prompt),
            reserved_output: 0,
            cached: 0,
            tpot_ms: None,
            stream: 0,
            text_prompt: 0,
        };
        b.observe_tpot(&ticket, seconds, now_ms);
    }

    impl<T> HoldQueue<T> {
        /// `push` of a request with no claims, giving back the payload when not held.
        fn put(
            &mut self,
            id: u32,
            weight: Weight,
            model: Option<String>,
            chain: Chain,
            now_ms: u64,
            payload: T,
        ) -> Result<(), T> {
            self.push(Held::new(id, weight, model, chain, now_ms, payload))
                .map(|_| ())
                .map_err(|h| h.payload)
        }
    }

    fn w(prompt: u64) -> Weight {
        Weight {
            prompt_tokens: prompt,
            output_tokens: 10,
        }
    }

    /// Routes `weight` with `terms` at `now_ms` on this balancer's own books: the node, its
    /// stream released at once, or the outcome when it is not routed.
    fn route_and_release(
        b: &mut Balancer,
        rng: &mut SplitMix64,
        weight: Weight,
        terms: Terms,
        now_ms: u64,
    ) -> Result<usize, Outcome> {
        match b.route_on(
            weight,
            None,
            &Chain::NONE,
            now_ms,
            rng,
            terms,
            &mut OwnBooks,
        ) {
            Outcome::Routed { ticket, .. } => {
                b.release(&ticket, 0);
                Ok(ticket.node)
            }
            other => Err(other),
        }
    }

    #[test]
    fn a_full_node_holds_then_admits_in_order_when_room_appears() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(1);
        report(&mut b, 0.85, 0);
        // 850 used + 100 + 10 > 900: over the ceiling, so the balancer asks to hold.
        assert!(matches!(
            b.route(w(100), None, &Chain::NONE, 0, &mut rng, true, &mut OwnBooks),
            Outcome::Saturated
        ));
        let mut q = HoldQueue::new(8, 5_000);
        q.put(1, w(100), None, Chain::NONE, 0, "first").unwrap();
        q.put(2, w(20), None, Chain::NONE, 10, "second").unwrap();
        assert!(q.admit(100, &mut b, &mut rng, &mut OwnBooks).is_empty());
        assert_eq!(q.len(), 2);
        // The node drains: both fit, and they leave in the order they came.
        report(&mut b, 0.1, 200);
        let out = q.admit(200, &mut b, &mut rng, &mut OwnBooks);
        let order: Vec<_> = out.iter().map(|(h, _)| h.payload).collect();
        assert_eq!(order, vec!["first", "second"]);
        assert!(out
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Routed { over_ceiling, .. } if !over_ceiling)));
        assert!(q.is_empty());
    }

    #[test]
    fn the_head_blocks_smaller_requests_behind_it() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(2);
        report(&mut b, 0.5, 0);
        let mut q = HoldQueue::new(8, 5_000);
        q.put(1, w(600), None, Chain::NONE, 0, ()).unwrap(); // 500 + 600 + 10 > 900
        q.put(2, w(10), None, Chain::NONE, 0, ()).unwrap(); // would fit on its own
        assert!(q.admit(10, &mut b, &mut rng, &mut OwnBooks).is_empty());
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn a_request_held_too_long_is_routed_over_the_ceiling() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(3);
        report(&mut b, 0.95, 0);
        let mut q = HoldQueue::new(8, 1_000);
        q.put(1, w(10), None, Chain::NONE, 0, ()).unwrap();
        q.put(2, w(10), None, Chain::NONE, 600, ()).unwrap();
        let out = q.admit(1_000, &mut b, &mut rng, &mut OwnBooks);
        assert_eq!(out.len(), 1, "only the request held for 1 s leaves");
        assert_eq!(out[0].0.id, 1);
        assert!(matches!(
            out[0].1,
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn with_when_full_reject_a_request_held_too_long_is_answered_when_no_node_has_room() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(3);
        report(&mut b, 0.95, 0);
        let mut q = HoldQueue::new(8, 1_000).when_full(WhenFull::Reject);
        assert!(q.rejects_when_full());
        q.put(1, w(10), None, Chain::NONE, 0, ()).unwrap();
        q.put(2, w(10), None, Chain::NONE, 600, ()).unwrap();
        let out = q.admit(1_000, &mut b, &mut rng, &mut OwnBooks);
        assert_eq!(out.len(), 1, "only the request held for 1 s leaves");
        assert_eq!(out[0].0.id, 1);
        assert!(
            matches!(out[0].1, Outcome::Full { retry_after_ms, fits: true } if retry_after_ms >= 1000),
            "{:?}",
            out[0].1
        );
        // Nothing was booked for it.
        assert_eq!(b.nodes()[0].books().inflight_requests, 0);
        // Room appears before the second's hold is out: it is routed under the ceiling.
        report(&mut b, 0.1, 1_100);
        let out = q.admit(1_600, &mut b, &mut rng, &mut OwnBooks);
        assert!(matches!(
            out[..],
            [(ref h, Outcome::Routed { over_ceiling: false, .. })] if h.id == 2
        ));
    }

    #[test]
    fn with_when_full_reject_a_held_request_that_finds_room_at_its_deadline_is_routed() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(5);
        report(&mut b, 0.95, 0);
        let mut q = HoldQueue::new(8, 1_000).when_full(WhenFull::Reject);
        q.put(1, w(10), None, Chain::NONE, 0, ()).unwrap();
        // The room comes with the report that the deadline's event brings.
        report(&mut b, 0.2, 1_000);
        let out = q.admit(1_000, &mut b, &mut rng, &mut OwnBooks);
        assert!(matches!(
            out[..],
            [(
                _,
                Outcome::Routed {
                    over_ceiling: false,
                    ..
                }
            )]
        ));
    }

    #[test]
    fn a_request_no_node_would_hold_even_empty_is_not_held() {
        // One node of 1,000 tokens, holding ceiling 0.9, nearly full.
        let mut b = balancer();
        let mut rng = SplitMix64::new(7);
        report(&mut b, 0.95, 0);
        let hold = Terms {
            may_hold: true,
            ..Terms::default()
        };
        let mut ask = |b: &mut Balancer, prompt: u64, terms: Terms| {
            b.route_on(
                w(prompt),
                None,
                &Chain::NONE,
                10,
                &mut rng,
                terms,
                &mut OwnBooks,
            )
        };
        // 300 tokens fit once the node empties: held for room.
        assert_eq!(ask(&mut b, 300, hold), Outcome::Saturated);
        // 950 never fit under 0.9 of 1,000, however empty the node gets: not held.
        assert_eq!(ask(&mut b, 950, hold), Outcome::Oversized);
        assert_eq!(b.nodes()[0].books().inflight_requests, 0, "nothing booked");
        // Asked again without holding, it goes to the node with the most room, over the ceiling.
        assert!(matches!(
            ask(&mut b, 950, Terms::default()),
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
    }

    /// Two nodes, 10,000 and 1,000 tokens of cache, holding ceiling 0.9, reports stale after
    /// 2 s: the large one full at 0 ms, the small one empty and reporting until `small_until`.
    fn large_node_goes_quiet(small_until: u64) -> Balancer {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","choices":0,"stale_after_ms":2000,"hold_kv_ceiling":0.9,
                 "nodes":[{"address":"10.0.0.1:8000","kv_cache_tokens":10000},
                          {"address":"10.0.0.2:8000","kv_cache_tokens":1000}]}"#,
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        let full =
            r#""tokens_per_sec_load":10,"tokens_per_sec_capacity":1000,"kv_cache_usage":0.95"#;
        let empty = r#""tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"kv_cache_usage":0"#;
        health(&mut b, 0, full, 0);
        for t in (0..=small_until).step_by(500) {
            health(&mut b, 1, empty, t);
        }
        b
    }

    #[test]
    fn a_held_request_the_fleet_can_no_longer_hold_leaves_at_once() {
        for when_full in [WhenFull::Route, WhenFull::Reject] {
            let mut b = large_node_goes_quiet(0);
            let mut rng = SplitMix64::new(8);
            let mut q = HoldQueue::new(8, 60_000).when_full(when_full);
            // 2,000 tokens fit only the large node, once it empties: held.
            q.put(1, w(2_000), None, Chain::NONE, 0, ()).unwrap();
            assert!(q.admit(100, &mut b, &mut rng, &mut OwnBooks).is_empty());
            // The large node stops reporting; the small one goes on. Nothing left could hold
            // the request even empty: it leaves long before its hold is out.
            let mut b = large_node_goes_quiet(3_000);
            let out = q.admit(3_000, &mut b, &mut rng, &mut OwnBooks);
            match when_full {
                WhenFull::Route => assert!(
                    matches!(
                        &out[..],
                        [(_, Outcome::Routed { over_ceiling: true, ticket, .. })] if ticket.node == 1
                    ),
                    "{out:?}"
                ),
                WhenFull::Reject => assert!(
                    matches!(&out[..], [(_, Outcome::Full { retry_after_ms, fits: false })] if *retry_after_ms >= 1000),
                    "{out:?}"
                ),
            }
        }
    }

    #[test]
    fn with_when_full_reject_a_cold_start_is_not_a_full_fleet() {
        // No node has reported: a request held for the first reports is not refused at its
        // deadline, it goes to Envoy's balancer.
        let mut b = balancer();
        let mut rng = SplitMix64::new(6);
        assert!(b.warming(0));
        let mut q = HoldQueue::new(8, 1_000).when_full(WhenFull::Reject);
        q.put(1, w(10), None, Chain::NONE, 0, ()).unwrap();
        let out = q.admit(1_000, &mut b, &mut rng, &mut OwnBooks);
        assert!(b.warming(1_000));
        assert!(matches!(out[..], [(_, Outcome::NoFreshNodes)]), "{out:?}");
    }

    #[test]
    fn stale_telemetry_releases_everything_to_the_fallback() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(4);
        report(&mut b, 0.95, 0);
        let mut q = HoldQueue::new(8, 1_000_000);
        q.put(1, w(10), None, Chain::NONE, 0, ()).unwrap();
        // Long after the report went stale, no node is fresh: the request leaves for Envoy's
        // own balancer instead of waiting for a report that may never come.
        let out = q.admit(100_000, &mut b, &mut rng, &mut OwnBooks);
        assert!(matches!(out[0].1, Outcome::NoFreshNodes));
    }

    #[test]
    fn bounds_and_disabling() {
        let mut q = HoldQueue::new(2, 1_000);
        assert!(q.put(1, w(1), None, Chain::NONE, 0, 'a').is_ok());
        assert!(q.put(2, w(1), None, Chain::NONE, 0, 'b').is_ok());
        assert_eq!(q.put(3, w(1), None, Chain::NONE, 0, 'c'), Err('c'));
        assert_eq!(q.remove(1).map(|h| h.payload), Some('a'));
        assert!(q.remove(1).is_none());
        assert!(q.may_hold());
        assert!(q.put(4, w(1), None, Chain::NONE, 0, 'd').is_ok());
        assert_eq!(q.drain().map(|h| h.payload).collect::<String>(), "bd");
        assert!(q.is_empty());
        let mut off: HoldQueue<char> = HoldQueue::new(8, 0);
        assert!(!off.may_hold());
        assert_eq!(off.put(1, w(1), None, Chain::NONE, 0, 'x'), Err('x'));
        let mut none: HoldQueue<char> = HoldQueue::new(0, 1_000);
        assert_eq!(none.put(1, w(1), None, Chain::NONE, 0, 'y'), Err('y'));
    }

    #[test]
    fn by_default_only_what_would_outgrow_the_whole_cache_is_held() {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","nodes":[{"address":"10.0.0.1:8000","kv_cache_tokens":1000}]}"#,
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        let mut rng = SplitMix64::new(6);
        report(&mut b, 0.85, 0);
        // 0.85 + 0.11 passes the 0.9 ceiling but fits the cache: routed, flagged.
        assert!(matches!(
            b.route(w(100), None, &Chain::NONE, 0, &mut rng, true, &mut OwnBooks),
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
        // 0.85 + 0.11 booked + 0.11 more: past the whole cache, held.
        assert!(matches!(
            b.route(w(100), None, &Chain::NONE, 0, &mut rng, true, &mut OwnBooks),
            Outcome::Saturated
        ));
    }

    #[test]
    fn without_a_hold_the_balancer_still_routes_over_the_ceiling() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(5);
        report(&mut b, 0.95, 0);
        assert!(matches!(
            b.route(w(10), None, &Chain::NONE, 0, &mut rng, false, &mut OwnBooks),
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
    }

    /// Node 0 serves m1 (configured) and is full; node 1 is idle and learns from its list that
    /// it serves m2 only. A request for m1 waits for node 0 however idle node 1 is.
    #[test]
    fn a_held_request_keeps_its_model() {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","hold_kv_ceiling":0.9,"nodes":[
                 {"address":"10.0.0.1:8000","kv_cache_tokens":1000,"models":["m1"]},
                 {"address":"10.0.0.2:8000","kv_cache_tokens":1000}]}"#,
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        let mut rng = SplitMix64::new(7);
        let kv = |b: &mut Balancer, node: usize, used: f64, now: u64| {
            let body = format!(
                r#"{{"tokens_per_sec_load":10,"tokens_per_sec_capacity":1000,"kv_cache_usage":{used}}}"#
            );
            b.on_health(node, Some(body.as_bytes()), now).unwrap();
        };
        kv(&mut b, 0, 0.95, 0);
        kv(&mut b, 1, 0.0, 0);
        b.on_models(1, br#"{"data":[{"id":"m2"}]}"#).unwrap();
        assert!(matches!(
            b.route(
                w(10),
                Some("m1"),
                &Chain::NONE,
                0,
                &mut rng,
                true,
                &mut OwnBooks
            ),
            Outcome::Saturated
        ));
        let mut q = HoldQueue::new(8, 5_000);
        q.put(1, w(10), Some("m1".to_string()), Chain::NONE, 0, "m1")
            .unwrap();
        assert!(
            q.admit(100, &mut b, &mut rng, &mut OwnBooks).is_empty(),
            "node 1 does not serve m1"
        );
        // Without a model the same request would have gone to node 1 at once.
        assert!(matches!(
            b.route(w(10), None, &Chain::NONE, 100, &mut rng, true, &mut OwnBooks),
            Outcome::Routed { ticket, .. } if ticket.node == 1
        ));
        kv(&mut b, 0, 0.1, 200);
        let out = q.admit(200, &mut b, &mut rng, &mut OwnBooks);
        assert!(
            matches!(&out[..], [(h, Outcome::Routed { ticket, .. })] if h.payload == "m1" && ticket.node == 0),
            "{out:?}"
        );
        // Held while its model is served, gone from every list by the time it leaves: it
        // leaves as an unknown model, not to a node that would answer 404.
        let mut b = Balancer::new(
            &Config::parse(br#"{"health_cluster":"h","nodes":[{"address":"10.0.0.2:8000","kv_cache_tokens":1000}]}"#)
                .unwrap(),
        );
        kv(&mut b, 0, 0.99, 0);
        b.on_models(0, br#"{"data":[{"id":"m2"},{"id":"lora-x"}]}"#)
            .unwrap();
        q.put(
            2,
            w(10),
            Some("lora-x".to_string()),
            Chain::NONE,
            0,
            "lora-x",
        )
        .unwrap();
        b.on_models(0, br#"{"data":[{"id":"m2"}]}"#).unwrap();
        let out = q.admit(300, &mut b, &mut rng, &mut OwnBooks);
        assert!(matches!(&out[..], [(_, Outcome::UnknownModel)]), "{out:?}");
    }

    /// A pinned request (a turn of a conversation stored on one node) waits for room on its
    /// node alone: requests held behind it leave for other nodes meanwhile, and it leaves
    /// when its node has room, to that node.
    #[test]
    fn a_pinned_request_waits_for_its_node_without_blocking_the_queue() {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","hold_kv_ceiling":0.9,"choices":0,"nodes":[
                 {"address":"10.0.0.1:8000","kv_cache_tokens":1000},
                 {"address":"10.0.0.2:8000","kv_cache_tokens":1000}]}"#,
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        let mut rng = SplitMix64::new(8);
        health(
            &mut b,
            0,
            r#""tokens_per_sec_load":10,"tokens_per_sec_capacity":1000,"kv_cache_usage":0.95"#,
            0,
        );
        health(
            &mut b,
            1,
            r#""tokens_per_sec_load":10,"tokens_per_sec_capacity":1000,"kv_cache_usage":0.95"#,
            0,
        );
        let pin = b.pin_to(&stored("10.0.0.1:8000", 50));
        let mut q = HoldQueue::new(8, 60_000);
        q.push(Held::new(1, w(10), None, Chain::NONE, 0, "pinned").pinned(pin))
            .unwrap();
        q.put(2, w(10), None, Chain::NONE, 5, "any").unwrap();
        assert!(q.admit(100, &mut b, &mut rng, &mut OwnBooks).is_empty());
        // Node 1 (not its node) has room: the request behind it leaves, it stays.
        health(
            &mut b,
            1,
            r#""tokens_per_sec_load":10,"tokens_per_sec_capacity":1000,"kv_cache_usage":0.1"#,
            200,
        );
        let out = q.admit(200, &mut b, &mut rng, &mut OwnBooks);
        assert!(
            matches!(&out[..], [(h, Outcome::Routed { ticket, .. })] if h.payload == "any" && ticket.node == 1),
            "{out:?}"
        );
        assert_eq!(q.len(), 1);
        // Its node has room: it leaves for it, priced with the stored turns.
        health(
            &mut b,
            0,
            r#""tokens_per_sec_load":10,"tokens_per_sec_capacity":1000,"kv_cache_usage":0.1"#,
            300,
        );
        let out = q.admit(300, &mut b, &mut rng, &mut OwnBooks);
        assert!(
            matches!(&out[..], [(h, Outcome::Routed { ticket, .. })]
                if h.payload == "pinned" && ticket.node == 0 && ticket.weight.prompt_tokens == 60),
            "{out:?}"
        );
        assert!(q.is_empty());
    }

    /// Requests held while a thousand nodes are over the ceiling: trying them again on an
    /// event reads a bounded number of books per request tried, not one per node; and once
    /// a node has room they leave for it.
    #[test]
    fn admission_under_saturation_costs_a_bounded_number_of_book_reads() {
        use crate::route::balancer::COMPARISON_READS;
        use crate::route::testing::{cfg, Counting, FULL, ROOM};
        let bound = 2 * 2 + COMPARISON_READS;
        let mut b = Balancer::new(&cfg(1000, r#","kv_bytes_per_token":1,"max_hold_ms":60000"#));
        for i in 0..1000 {
            b.on_health(i, Some(FULL), 0).unwrap();
        }
        let mut rng = SplitMix64::new(8);
        let mut q = HoldQueue::new(100, 60_000);
        for id in 0..50 {
            q.put(id, w(100), None, Chain::NONE, 0, id).unwrap();
        }
        for event in 1..20 {
            let mut books = Counting::new(|_| false);
            assert!(q.admit(event, &mut b, &mut rng, &mut books).is_empty());
            assert!(books.reads <= bound, "{} reads", books.reads);
        }
        b.on_health(5, Some(ROOM), 30).unwrap();
        let mut books = Counting::new(|_| false);
        let out = q.admit(40, &mut b, &mut rng, &mut books);
        assert!(!out.is_empty());
        assert!(out
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Routed { ticket, .. } if ticket.node == 5)));
        assert!(
            books.reads <= bound * (out.len() + 1),
            "{} reads for {} admitted",
            books.reads,
            out.len()
        );
    }

    /// One node with a 100,000-token cache (room for everything below), 1,000 tokens/s.
    fn roomy() -> Balancer {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","nodes":[{"address":"10.0.0.1:8000","kv_cache_tokens":100000}],
                 "hold_kv_ceiling":0.9}"#,
        )
        .unwrap();
        Balancer::new(&cfg)
    }

    fn claim(priority: i32, tenant: u64, ttft_ms: Option<u64>) -> Claim {
        Claim {
            priority,
            tenant,
            ttft_ms,
            tpot_ms: None,
        }
    }

    fn hold(
        q: &mut HoldQueue<&'static str>,
        id: u32,
        prompt: u64,
        c: Claim,
        now: u64,
        name: &'static str,
    ) {
        let held = Held::new(id, w(prompt), None, Chain::NONE, now, name).claiming(c, 100);
        assert!(q.push(held).is_ok(), "{name} held");
    }

    fn order(out: &[(Held<&'static str>, Outcome)]) -> Vec<&'static str> {
        out.iter().map(|(h, _)| h.payload).collect()
    }

    #[test]
    fn higher_priority_leaves_first_whatever_came_first() {
        let mut b = roomy();
        let mut rng = SplitMix64::new(11);
        report(&mut b, 0.0, 0);
        let mut q = HoldQueue::new(8, 60_000);
        hold(&mut q, 1, 10, claim(0, 0, None), 0, "standard");
        hold(&mut q, 2, 10, claim(-5, 0, None), 1, "batch");
        hold(&mut q, 3, 10, claim(100, 0, None), 2, "premium");
        hold(&mut q, 4, 10, claim(0, 0, None), 3, "standard, later");
        let out = q.admit(10, &mut b, &mut rng, &mut OwnBooks);
        assert_eq!(
            order(&out),
            vec!["premium", "standard", "standard, later", "batch"]
        );
    }

    /// Tenant B's burst of long prompts came first; tenant A's short requests go between
    /// them, each time B's counter passes A's, instead of behind the whole burst.
    #[test]
    fn a_tenant_with_a_burst_of_long_prompts_does_not_starve_another() {
        let mut b = roomy();
        let mut rng = SplitMix64::new(12);
        report(&mut b, 0.0, 0);
        let (ta, tb) = (7, 9);
        let mut q = HoldQueue::new(16, 60_000);
        for (i, name) in ["B1", "B2", "B3", "B4"].into_iter().enumerate() {
            hold(&mut q, i as u32, 2_000, claim(0, tb, None), 0, name);
        }
        for (i, name) in ["A1", "A2", "A3"].into_iter().enumerate() {
            hold(&mut q, 10 + i as u32, 100, claim(0, ta, None), 1, name);
        }
        let out = q.admit(10, &mut b, &mut rng, &mut OwnBooks);
        assert_eq!(order(&out), vec!["B1", "A1", "A2", "A3", "B2", "B3", "B4"]);
        // Every routed request was counted to its tenant, at its expected tokens.
        assert_eq!(q.counter(ta), 3.0 * 110.0);
        assert_eq!(q.counter(tb), 4.0 * 2_010.0);
    }

    /// A tenant that was served much while nobody waited banks no credit against a newcomer,
    /// and a newcomer is lifted to the counter of the tenant served last.
    #[test]
    fn waiting_starts_from_the_others_counters() {
        let mut b = roomy();
        let mut rng = SplitMix64::new(13);
        report(&mut b, 0.0, 0);
        let mut q = HoldQueue::new(16, 60_000);
        q.served(1, 50_000, 0);
        hold(&mut q, 1, 100, claim(0, 2, None), 0, "new tenant");
        assert_eq!(q.counter(2), 50_000.0, "lifted to the tenant served last");
        hold(&mut q, 2, 100, claim(0, 1, None), 0, "busy tenant");
        assert_eq!(q.counter(1), 50_000.0, "already above the waiting minimum");
        let out = q.admit(10, &mut b, &mut rng, &mut OwnBooks);
        assert_eq!(order(&out), vec!["new tenant", "busy tenant"]);
        // With holding off nothing is counted.
        let mut off: HoldQueue<()> = HoldQueue::new(0, 0);
        off.served(1, 10, 0);
        assert_eq!(off.counter(1), 0.0);
    }

    #[test]
    fn the_tenant_table_is_bounded_and_forgets_the_idle_least_served() {
        let mut q: HoldQueue<&'static str> = HoldQueue::new(4, 60_000);
        for t in 0..MAX_TENANTS as u64 {
            q.served(t + 1, 1_000 + t, 0);
        }
        assert_eq!(q.tenants(), MAX_TENANTS);
        q.served(999_999, 5, 0);
        assert_eq!(q.tenants(), MAX_TENANTS);
        assert_eq!(
            q.counter(1),
            0.0,
            "the least served idle tenant was forgotten"
        );
        assert_eq!(q.counter(2), 1_001.0);
        assert_eq!(q.counter(999_999), 5.0);
    }

    #[test]
    fn the_queue_is_bounded_in_body_bytes() {
        let mut q: HoldQueue<char> = HoldQueue::new(8, 60_000).with_max_bytes(1_000);
        let big = |id, bytes| {
            Held::new(id, w(1), None, Chain::NONE, 0, 'x').claiming(Claim::default(), bytes)
        };
        assert!(q.push(big(1, 600)).is_ok());
        assert!(q.push(big(2, 500)).is_err(), "600 + 500 > 1000");
        assert!(q.push(big(3, 400)).is_ok());
        assert_eq!(q.bytes(), 1_000);
        assert!(!q.may_hold());
        q.remove(1);
        assert_eq!(q.bytes(), 400);
        assert!(q.may_hold());
        let _ = q.drain().count();
        assert_eq!(q.bytes(), 0);
    }

    /// The node is over the ceiling; one request's budget runs out while it waits, behind
    /// another without a budget: it leaves at once, told when to come back; the other stays.
    #[test]
    fn a_held_request_whose_budget_runs_out_is_answered_not_held() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(14);
        report(&mut b, 0.95, 0);
        let mut q = HoldQueue::new(8, 60_000);
        hold(&mut q, 1, 10, claim(0, 0, None), 0, "no budget");
        hold(&mut q, 2, 10, claim(0, 0, Some(500)), 0, "budget");
        assert!(q.admit(499, &mut b, &mut rng, &mut OwnBooks).is_empty());
        let out = q.admit(500, &mut b, &mut rng, &mut OwnBooks);
        assert!(
            matches!(&out[..], [(h, Outcome::TooLate { retry_after_ms })] if h.payload == "budget" && *retry_after_ms >= 1000),
            "{out:?}"
        );
        assert_eq!(q.len(), 1);
    }

    /// The request's own prompt takes 0.1 s at 1,000 tokens/s: a 50-ms budget cannot be met
    /// (come back in the 50 ms it misses by), a 200-ms one can.
    #[test]
    fn a_budget_no_node_meets_is_too_late_at_once() {
        let mut b = roomy();
        let mut rng = SplitMix64::new(15);
        report(&mut b, 0.0, 0);
        let mut ask = |b: &mut Balancer, ttft: u64| {
            let terms = Terms {
                may_hold: true,
                ttft_left_ms: Some(ttft),
                ..Terms::default()
            };
            b.route_on(
                w(100),
                None,
                &Chain::NONE,
                0,
                &mut rng,
                terms,
                &mut OwnBooks,
            )
        };
        assert_eq!(ask(&mut b, 50), Outcome::TooLate { retry_after_ms: 50 });
        assert!(matches!(ask(&mut b, 200), Outcome::Routed { .. }));
        // Over the ceiling as well: still answered, not held. The prompt routed above has
        // not had its first token: it is ahead of this one (0.2 s in all).
        report(&mut b, 0.95, 10);
        assert!(
            matches!(ask(&mut b, 50), Outcome::TooLate { retry_after_ms } if (150..=151).contains(&retry_after_ms))
        );
        assert_eq!(ask(&mut b, 5_000), Outcome::Saturated);
        // A request of no weight (a prompt only counted or tokenized) on the same terms is
        // neither late nor held: it goes.
        let free = Terms {
            may_hold: true,
            ttft_left_ms: Some(50),
            tpot_ms: Some(1),
            lane: true,
            pin: None,
        };
        let none = Weight::default();
        let out = b.route_on(none, None, &Chain::NONE, 0, &mut rng, free, &mut OwnBooks);
        assert!(matches!(out, Outcome::Routed { .. }), "{out:?}");
    }

    /// A request with a long answer: node 0 (10,000 tokens/s, one request queued) ranks first,
    /// since the answer is most of the work; node 1 (2,000 tokens/s, empty) starts it sooner. A
    /// budget that only node 1 meets sends it there; without one it goes to node 0.
    #[test]
    fn a_budget_picks_the_first_ranked_node_that_meets_it() {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","choices":0,"nodes":[
                 {"address":"10.0.0.1:8000","kv_cache_tokens":100000},
                 {"address":"10.0.0.2:8000","kv_cache_tokens":100000}]}"#,
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        let mut rng = SplitMix64::new(16);
        b.on_health(0, Some(br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":10000,"queue_depth":1,"kv_cache_usage":0}"#), 0).unwrap();
        b.on_health(
            1,
            Some(br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":2000,"kv_cache_usage":0}"#),
            0,
        )
        .unwrap();
        let long = Weight {
            prompt_tokens: 100,
            output_tokens: 10_000,
        };
        let mut go = |b: &mut Balancer, ttft: Option<u64>| {
            let terms = Terms {
                may_hold: true,
                ttft_left_ms: ttft,
                ..Terms::default()
            };
            match b.route_on(long, None, &Chain::NONE, 0, &mut rng, terms, &mut OwnBooks) {
                Outcome::Routed {
                    ticket, compared, ..
                } => {
                    b.release(&ticket, 0);
                    (ticket.node, compared)
                }
                other => panic!("{other:?}"),
            }
        };
        let (node, compared) = go(&mut b, None);
        assert_eq!(node, 0, "{compared:?}");
        let forecast = |n: usize| {
            compared
                .iter()
                .find(|r| r.node == n)
                .and_then(|r| r.first_token_seconds)
                .unwrap()
        };
        assert!(forecast(1) < 0.5 && forecast(0) > 0.5, "{compared:?}");
        let (node, compared) = go(&mut b, Some(500));
        assert_eq!(node, 1, "{compared:?}");
        assert_eq!(
            compared.first().map(|r| r.node),
            Some(1),
            "it heads the header"
        );
    }

    #[test]
    fn the_wait_told_is_the_work_ahead_at_the_fleets_capacity() {
        let mut b = roomy();
        report(&mut b, 0.0, 0);
        let mut q = HoldQueue::new(8, 60_000);
        hold(&mut q, 1, 2_990, claim(5, 0, None), 0, "higher");
        hold(&mut q, 2, 990, claim(-1, 0, None), 0, "lower");
        // 3,000 tokens ahead at priority 0 or above, plus its own 1,000, at 1,000 tokens/s.
        assert_eq!(q.wait_ms(0, w(990), &b, 10), 4_000);
        // Never under a second.
        assert_eq!(q.wait_ms(10, w(90), &b, 10), 1_000);
    }

    /// With `max_queued_ms`, a node whose queued prompts take longer than that is full for a
    /// request that may wait: node 0 has 3 s queued, node 1 half a second; past the limit on
    /// both, the request is held, and one that may not wait goes anyway.
    #[test]
    fn queued_prompts_past_the_limit_hold_a_request_that_may_wait() {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","choices":0,"max_hold_ms":10000,"admission":{"max_queued_ms":1000},
                 "nodes":[{"address":"10.0.0.1:8000","kv_cache_tokens":100000},
                          {"address":"10.0.0.2:8000","kv_cache_tokens":100000}]}"#,
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        let mut rng = SplitMix64::new(17);
        let queued = |b: &mut Balancer, node: usize, q: u32, now: u64| {
            let fields = format!(
                r#""tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"queue_depth":{q},"kv_cache_usage":0"#
            );
            health(b, node, &fields, now);
        };
        // Requests of 110 tokens, before any is learned: the mean request is this one.
        queued(&mut b, 0, 30, 0); // 3.3 s queued
        queued(&mut b, 1, 5, 0); // 0.55 s queued
        let ask = |b: &mut Balancer, rng: &mut SplitMix64, may_hold: bool| {
            b.route(w(100), None, &Chain::NONE, 0, rng, may_hold, &mut OwnBooks)
        };
        match ask(&mut b, &mut rng, true) {
            Outcome::Routed { ticket, .. } => {
                assert_eq!(ticket.node, 1);
                b.release(&ticket, 0);
            }
            other => panic!("{other:?}"),
        }
        queued(&mut b, 1, 12, 10); // 1.3 s queued
        assert_eq!(ask(&mut b, &mut rng, true), Outcome::Saturated);
        assert!(matches!(
            ask(&mut b, &mut rng, false),
            Outcome::Routed {
                over_ceiling: false,
                ..
            }
        ));
    }

    /// `nodes` nodes of 100,000 KV tokens, every node compared, 1 s of queued prompts allowed
    /// and a lane of 100 ms.
    fn lane_balancer(nodes: usize) -> Balancer {
        let nodes: Vec<String> = (1..=nodes)
            .map(|i| format!(r#"{{"address":"10.0.0.{i}:8000","kv_cache_tokens":100000}}"#))
            .collect();
        let cfg = format!(
            r#"{{"health_cluster":"h","choices":0,"max_hold_ms":10000,
                "admission":{{"max_queued_ms":1000,"short_lane_ms":100}},
                "nodes":[{}]}}"#,
            nodes.join(",")
        );
        Balancer::new(&Config::parse(cfg.as_bytes()).unwrap())
    }

    /// Node 0 prefills 10,000 tokens a second with `queue_depth` requests queued; node 1,
    /// 1,000 a second, idle.
    fn fast_queued_and_slow_idle(b: &mut Balancer, queue_depth: u32) {
        health(
            b,
            0,
            &format!(
                r#""tokens_per_sec_load":0,"tokens_per_sec_capacity":10000,"queue_depth":{queue_depth},"kv_cache_usage":0"#
            ),
            0,
        );
        health(
            b,
            1,
            r#""tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"kv_cache_usage":0"#,
            0,
        );
    }

    /// A prompt of `prompt` tokens (500 with its output) from a tenant while another is
    /// active, that may wait, at time 0 (`route_and_release`).
    fn lane_ask(b: &mut Balancer, rng: &mut SplitMix64, prompt: u64) -> Result<usize, Outcome> {
        let terms = Terms {
            may_hold: true,
            lane: true,
            ..Terms::default()
        };
        let weight = Weight {
            prompt_tokens: prompt,
            output_tokens: 500 - prompt,
        };
        route_and_release(b, rng, weight, terms, 0)
    }

    /// Three idle nodes prefilling 1,000 tokens a second, 1 s of queued prompts allowed, a
    /// lane of 100 ms: while another tenant is active, long prompts (0.5 s each) fill two
    /// nodes and never the third, and wait once the two are full; a short one (50 ms) still
    /// starts at once on the third. With no other tenant active the third takes long ones too.
    #[test]
    fn long_prompts_leave_a_short_lane_while_other_tenants_are_active() {
        let fresh = || {
            let mut b = lane_balancer(3);
            for node in 0..3 {
                health(
                    &mut b,
                    node,
                    r#""tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"kv_cache_usage":0"#,
                    0,
                );
            }
            b
        };
        let ask = |b: &mut Balancer, rng: &mut SplitMix64, prompt: u64, lane: bool| {
            let terms = Terms {
                may_hold: true,
                lane,
                ..Terms::default()
            };
            b.route_on(w(prompt), None, &Chain::NONE, 0, rng, terms, &mut OwnBooks)
        };
        let node = |o: &Outcome| match o {
            Outcome::Routed { ticket, .. } => Some(ticket.node),
            _ => None,
        };
        let mut rng = SplitMix64::new(21);
        let mut b = fresh();
        let mut used = [0usize; 3];
        let mut held = 0;
        for _ in 0..8 {
            match node(&ask(&mut b, &mut rng, 500, true)) {
                Some(n) => used[n] += 1,
                None => held += 1,
            }
        }
        let lane = used.iter().position(|&u| u == 0);
        assert!(
            lane.is_some(),
            "one node kept free of long prompts: {used:?}"
        );
        assert!(
            held > 0,
            "the long prompts wait once the other two are full"
        );
        assert_eq!(ask(&mut b, &mut rng, 500, true), Outcome::Saturated);
        // A short prompt takes the lane.
        assert_eq!(node(&ask(&mut b, &mut rng, 50, true)), lane);
        // Without another tenant active, long prompts use every node.
        let mut b = fresh();
        let mut used = [0usize; 3];
        for _ in 0..6 {
            if let Some(n) = node(&ask(&mut b, &mut rng, 500, false)) {
                used[n] += 1;
            }
        }
        assert!(used.iter().all(|&u| u > 0), "{used:?}");
    }

    /// With a lane of 100 ms, a short request goes where its first token comes soonest, even
    /// where the ranking prefers another node: node 0 prefills and decodes ten times faster but
    /// has 150 ms of prompts queued, node 1 none. A prompt ten times longer, short on node 0
    /// but half a second on node 1, starts sooner on node 0 and goes there.
    #[test]
    fn a_short_request_goes_where_its_first_token_comes_soonest() {
        let mut b = lane_balancer(2);
        let mut rng = SplitMix64::new(22);
        // Node 0: 150 ms queued at 10,000 tokens/s (3 requests of the 500-token mean).
        fast_queued_and_slow_idle(&mut b, 3);
        let short = Weight {
            prompt_tokens: 50,
            output_tokens: 450,
        };
        let mut ask = |weight: Weight, lane: bool| {
            let terms = Terms {
                may_hold: true,
                lane,
                ..Terms::default()
            };
            match b.route_on(
                weight,
                None,
                &Chain::NONE,
                0,
                &mut rng,
                terms,
                &mut OwnBooks,
            ) {
                Outcome::Routed { ticket, .. } => ticket.node,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(ask(short, false), 0, "the ranking prefers the fast node");
        assert_eq!(ask(short, true), 1, "the lane takes the short request");
        let longer = Weight {
            prompt_tokens: 500,
            ..short
        };
        assert_eq!(ask(longer, true), 0);
    }

    /// With a lane of 100 ms, the last node in the lane is taken only by a request short
    /// there. Node 0 prefills 10,000 tokens a second and has 900 ms queued (out of the lane,
    /// within the 1 s limit); node 1, 1,000 a second and idle (the lane). A 500-token prompt
    /// is short on node 0 (50 ms) but long on node 1 (500 ms): though its first token would
    /// come sooner on node 1, it leaves the lane to the next short request and goes to node 0.
    /// A 50-token prompt, short on both, takes the lane.
    #[test]
    fn the_last_lane_node_is_taken_only_by_a_request_short_there() {
        let mut b = lane_balancer(2);
        let mut rng = SplitMix64::new(23);
        // 900 ms queued at 10,000 tokens/s: 18 requests of the 500-token mean.
        fast_queued_and_slow_idle(&mut b, 18);
        let mut ask = |prompt: u64| lane_ask(&mut b, &mut rng, prompt);
        assert_eq!(ask(500), Ok(0), "long on the lane node: it stays free");
        assert_eq!(ask(50), Ok(1), "short on the lane node: it takes it");
    }

    /// With a lane of 100 ms and no node in it (short requests took the last one past it),
    /// the node with the shortest queue is the lane: nodes 0 and 1 have 600 and 800 ms
    /// queued, node 2 has 200 ms; a long prompt (500 ms) goes to node 0 or 1, never 2, though
    /// node 2 would start it soonest, and a short one (10 ms) goes to node 2.
    #[test]
    fn with_no_node_in_the_lane_the_shortest_queue_is_kept_for_short_requests() {
        let mut b = lane_balancer(3);
        let mut rng = SplitMix64::new(24);
        // 1,000 tokens/s and the 500-token mean: 600, 800 and 200 ms queued.
        for (node, depth) in [(0, 1.2), (1, 1.6), (2, 0.4)] {
            health(
                &mut b,
                node,
                &format!(
                    r#""tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"queue_depth":{depth},"kv_cache_usage":0"#
                ),
                0,
            );
        }
        let mut ask = |prompt: u64| lane_ask(&mut b, &mut rng, prompt);
        for _ in 0..4 {
            let node = ask(490);
            assert!(matches!(node, Ok(0 | 1)), "{node:?}");
        }
        assert_eq!(ask(10), Ok(2));
    }

    /// Another tenant is active while it has a request held or was served within
    /// `ACTIVE_MS`; a tenant is never active for itself.
    #[test]
    fn other_tenants_are_active_while_held_or_recently_served() {
        let mut q: HoldQueue<()> = HoldQueue::new(8, 10_000);
        assert!(!q.others_active(1, 0));
        q.served(1, 100, 0);
        assert!(!q.others_active(1, 0));
        assert!(q.others_active(2, 0));
        assert!(q.others_active(2, ACTIVE_MS));
        assert!(!q.others_active(2, ACTIVE_MS + 1));
        // Three tenants: whichever asks, the latest other one is remembered.
        q.served(2, 100, 1_000);
        q.served(3, 100, 2_000);
        q.served(3, 100, 3_000);
        for t in [1, 2, 3, 4] {
            assert!(q.others_active(t, 3_000), "tenant {t}");
        }
        // Tenant 2, last served at 1 s, is active for tenant 3 until `ACTIVE_MS` later.
        assert!(q.others_active(3, 1_000 + ACTIVE_MS));
        assert!(!q.others_active(3, 1_000 + ACTIVE_MS + 1));
        // A request held counts until it leaves.
        let claim = Claim {
            tenant: 5,
            ..Claim::default()
        };
        q.push(Held::new(1, w(10), None, Chain::NONE, 50_000, ()).claiming(claim, 0))
            .unwrap();
        assert!(q.others_active(3, 50_000));
        assert!(!q.others_active(5, 50_000));
        q.remove(1);
        assert!(!q.others_active(3, 50_000));
    }

    /// Node 0 decoded its last streams at 80 ms a token, node 1 at 20: a 50-ms budget per token
    /// goes to node 1 whatever the ranking says; a 10-ms one is told to come back; once the
    /// slow figure is older than `TPOT_MEMORY` reports' worth it no longer counts.
    #[test]
    fn a_time_per_token_budget_avoids_the_nodes_that_decode_slower() {
        let mut b = budget_fleet(2);
        let mut rng = SplitMix64::new(18);
        // Node 0 is the faster by capacity: it ranks first.
        idle(&mut b, 0, 10_000, 0);
        idle(&mut b, 1, 1_000, 0);
        completed(&mut b, 0, 0, 0.080, 0);
        completed(&mut b, 1, 0, 0.020, 0);
        let mut go = |b: &mut Balancer, tpot: Option<u64>, now: u64| {
            let terms = Terms {
                tpot_ms: tpot,
                ..Terms::default()
            };
            route_and_release(b, &mut rng, w(100), terms, now)
        };
        assert_eq!(go(&mut b, None, 10), Ok(0));
        assert_eq!(go(&mut b, Some(50), 10), Ok(1));
        assert_eq!(
            go(&mut b, Some(10), 10),
            Err(Outcome::TooLate {
                retry_after_ms: 1000
            })
        );
        // Five stale-after periods later, with fresh reports, the figures are forgotten.
        idle(&mut b, 0, 10_000, 10_001);
        idle(&mut b, 1, 1_000, 10_001);
        assert_eq!(go(&mut b, Some(10), 10_002), Ok(0));
        // A new stream's figure moves the mean by a fifth, not replaces it: 20, 24, 23.2 ms.
        completed(&mut b, 1, 0, 0.040, 10_002);
        completed(&mut b, 1, 0, 0.020, 10_003);
        assert_eq!(
            b.nodes()[1]
                .tpot_since(10_000)
                .map(|t| (t * 10_000.0).round()),
            Some(232.0)
        );
    }

    /// A stream in flight with a budget of 30 ms a token, on a node that decodes at 20 ms,
    /// leaves 10 ms a token of room: over its 200 tokens still to come, 2 s of prefill at the
    /// node's 10,000 tokens/s. A prompt that takes longer than that to reach its first token
    /// there goes elsewhere, waits, or is told to come back; one that fits goes; once the
    /// stream ends, the room is back.
    #[test]
    fn streams_with_a_time_per_token_budget_keep_long_prefills_off_their_node() {
        // Idle, and seen decoding at 20 ms a token.
        let decoding = |b: &mut Balancer, node: usize, cap: u32| {
            idle(b, node, cap, 0);
            completed(b, node, 0, 0.020, 0);
        };
        let mut rng = SplitMix64::new(7);
        let mut go = |b: &mut Balancer, prompt: u64, terms: Terms| {
            let weight = Weight {
                prompt_tokens: prompt,
                output_tokens: 200,
            };
            b.route_on(
                weight,
                None,
                &Chain::NONE,
                10,
                &mut rng,
                terms,
                &mut OwnBooks,
            )
        };
        let node = |o: &Outcome| match o {
            Outcome::Routed { ticket, .. } => Some(ticket.node),
            _ => None,
        };
        let budget = Terms {
            tpot_ms: Some(30),
            ..Terms::default()
        };
        let wait = Terms {
            may_hold: true,
            ..Terms::default()
        };

        // Two nodes: the long prompt goes to the slow one rather than stall the stream.
        let mut b = budget_fleet(2);
        decoding(&mut b, 0, 10_000);
        decoding(&mut b, 1, 1_000);
        let stream = go(&mut b, 100, budget);
        assert_eq!(node(&stream), Some(0));
        assert_eq!(b.nodes()[0].tightest_budget_ms(), Some(30));
        // 300 tokens in flight and 15,000 of its own: 1.53 s of prefill, within the room.
        let fits = go(&mut b, 15_000, Terms::default());
        assert_eq!(node(&fits), Some(0));
        if let Outcome::Routed { ticket, .. } = fits {
            b.release(&ticket, 0);
        }
        // 25,000: 2.53 s, past it.
        assert_eq!(node(&go(&mut b, 25_000, Terms::default())), Some(1));

        // One node: the long prompt waits, or with a budget of its own is told to come back,
        // or, with neither, goes anyway (there is nowhere to protect the stream from it).
        let mut b = budget_fleet(1);
        decoding(&mut b, 0, 10_000);
        let Outcome::Routed { ticket, .. } = go(&mut b, 100, budget) else {
            panic!("the stream is routed");
        };
        assert_eq!(go(&mut b, 25_000, wait), Outcome::Saturated);
        let ttft = Terms {
            ttft_left_ms: Some(60_000),
            ..wait
        };
        assert_eq!(
            go(&mut b, 25_000, ttft),
            Outcome::TooLate {
                retry_after_ms: 1000
            }
        );
        assert_eq!(node(&go(&mut b, 25_000, Terms::default())), Some(0));
        // The stream ends: its budget no longer holds the node.
        b.release(&ticket, 200);
        assert_eq!(b.nodes()[0].tightest_budget_ms(), None);
        assert_eq!(node(&go(&mut b, 25_000, wait)), Some(0));
    }

    /// Node 0 starts a 5,000-token prompt in 0.5 s but decodes at 40 ms a token; node 1
    /// decodes at 10 ms but starts it in 5 s. A request asking for both 2 s and 30 ms meets
    /// one budget on each node and both on none: it is told to come back, not sent to the
    /// node that meets its first budget to miss the other. With only one of the budgets it
    /// goes where that one is met.
    #[test]
    fn a_request_no_node_serves_within_all_its_budgets_is_told_to_come_back() {
        let mut b = budget_fleet(2);
        let mut rng = SplitMix64::new(11);
        idle(&mut b, 0, 10_000, 0);
        idle(&mut b, 1, 1_000, 0);
        completed(&mut b, 0, 0, 0.040, 0);
        completed(&mut b, 1, 0, 0.010, 0);
        let mut go = |b: &mut Balancer, ttft: Option<u64>, tpot: Option<u64>| {
            let terms = Terms {
                ttft_left_ms: ttft,
                tpot_ms: tpot,
                ..Terms::default()
            };
            route_and_release(b, &mut rng, w(5_000), terms, 10)
        };
        assert_eq!(
            go(&mut b, Some(2_000), Some(30)),
            Err(Outcome::TooLate {
                retry_after_ms: 1000
            })
        );
        assert_eq!(go(&mut b, Some(2_000), None), Ok(0));
        assert_eq!(go(&mut b, None, Some(30)), Ok(1));
    }

    /// The first stream of a burst, on a node whose figures have aged out since it was last
    /// seen decoding (at 20 ms a token): with nothing measured since, the stream is reckoned
    /// at the 20 ms it was sent with, so a long prompt right behind it goes elsewhere.
    #[test]
    fn a_burst_on_a_node_not_measured_lately_still_protects_its_first_stream() {
        let mut b = budget_fleet(2);
        let mut rng = SplitMix64::new(3);
        idle(&mut b, 0, 10_000, 0);
        idle(&mut b, 1, 1_000, 0);
        completed(&mut b, 0, 0, 0.020, 0);
        // Much later: fresh reports, the completed streams' figure too old to be recent.
        idle(&mut b, 0, 10_000, 60_000);
        idle(&mut b, 1, 1_000, 60_000);
        let mut go = |b: &mut Balancer, prompt: u64, terms: Terms| {
            let weight = Weight {
                prompt_tokens: prompt,
                output_tokens: 200,
            };
            match b.route_on(
                weight,
                None,
                &Chain::NONE,
                60_001,
                &mut rng,
                terms,
                &mut OwnBooks,
            ) {
                Outcome::Routed { ticket, .. } => Some(ticket.node),
                _ => None,
            }
        };
        let budget = Terms {
            tpot_ms: Some(30),
            ..Terms::default()
        };
        assert_eq!(go(&mut b, 100, budget), Some(0));
        // 2.5 s of prefill on node 0, past the 2 s its stream leaves at 20 ms a token.
        assert_eq!(go(&mut b, 25_000, Terms::default()), Some(1));
    }

    /// Long contexts (a tenth of the cache or more) decoded at 40 ms a token on node 0, short
    /// streams at 20: a long prompt that accepts 30 ms a token goes to node 1, a short one
    /// stays on node 0, however long ago the long contexts completed.
    #[test]
    fn a_long_prompt_is_judged_by_the_long_contexts_time_per_token() {
        let mut b = budget_fleet(2);
        let mut rng = SplitMix64::new(5);
        idle(&mut b, 0, 10_000, 0);
        idle(&mut b, 1, 5_000, 0);
        completed(&mut b, 0, 20_000, 0.040, 0);
        // The node's figure: 40, then a fifth of the way to 20 five times (26.6 ms).
        for _ in 0..5 {
            completed(&mut b, 0, 100, 0.020, 0);
        }
        let mut go = |b: &mut Balancer, prompt: u64, now: u64| {
            let terms = Terms {
                tpot_ms: Some(30),
                ..Terms::default()
            };
            route_and_release(b, &mut rng, w(prompt), terms, now).ok()
        };
        assert_eq!(go(&mut b, 100, 10), Some(0));
        assert_eq!(go(&mut b, 9_999, 10), Some(0));
        assert_eq!(go(&mut b, 10_000, 10), Some(1));
        // Later, with fresh reports: the short streams' figure is forgotten, the long ones' not.
        idle(&mut b, 0, 10_000, 20_000);
        idle(&mut b, 1, 5_000, 20_000);
        assert_eq!(go(&mut b, 100, 20_001), Some(0));
        assert_eq!(go(&mut b, 10_000, 20_001), Some(1));
    }

    /// Running streams' pace is measured only while requests with a time-per-token budget are
    /// routed: none before the first, while one runs, and for `PACE_MEMORY` stale-after
    /// periods (2 s each here) after the last.
    #[test]
    fn the_pace_is_wanted_only_while_budgets_are_in_use() {
        let mut b = budget_fleet(1);
        let mut rng = SplitMix64::new(3);
        idle(&mut b, 0, 1_000, 0);
        assert!(!b.paces_wanted(10));
        let mut go = |b: &mut Balancer, tpot_ms| {
            let terms = Terms {
                tpot_ms,
                ..Terms::default()
            };
            match b.route_on(
                w(10),
                None,
                &Chain::NONE,
                10,
                &mut rng,
                terms,
                &mut OwnBooks,
            ) {
                Outcome::Routed { ticket, .. } => ticket,
                other => panic!("{other:?}"),
            }
        };
        let plain = go(&mut b, None);
        assert!(!b.paces_wanted(10), "no budget in use");
        b.release(&plain, 0);
        let budgeted = go(&mut b, Some(50));
        assert!(b.paces_wanted(10_000_000), "a budgeted stream runs");
        b.release(&budgeted, 0);
        assert!(b.paces_wanted(60_010));
        assert!(!b.paces_wanted(60_011));
    }

    /// A full queue makes room for a higher priority by shedding the lowest, the latest of
    /// them first; an equal or lower priority finds it full.
    #[test]
    fn a_full_queue_sheds_lower_priorities_for_a_higher_one() {
        let mut q: HoldQueue<&'static str> = HoldQueue::new(3, 60_000).with_max_bytes(1_000);
        let held = |id, p: i32, bytes, name| {
            Held::new(id, w(10), None, Chain::NONE, u64::from(id), name)
                .claiming(claim(p, 0, None), bytes)
        };
        let names =
            |v: Vec<Held<&'static str>>| v.into_iter().map(|h| h.payload).collect::<Vec<_>>();
        assert!(q.push(held(1, 0, 100, "standard")).is_ok());
        assert!(q.push(held(2, -5, 100, "batch, early")).is_ok());
        assert!(q.push(held(3, -5, 100, "batch, late")).is_ok());
        assert_eq!(
            q.push(held(4, -5, 100, "batch, full"))
                .map(|v| v.len())
                .map_err(|h| h.payload),
            Err("batch, full")
        );
        assert_eq!(
            names(q.push(held(5, 10, 100, "premium")).unwrap()),
            vec!["batch, late"]
        );
        // Bytes: 700 more need one more out, the lowest first.
        assert_eq!(
            names(q.push(held(6, 10, 700, "premium, large")).unwrap()),
            vec!["batch, early"]
        );
        assert_eq!(q.bytes(), 900);
        // Another premium takes the last standard's place; then nothing below 10 is left.
        assert_eq!(
            q.push(held(7, 10, 100, "premium, third"))
                .map(|v| v.len())
                .map_err(|h| h.payload),
            Ok(1)
        );
        assert_eq!(
            q.push(held(8, 10, 100, "premium, fourth"))
                .map(|v| v.len())
                .map_err(|h| h.payload),
            Err("premium, fourth")
        );
        assert_eq!(q.len(), 3);
    }
}
