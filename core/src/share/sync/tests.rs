//! The sync protocol against an in-memory store: what a reader takes in, what it costs, when
//! the fleet is unusable and why, what the service writes, and how the books keys follow.

use super::*;
use crate::config::Config;
use crate::fleet::node::{tenant_of, Ticket};
use crate::ingest::request::Weight;
use crate::route::balancer::{Balancer, BookSource};
use crate::share::testing::FakeStore;
use crate::share::{books_key, Books, Change, Store, Version, FLEET_KEY, VERSION_KEY};

/// Envoy's shared data as the host keeps it (see `share::testing`).
type Mem = FakeStore;

/// What the store holds, decoded.
trait Holds {
    fn books(&self, key: &str) -> Books;
    fn version(&self) -> Version;
}

impl Holds for Mem {
    fn books(&self, key: &str) -> Books {
        Books::decode(&self.data[key].0).unwrap()
    }

    fn version(&self) -> Version {
        Version::decode(&self.data[VERSION_KEY].0).unwrap()
    }
}

const A: &str = "127.0.0.1:8001";
const B: &str = "127.0.0.1:8002";
const C: &str = "127.0.0.1:8003";
const STALE: u64 = 3000;

fn balancer(addresses: &[&str]) -> Balancer {
    let nodes: Vec<String> = addresses
        .iter()
        .map(|a| format!(r#"{{"address":"{a}"}}"#))
        .collect();
    let json = format!(r#"{{"nodes":[{}],"health_cluster":"h"}}"#, nodes.join(","));
    Balancer::new(&Config::parse(json.as_bytes()).unwrap())
}

fn following() -> Balancer {
    let json = r#"{"health_cluster":"h","membership":{"cluster":"c","admin_cluster":"a"}}"#;
    Balancer::new(&Config::parse(json.as_bytes()).unwrap())
}

fn report(b: &mut Balancer, node: usize, now: u64) {
    let body = br#"{"tokens_per_sec_load":100,"tokens_per_sec_capacity":1000}"#;
    b.on_health(node, Some(body), now).unwrap();
}

/// A service over `addresses` that has created the books and published once at `now`.
fn started(store: &mut Mem, addresses: &[&str], now: u64) -> (Service, Balancer) {
    let mut b = balancer(addresses);
    report(&mut b, 0, now);
    let mut s = Service::new(addresses.iter().copied(), now);
    assert_eq!(s.claim_all(store), Counts::default());
    assert_eq!(s.publish(store, &b, now).published, 1);
    (s, b)
}

fn ticket(node: usize, address: &str) -> Ticket {
    Ticket {
        node,
        tenant: tenant_of(address),
        epoch: 0,
        weight: Weight {
            prompt_tokens: 100,
            output_tokens: 50,
        },
        reserved_output: 60,
        cached: 0,
        tpot_ms: None,
        stream: 0,
        // No balancer has generation 0: the node is found by its address (`Balancer::holder`).
        generation: 0,
        text_prompt: 0,
    }
}

#[test]
fn a_reader_takes_in_what_the_service_publishes() {
    let mut store = Mem::default();
    started(&mut store, &[A, B], 1000);
    let mut r = Reader::default();
    let mut rb = balancer(&[A, B]);
    let synced = r.sync(&mut store, &mut rb, 1005, STALE);
    assert!(synced.usable);
    assert!(synced.new_reports, "node A's report came with the snapshot");
    assert_eq!(synced.counts.imported, 1);
    assert_eq!(synced.event, Some(FleetEvent::InUse));
    assert_eq!(synced.lacking, 0);
    assert!(rb.nodes()[0].report_taken().is_some());
    assert!(rb.nodes()[1].report_taken().is_none());
    assert_eq!(r.key(1), Some(&BookKey::new(1, tenant_of(B))));
}

#[test]
fn an_unchanged_version_costs_one_get_and_a_recent_look_none() {
    let mut store = Mem::default();
    started(&mut store, &[A], 1000);
    let (mut r, mut rb) = (Reader::default(), balancer(&[A]));
    assert!(r.sync(&mut store, &mut rb, 1000, STALE).usable);
    let calls = store.calls;
    let again = r.sync(&mut store, &mut rb, 1005, STALE);
    assert!(again.usable);
    assert_eq!(
        store.calls, calls,
        "within VERSION_RECHECK_MS: no look at all"
    );
    let later = r.sync(&mut store, &mut rb, 1000 + VERSION_RECHECK_MS, STALE);
    assert!(later.usable);
    assert_eq!(store.calls, calls + 1, "the version record only");
    assert_eq!(later.counts, Counts::default());
    assert_eq!(later.event, None);
    assert!(!later.new_reports);
}

#[test]
fn a_stale_heartbeat_makes_the_fleet_unusable_until_a_new_snapshot() {
    let mut store = Mem::default();
    let (mut s, mut sb) = started(&mut store, &[A], 1000);
    let (mut r, mut rb) = (Reader::default(), balancer(&[A]));
    assert!(r.sync(&mut store, &mut rb, 1000, STALE).usable);
    let late = 1000 + STALE + 1;
    let lost = r.sync(&mut store, &mut rb, late, STALE);
    assert!(!lost.usable);
    assert_eq!(lost.event, Some(FleetEvent::Lost(Lost::Stale)));
    let still = r.sync(&mut store, &mut rb, late + 20, STALE);
    assert!(!still.usable);
    assert_eq!(still.event, None, "said once until it is back");
    // The service is back with news: the fleet is in use again.
    report(&mut sb, 0, late + 30);
    s.publish(&mut store, &sb, late + 30);
    let back = r.sync(&mut store, &mut rb, late + 40, STALE);
    assert!(back.usable);
    assert_eq!(back.event, Some(FleetEvent::InUse));
}

#[test]
fn an_unreadable_or_missing_snapshot_is_unusable_with_its_reason() {
    let mut store = Mem::default();
    let (mut r, mut rb) = (Reader::default(), balancer(&[A]));
    let none = r.sync(&mut store, &mut rb, 1000, STALE);
    assert!(!none.usable);
    assert_eq!(none.event, Some(FleetEvent::Lost(Lost::NoSnapshot)));
    assert_eq!(none.counts, Counts::default());

    let mut store = Mem::default();
    let record = Version {
        version: 5,
        heartbeat_ms: 1000,
    };
    store.set(VERSION_KEY, &record.encode(), None).unwrap();
    store.set(FLEET_KEY, b"not a snapshot", None).unwrap();
    let mut r = Reader::default();
    let bad = r.sync(&mut store, &mut rb, 1000, STALE);
    assert!(!bad.usable);
    assert_eq!(bad.event, Some(FleetEvent::Lost(Lost::Unreadable)));
    assert_eq!(bad.counts.failed, 1);
    assert_eq!(
        Lost::Unreadable.to_string(),
        "the fleet snapshot is unreadable"
    );

    // A store that fails counts its failures, and the fleet is not usable.
    let mut r = Reader::default();
    store.fail = true;
    let failing = r.sync(&mut store, &mut rb, 1000, STALE);
    assert!(!failing.usable);
    assert_eq!(failing.counts.failed, 1);
}

#[test]
fn the_service_publishes_only_changes_but_always_its_heartbeat() {
    let mut store = Mem::default();
    let (mut s, mut b) = started(&mut store, &[A], 1000);
    let first = store.version();
    assert_eq!(
        first.version, 1001,
        "versions start after the service's start time"
    );
    let fleet_cas = store.data[FLEET_KEY].1;
    let quiet = s.publish(&mut store, &b, 1100);
    assert_eq!(quiet, Counts::default(), "nothing published");
    assert_eq!(
        store.data[FLEET_KEY].1, fleet_cas,
        "the snapshot was not written"
    );
    assert_eq!(
        store.version(),
        Version {
            version: 1001,
            heartbeat_ms: 1100
        }
    );
    report(&mut b, 0, 1200);
    assert_eq!(s.publish(&mut store, &b, 1200).published, 1);
    assert_eq!(store.version().version, 1002);
    // A failing store: counted, and the version does not move.
    store.fail = true;
    report(&mut b, 0, 1300);
    assert_eq!(s.publish(&mut store, &b, 1300).failed, 2);
    store.fail = false;
    assert_eq!(s.publish(&mut store, &b, 1400).published, 1);
    assert_eq!(store.version().version, 1003);
}

#[test]
fn a_reused_slot_has_its_books_claimed_for_the_new_address_once_empty() {
    let mut store = Mem::default();
    let mut b = following();
    let mut s = Service::new(std::iter::empty(), 1000);
    let addresses = |list: &[&str]| list.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let (change, counts) = s.follow_members(&mut store, &mut b, &addresses(&[A, B]));
    assert_eq!((change.joined, counts), (vec![0, 1], Counts::default()));
    assert_eq!(store.books(&books_key(0)).tenant, tenant_of(A));
    // A worker has a request in flight on A when A leaves: its slot is not reused.
    let mut busy = Books::of(tenant_of(A));
    busy.inflight_requests = 1;
    store.set(&books_key(0), &busy.encode(), None).unwrap();
    let (change, _) = s.follow_members(&mut store, &mut b, &addresses(&[B, C]));
    assert_eq!((change.joined, change.left), (vec![2], vec![0]));
    assert_eq!(store.books(&books_key(0)).tenant, tenant_of(A));
    assert_eq!(s.key(2), Some(&BookKey::new(2, tenant_of(C))));
    // Once A's books are empty, the next new address takes slot 0 and its books.
    store
        .set(&books_key(0), &Books::of(tenant_of(A)).encode(), None)
        .unwrap();
    let d = "127.0.0.1:8004";
    let (change, counts) = s.follow_members(&mut store, &mut b, &addresses(&[B, C, d]));
    assert_eq!((change.joined, counts), (vec![0], Counts::default()));
    assert_eq!(store.books(&books_key(0)).tenant, tenant_of(d));
    assert_eq!(s.key(0), Some(&BookKey::new(0, tenant_of(d))));
    // A store that cannot be read keeps every departed slot busy.
    store.fail = true;
    let (change, counts) = s.follow_members(&mut store, &mut b, &addresses(&[B]));
    assert_eq!(change.left.len(), 2);
    assert_eq!(counts, Counts::default(), "no slot claimed, nothing failed");
}

#[test]
fn books_keys_follow_the_snapshot_by_address() {
    let mut store = Mem::default();
    started(&mut store, &[A, B, C], 1000);
    let mut r = Reader::default();
    // The reader lists the nodes in another order, and one the poller does not have.
    let d = "127.0.0.1:8004";
    let mut rb = balancer(&[C, d, A]);
    let synced = r.sync(&mut store, &mut rb, 1000, STALE);
    assert!(synced.usable);
    assert_eq!(synced.lacking, 1, "node D is not in the poller's fleet");
    assert_eq!(r.key(0), Some(&BookKey::new(2, tenant_of(C))));
    assert_eq!(r.key(1), None);
    assert_eq!(r.key(2), Some(&BookKey::new(0, tenant_of(A))));
    // A write for D goes nowhere; one for A lands in slot 0's books.
    assert_eq!(
        r.write(
            &mut store,
            &rb,
            &ticket(1, d),
            Change::dispatch(&ticket(1, d)),
            None
        ),
        Counts::default()
    );
    let t = ticket(2, A);
    assert_eq!(
        r.write(&mut store, &rb, &t, Change::dispatch(&t), None),
        Counts::default()
    );
    assert_eq!(store.books(&books_key(0)).inflight_requests, 1);
}

#[test]
fn changes_kept_for_later_are_flushed_once_the_books_exist() {
    let mut store = Mem::default();
    let mut sb = balancer(&[A]);
    report(&mut sb, 0, 1000);
    let mut s = Service::new([A], 1000);
    // Published before the books were made (a store that failed at the start).
    s.publish(&mut store, &sb, 1000);
    let (mut r, mut rb) = (Reader::default(), balancer(&[A]));
    assert!(r.sync(&mut store, &mut rb, 1000, STALE).usable);
    let t = ticket(0, A);
    let missing = r.write(&mut store, &rb, &t, Change::dispatch(&t), None);
    assert_eq!(missing.books_missing, 1);
    assert_eq!(r.pending(), 1);
    assert_eq!(s.claim_all(&mut store), Counts::default());
    assert_eq!(r.flush(&mut store, &rb), Counts::default());
    assert_eq!(r.pending(), 0);
    assert_eq!(store.books(&books_key(0)).inflight_requests, 1);
    let calls = store.calls;
    assert_eq!(r.flush(&mut store, &rb), Counts::default());
    assert_eq!(store.calls, calls, "nothing kept: no store call");
    // A release after the slot went to another address is dropped.
    store
        .set(&books_key(0), &Books::of(tenant_of(B)).encode(), None)
        .unwrap();
    let gone = r.write(&mut store, &rb, &t, Change::release(&t, 0), None);
    assert_eq!(gone.books_gone, 1);
    assert_eq!(r.pending(), 0);
}

#[test]
fn a_decision_reads_the_weighed_nodes_books_and_counts_failures() {
    let mut store = Mem::default();
    started(&mut store, &[A, B], 1000);
    let (mut r, mut rb) = (Reader::default(), balancer(&[A, B]));
    r.sync(&mut store, &mut rb, 1000, STALE);
    let mut books = r.books(&mut store);
    assert!(books.books(1, 0).is_some());
    assert!(books.books(5, 0).is_none(), "no such node: no read");
    let (reads, counts) = books.finish();
    assert_eq!(counts, Counts::default());
    let read = reads.clone().take(1).expect("node B's read");
    assert_eq!(Books::decode(&read.0).unwrap().tenant, tenant_of(B));
    assert!(reads.take(0).is_none());
    store.fail = true;
    let mut books = r.books(&mut store);
    assert!(books.books(0, 0).is_none());
    assert_eq!(books.finish().1.failed, 1);
}

#[test]
fn counts_follow_what_each_write_became() {
    let mut c = Counts::of(Written::Yes {
        books: Books::default(),
        retries: 2,
    });
    c.add(Written::Exhausted);
    c.add(Written::Missing);
    c.add(Written::Gone);
    c.add(Written::Failed);
    assert_eq!(
        c,
        Counts {
            failed: 1,
            cas_retries: 2 + MAX_CAS_RETRIES,
            cas_exhausted: 1,
            books_missing: 1,
            books_gone: 1,
            published: 0,
            imported: 0,
            wakes_lost: 0,
        }
    );
}

#[test]
fn placements_reach_the_other_readers_index_by_slot_and_never_a_new_tenant() {
    use crate::ingest::prompt::Chain;
    use crate::rng::SplitMix64;
    use crate::route::balancer::{Outcome, OwnBooks};
    let mut store = Mem::default();
    let (_s, mut sb) = started(&mut store, &[A, B], 1000);
    report(&mut sb, 1, 1000);
    let (mut r1, mut b1) = (Reader::default(), balancer(&[A, B]));
    let (mut r2, mut b2) = (Reader::default(), balancer(&[B, A]));
    b1.keep_placements(true);
    for (r, b) in [(&mut r1, &mut b1), (&mut r2, &mut b2)] {
        assert!(r.sync(&mut store, b, 1000, STALE).usable);
    }
    let chain = Chain {
        blocks: vec![11, 12, 13],
        rendered: 3 * 256,
        block_chars: 256,
        hint: None,
    };
    let weight = Weight {
        prompt_tokens: 192,
        output_tokens: 10,
    };
    let out = b1.route(
        weight,
        None,
        &chain,
        1000,
        &mut SplitMix64::new(7),
        false,
        &mut OwnBooks,
    );
    let Outcome::Routed { ticket, .. } = out else {
        panic!("{out:?}")
    };
    let address = b1.nodes()[ticket.node].address().to_string();
    assert_eq!(
        r1.publish_placements(&mut store, &mut b1, 1000).published,
        1
    );
    assert!(b1.take_placements().is_empty(), "taken once");
    // The second reader lists the nodes in another order: found by slot and address.
    let taken = r2.follow_placements(&mut store, &mut b2, 1000);
    assert_eq!((taken.taken, taken.missed), (1, 0));
    let there = b2
        .nodes()
        .iter()
        .position(|n| n.address() == address)
        .unwrap();
    let ix = b2.prefixes().unwrap();
    assert_eq!(ix.matched(there, &chain.blocks), 3);
    assert_eq!(ix.matched(1 - there, &chain.blocks), 0);
    // A placement whose slot now counts for another address is dropped.
    let slot = r1.key(ticket.node).unwrap().slot;
    r1.journal
        .place(&mut store, 1010, slot, tenant_of("10.9.9.9:1"), &[21, 22]);
    assert_eq!(
        r2.follow_placements(&mut store, &mut b2, 1000 + 10).taken,
        1
    );
    let ix = b2.prefixes().unwrap();
    assert_eq!(ix.matched(there, &[21, 22]), 0);
    assert_eq!(ix.matched(1 - there, &[21, 22]), 0);
}

#[test]
fn the_service_sees_which_slots_have_prompts_not_started() {
    let mut store = Mem::default();
    let (s, _) = started(&mut store, &[A, B], 1000);
    assert!(!s.prefilling(&mut store, 0) && !s.prefilling(&mut store, 1));
    let (mut r, mut rb) = (Reader::default(), balancer(&[A, B]));
    assert!(r.sync(&mut store, &mut rb, 1000, STALE).usable);
    let t = ticket(1, B);
    assert!(t.prefill() > 0);
    r.write(&mut store, &rb, &t, Change::dispatch(&t), None);
    assert!(!s.prefilling(&mut store, 0));
    assert!(s.prefilling(&mut store, 1));
    // One read of one key.
    let calls = store.calls;
    s.prefilling(&mut store, 1);
    assert_eq!(store.calls, calls + 1);
    // A slot the service does not know: nothing there.
    assert!(!s.prefilling(&mut store, 9));
    // The first token came back: the stream decodes, its prompt is no longer to come.
    r.write(&mut store, &rb, &t, Change::progress(&t, 0, 16), None);
    assert!(!s.prefilling(&mut store, 1));
    r.write(&mut store, &rb, &t, Change::release(&t, 16), None);
    assert!(!s.prefilling(&mut store, 1));
    // Books that cannot be read count as prefilling: the node is polled.
    store.fail = true;
    assert!(s.prefilling(&mut store, 0));
}

/// Held requests let out together, behind the poller service: each is routed knowing where
/// the ones before it went, though none is written to the shared books before the last is
/// routed. Node A (fast) has room for two of them, node B (slow) for two more: A takes two
/// and B the rest, where each would otherwise have found A as empty as the first did.
#[test]
fn held_requests_let_out_together_see_each_others_dispatches() {
    use crate::ingest::prompt::Chain;
    use crate::rng::SplitMix64;
    use crate::route::admission::{Held, HoldQueue};
    let cfg = || {
        let json = format!(
            r#"{{"nodes":[{{"address":"{A}"}},{{"address":"{B}"}}],"health_cluster":"h","max_hold_ms":60000}}"#
        );
        Balancer::new(&Config::parse(json.as_bytes()).unwrap())
    };
    let mut store = Mem::default();
    let mut sb = cfg();
    // 1,000-token caches (512 KiB a token), empty.
    for (node, cap) in [(0, 10_000), (1, 1_000)] {
        let body = format!(
            r#"{{"tokens_per_sec_load":0,"tokens_per_sec_capacity":{cap},"vram_used_bytes":0,"vram_total_bytes":524288000}}"#
        );
        sb.on_health(node, Some(body.as_bytes()), 1000).unwrap();
    }
    let mut service = Service::new([A, B], 1000);
    service.claim_all(&mut store);
    service.publish(&mut store, &sb, 1000);
    let (mut r, mut rb) = (Reader::default(), cfg());
    r.sync(&mut store, &mut rb, 1000, STALE);
    let mut q: HoldQueue<()> = HoldQueue::new(8, 60_000);
    let w = Weight {
        prompt_tokens: 400,
        output_tokens: 10,
    };
    for id in 0..4 {
        q.push(Held::new(id, w, None, Chain::NONE, 1000, ()))
            .unwrap();
    }
    let mut rng = SplitMix64::new(3);
    let mut books = r.books(&mut store);
    let out = q.admit(1001, &mut rb, &mut rng, &mut books);
    let nodes: Vec<Option<usize>> = out
        .iter()
        .map(|(_, o)| match o {
            crate::route::balancer::Outcome::Routed {
                ticket,
                over_ceiling: false,
                ..
            } => Some(ticket.node),
            _ => None,
        })
        .collect();
    assert_eq!(nodes, vec![Some(0), Some(0), Some(1), Some(1)], "{out:?}");
}

/// The service reads the books only of the nodes the workers named (`share::wake`), keeps a
/// name that an answer drops until the snapshot showing that answer is out (reading the books
/// once more then), and reads every node's books for a tick when the list cannot be read.
#[test]
fn the_service_reads_the_books_of_the_named_nodes_only() {
    let mut store = Mem::default();
    let (mut s, b) = started(&mut store, &[A, B], 1000);
    let waiting = Books {
        prefill_tokens: 10,
        ..Books::of(tenant_of(A))
    };
    store.set(&books_key(0), &waiting.encode(), None).unwrap();
    assert_eq!(s.take_woken(&mut store), Counts::default());
    store.calls = 0;
    assert!(!s.waiting(&mut store, 0), "not named: not read");
    assert_eq!(store.calls, 0);
    crate::share::wake::push(&mut store, 0);
    s.take_woken(&mut store);
    assert!(s.waiting(&mut store, 0), "named: its books show the prompt");
    // The prompt started; an answer that lets the node wait longer keeps the name until the
    // snapshot is out; a prompt sent in between is found then.
    let idle = Books::of(tenant_of(A));
    store.set(&books_key(0), &idle.encode(), None).unwrap();
    s.answered(&mut store, 0, true);
    store.set(&books_key(0), &waiting.encode(), None).unwrap();
    s.publish(&mut store, &b, 1100);
    assert!(
        s.waiting(&mut store, 0),
        "kept: a prompt sent before the snapshot"
    );
    // Nothing waiting at the next answer and at the snapshot: the name goes.
    store.set(&books_key(0), &idle.encode(), None).unwrap();
    s.answered(&mut store, 0, true);
    s.publish(&mut store, &b, 1200);
    store.set(&books_key(0), &waiting.encode(), None).unwrap();
    assert!(!s.waiting(&mut store, 0), "dropped");
    // The list cannot be read: this tick reads every node's books.
    store.fail = true;
    assert_eq!(s.take_woken(&mut store).failed, 1);
    store.fail = false;
    assert!(s.waiting(&mut store, 0));
}
