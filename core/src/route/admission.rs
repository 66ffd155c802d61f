//! Admission under saturation: hold a request at the gateway while every node is predicted
//! over its VRAM ceiling, and bind it to a node only when one has room (late binding).
//!
//! Without this, a request that no node can take still has to go somewhere: it lands in the
//! least-full node's own queue, the engine admits it as soon as the prompt fits, and when the
//! running sequences then grow past the cache the engine preempts one (a VRAM-overflow event,
//! and the recompute costs the whole batch). Holding the request in the filter instead keeps
//! the choice open until a stream ends or a fresh report shows room, and then gives it to the
//! node that has room at that moment, not the one that looked least bad when it arrived. This
//! is the late-binding argument of Llumnix (OSDI '24) and of the Kubernetes inference gateway's
//! flow control, applied inside one Envoy worker.
//!
//! The queue is first in, first out: a large request at the head is not overtaken by small
//! ones forever. Nothing is ever dropped: a request held for `max_hold_ms` is routed anyway, to
//! the node that overflows least, and a full queue routes new requests at once the same way.
//! The queue is generic over what the glue keeps per request, so it is tested natively.
//!
//! A held request keeps its model: it is admitted only to a node serving it, with the sets
//! known when it leaves (a list learned meanwhile counts), so it may also leave as
//! `UnknownModel` if the last node serving its model stopped listing it.

use crate::ingest::prompt::Chain;
use crate::ingest::request::Weight;
use crate::rng::Rng;
use crate::route::balancer::{Balancer, BookSource, Outcome};
use std::collections::VecDeque;

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
    pub since_ms: u64,
    pub payload: T,
}

/// The requests held by one filter instance, oldest first.
#[derive(Debug)]
pub struct HoldQueue<T> {
    entries: VecDeque<Held<T>>,
    max_len: usize,
    max_hold_ms: u64,
}

impl<T> HoldQueue<T> {
    /// A queue of at most `max_len` requests, each held at most `max_hold_ms`. Either at zero
    /// disables holding.
    pub fn new(max_len: usize, max_hold_ms: u64) -> Self {
        HoldQueue {
            entries: VecDeque::new(),
            max_len,
            max_hold_ms,
        }
    }

    /// Whether a request that finds every node over the ceiling may wait here now.
    pub fn may_hold(&self) -> bool {
        self.max_hold_ms > 0 && self.entries.len() < self.max_len
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Holds a request. A full or disabled queue gives the payload back: route it now.
    pub fn push(
        &mut self,
        id: u32,
        weight: Weight,
        model: Option<String>,
        chain: Chain,
        now_ms: u64,
        payload: T,
    ) -> Result<(), T> {
        if !self.may_hold() {
            return Err(payload);
        }
        self.entries.push_back(Held {
            id,
            weight,
            model,
            chain,
            since_ms: now_ms,
            payload,
        });
        Ok(())
    }

    /// Takes a request out of the queue without routing it (its stream ended while held).
    pub fn remove(&mut self, id: u32) -> Option<Held<T>> {
        let at = self.entries.iter().position(|h| h.id == id)?;
        self.entries.remove(at)
    }

    /// Empties the queue, oldest first (the plugin is being reconfigured: its requests must
    /// not wait for a balancer that is gone).
    pub fn drain(&mut self) -> impl Iterator<Item = Held<T>> + '_ {
        self.entries.drain(..)
    }

    /// Routes held requests from the head for as long as the balancer finds them a node with
    /// room, deciding with the books `books` gives (see `Balancer::route`); a request held past
    /// `max_hold_ms` is routed even over the ceiling. Stops at the first request that must keep
    /// waiting, so the order of arrival is kept.
    pub fn admit(
        &mut self,
        now_ms: u64,
        balancer: &mut Balancer,
        rng: &mut dyn Rng,
        books: &mut dyn BookSource,
    ) -> Vec<(Held<T>, Outcome)> {
        let mut out = Vec::new();
        while let Some(head) = self.entries.front() {
            let expired = now_ms.saturating_sub(head.since_ms) >= self.max_hold_ms;
            let outcome = balancer.route(
                head.weight,
                head.model.as_deref(),
                &head.chain,
                now_ms,
                rng,
                !expired,
                books,
            );
            if matches!(outcome, Outcome::Saturated) {
                break;
            }
            match self.entries.pop_front() {
                Some(held) => out.push((held, outcome)),
                None => break,
            }
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

    fn w(prompt: u64) -> Weight {
        Weight {
            prompt_tokens: prompt,
            output_tokens: 10,
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
        q.push(1, w(100), None, Chain::NONE, 0, "first").unwrap();
        q.push(2, w(20), None, Chain::NONE, 10, "second").unwrap();
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
        q.push(1, w(600), None, Chain::NONE, 0, ()).unwrap(); // 500 + 600 + 10 > 900
        q.push(2, w(10), None, Chain::NONE, 0, ()).unwrap(); // would fit on its own
        assert!(q.admit(10, &mut b, &mut rng, &mut OwnBooks).is_empty());
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn a_request_held_too_long_is_routed_over_the_ceiling() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(3);
        report(&mut b, 0.95, 0);
        let mut q = HoldQueue::new(8, 1_000);
        q.push(1, w(10), None, Chain::NONE, 0, ()).unwrap();
        q.push(2, w(10), None, Chain::NONE, 600, ()).unwrap();
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
    fn stale_telemetry_releases_everything_to_the_fallback() {
        let mut b = balancer();
        let mut rng = SplitMix64::new(4);
        report(&mut b, 0.95, 0);
        let mut q = HoldQueue::new(8, 1_000_000);
        q.push(1, w(10), None, Chain::NONE, 0, ()).unwrap();
        // Long after the report went stale, no node is fresh: the request leaves for Envoy's
        // own balancer instead of waiting for a report that may never come.
        let out = q.admit(100_000, &mut b, &mut rng, &mut OwnBooks);
        assert!(matches!(out[0].1, Outcome::NoFreshNodes));
    }

    #[test]
    fn bounds_and_disabling() {
        let mut q = HoldQueue::new(2, 1_000);
        assert!(q.push(1, w(1), None, Chain::NONE, 0, 'a').is_ok());
        assert!(q.push(2, w(1), None, Chain::NONE, 0, 'b').is_ok());
        assert_eq!(q.push(3, w(1), None, Chain::NONE, 0, 'c'), Err('c'));
        assert_eq!(q.remove(1).map(|h| h.payload), Some('a'));
        assert!(q.remove(1).is_none());
        assert!(q.may_hold());
        assert!(q.push(4, w(1), None, Chain::NONE, 0, 'd').is_ok());
        assert_eq!(q.drain().map(|h| h.payload).collect::<String>(), "bd");
        assert!(q.is_empty());
        let mut off: HoldQueue<char> = HoldQueue::new(8, 0);
        assert!(!off.may_hold());
        assert_eq!(off.push(1, w(1), None, Chain::NONE, 0, 'x'), Err('x'));
        let mut none: HoldQueue<char> = HoldQueue::new(0, 1_000);
        assert_eq!(none.push(1, w(1), None, Chain::NONE, 0, 'y'), Err('y'));
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
        q.push(1, w(10), Some("m1".to_string()), Chain::NONE, 0, "m1")
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
        q.push(
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
            q.push(id, w(100), None, Chain::NONE, 0, id).unwrap();
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
}
