//! The fleet as the poller publishes it and a filter VM takes it in: a balancer's nodes to
//! `NodeView`s and back (see the module comment of `share` for why VMs share it).
//!
//! The poller's balancer exports what its health answers taught it (`view`); a filter VM's
//! balancer takes that in place of polling (`import`), matched by address. The books are not
//! part of it: they live under their own keys, read by each decision (`Balancer::route`).

use crate::fleet::membership::Fleet;
use crate::fleet::models::ServedModels;
use crate::share::codec::{NodeView, Snapshot};

/// What a fleet snapshot changed (`import`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Nodes whose report is new.
    pub new_reports: usize,
    /// Nodes of this balancer the snapshot does not have (the poller's configuration lists
    /// other nodes): they have no report, so they are not chosen.
    pub missing: usize,
}

/// Every node of `fleet`, for the snapshot. `epoch_base` is added to each node's report epoch:
/// the poller's start time in ms, so that the epochs of a restarted poller are newer than any
/// before (a node takes at most one report a tick, >= 10 ms).
pub fn view(fleet: &Fleet, epoch_base: u64) -> Vec<NodeView> {
    fleet
        .nodes()
        .iter()
        .map(|n| NodeView {
            address: n.address().to_string(),
            report: n.report_taken(),
            epoch: epoch_base.saturating_add(n.epoch()),
            ejected: n.ejected(),
            member: n.member(),
            listed_models: n.models().listed().map(<[String]>::to_vec),
            seen_models: n.models().seen().to_vec(),
            any_name: n.models().any_name(),
            context_tokens: n.models().context_tokens(),
            grace_ms: n.grace_ms(),
        })
        .collect()
}

/// Takes every node's report, epoch, health and models from `snapshot`, matched by address.
/// A configured model set stays (it is this balancer's configuration). The books are not
/// touched.
pub fn import(fleet: &mut Fleet, snapshot: &Snapshot) -> Imported {
    let by_address: std::collections::HashMap<&str, &NodeView> = snapshot
        .nodes
        .iter()
        .map(|v| (v.address.as_str(), v))
        .collect();
    let mut imported = Imported::default();
    for n in fleet.nodes_mut() {
        let Some(v) = by_address.get(n.address()) else {
            imported.missing += 1;
            let epoch = n.epoch();
            n.adopt_report(None, epoch, 0);
            continue;
        };
        if v.report.is_some() && (v.epoch != n.epoch() || n.report_taken() != v.report) {
            imported.new_reports += 1;
        }
        n.adopt_report(v.report, v.epoch, v.grace_ms);
        n.adopt_status(v.ejected, v.member);
        if !n.models().is_configured() {
            let mut models = ServedModels::default();
            if let Some(list) = &v.listed_models {
                models.set_list(list.clone());
            }
            models.observe_metrics(&v.seen_models);
            models.set_any_name(v.any_name);
            models.set_context_tokens(v.context_tokens);
            *n.models_mut() = models;
        }
    }
    imported
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::fleet::node::Ticket;
    use crate::ingest::prompt::Chain;
    use crate::ingest::request::Weight;
    use crate::route::balancer::{Balancer, MemberChange, Outcome, OwnBooks};
    use crate::route::testing::{following, members, IDLE};

    use crate::rng::SplitMix64;

    fn cfg(ports: &[u16]) -> Config {
        let nodes: Vec<String> = ports
            .iter()
            .map(|p| format!(r#"{{"address":"127.0.0.1:{p}"}}"#))
            .collect();
        Config::parse(
            format!(
                r#"{{"nodes":[{}],"health_cluster":"h","choices":0}}"#,
                nodes.join(",")
            )
            .as_bytes(),
        )
        .unwrap()
    }

    const W: Weight = Weight {
        prompt_tokens: 100,
        output_tokens: 100,
    };

    fn routed(o: &Outcome) -> Option<Ticket> {
        match o {
            Outcome::Routed { ticket, .. } => Some(*ticket),
            _ => None,
        }
    }

    /// The poller's view goes through the snapshot's bytes into a balancer that never polls,
    /// which then decides as the poller would; the shared books then steer it.
    #[test]
    fn a_reader_decides_from_the_poller_snapshot_and_the_shared_books() {
        let mut poller = Balancer::new(&cfg(&[8001, 8002, 8003]));
        for (i, load) in [300, 100, 200].iter().enumerate() {
            let body =
                format!(r#"{{"tokens_per_sec_load":{load},"tokens_per_sec_capacity":1000}}"#);
            poller.on_health(i, Some(body.as_bytes()), 0).unwrap();
        }
        poller.on_models(2, br#"{"data":[{"id":"m2"}]}"#).unwrap();
        let base = 1_000_000;
        let snap = Snapshot {
            nodes: poller.fleet_view(base),
            prompt_ratio: None,
        };
        let snap = Snapshot::decode(&snap.encode()).unwrap();
        let mut reader = Balancer::new(&cfg(&[8001, 8002, 8003]));
        let mut rng = SplitMix64::new(1);
        assert_eq!(
            reader.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks),
            Outcome::NoFreshNodes
        );
        assert_eq!(
            reader.import_fleet(&snap),
            Imported {
                new_reports: 3,
                missing: 0
            }
        );
        assert_eq!(reader.import_fleet(&snap).new_reports, 0, "nothing new");
        let t = routed(&reader.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks))
            .unwrap();
        assert_eq!((t.node, t.epoch), (1, base + 1));
        assert_eq!(
            routed(&reader.route(
                W,
                Some("m2"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks
            ))
            .map(|t| t.node),
            Some(2),
            "models come with the snapshot"
        );
        // Other workers have sent node 1 a lot since its report: the shared books say so.
        let mut books = reader.books(1).unwrap();
        assert_eq!(books.inflight_requests, 1);
        books.unreflected_tokens = 1_000_000;
        reader.set_books(1, &books);
        let t = routed(&reader.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks))
            .unwrap();
        assert_ne!(t.node, 1);
        // An ejection reaches the reader; a node the poller does not follow has no report.
        poller.on_health(2, None, 20).unwrap_err();
        poller.on_health(2, None, 30).unwrap_err();
        let snap = Snapshot {
            nodes: poller.fleet_view(base),
            prompt_ratio: None,
        };
        let mut other = Balancer::new(&cfg(&[8001, 8002, 8003, 8009]));
        assert_eq!(other.import_fleet(&snap).missing, 1);
        reader.import_fleet(&snap);
        for _ in 0..10 {
            let o = reader.route(W, None, &Chain::NONE, 40, &mut rng, false, &mut OwnBooks);
            assert_ne!(routed(&o).map(|t| t.node), Some(2), "{o:?}");
        }
        // Books at a newer epoch than the snapshot's keep theirs (a ticket takes it).
        let mut b = reader.books(0).unwrap();
        b.epoch = base + 50;
        reader.set_books(0, &b);
        assert_eq!(reader.books(0).unwrap().epoch, base + 50);
    }

    /// With `membership`, a reader follows the poller's slots: its node `i` is the snapshot's
    /// node `i`, a slot the poller reused starts afresh with the new address's settings, and
    /// a release booked for the slot's former address does not touch the new one.
    #[test]
    fn a_reader_following_a_cluster_mirrors_the_pollers_slots() {
        let listed = r#","nodes":[{"address":"10.0.0.9:80","kv_cache_tokens":5}]"#;
        let mut poller = following(listed);
        let mut reader = following(listed);
        let mut rng = SplitMix64::new(3);
        let snap = |p: &Balancer| Snapshot {
            nodes: p.fleet_view(1_000),
            prompt_ratio: None,
        };
        poller.set_members(&members(&["10.0.0.1:80", "10.0.0.2:80"]), |_| false);
        for i in 0..3 {
            poller.on_health(i, Some(IDLE), 0).unwrap();
        }
        let c = reader.mirror_fleet(&snap(&poller));
        assert_eq!((c.joined, c.left), (vec![1, 2], vec![0]));
        assert_eq!(reader.import_fleet(&snap(&poller)).missing, 0);
        let addresses = |b: &Balancer| -> Vec<String> {
            b.nodes().iter().map(|n| n.address().to_string()).collect()
        };
        assert_eq!(addresses(&reader), addresses(&poller));
        assert_eq!(reader.node_config(1).unwrap().kv_cache_tokens, Some(777));
        assert_eq!(reader.mirror_fleet(&snap(&poller)), MemberChange::default());
        // The reader routes a request to node 2, then the poller reuses node 2's slot (its
        // shared books are empty: the busy check says so) for a new address.
        let on_2 = loop {
            let t =
                routed(&reader.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks))
                    .unwrap();
            if t.node == 2 {
                break t;
            }
            reader.release(&t, 0);
        };
        poller.set_members(&members(&["10.0.0.1:80"]), |_| false);
        let busy = poller.set_members(&members(&["10.0.0.1:80", "10.0.0.3:80"]), |i| i == 2);
        assert_eq!(busy.joined, vec![3], "a busy slot is not reused");
        poller.set_members(&members(&["10.0.0.1:80"]), |_| false);
        let c = poller.set_members(
            &members(&["10.0.0.1:80", "10.0.0.4:80", "10.0.0.9:80"]),
            |_| false,
        );
        assert_eq!(c.joined, vec![0, 2]);
        poller.on_health(2, Some(IDLE), 20).unwrap();
        let c = reader.mirror_fleet(&snap(&poller));
        assert_eq!((c.joined, c.left), (vec![0, 2], Vec::<usize>::new()));
        reader.import_fleet(&snap(&poller));
        assert_eq!(addresses(&reader), addresses(&poller));
        assert_eq!(
            reader.node_config(0).unwrap().kv_cache_tokens,
            Some(5),
            "listed"
        );
        // The old address's release finds a new tenant in the slot: nothing is taken away.
        let on_new = routed(&reader.route(
            W,
            Some("x"),
            &Chain::NONE,
            30,
            &mut rng,
            false,
            &mut OwnBooks,
        ));
        let before = reader.nodes()[2].books().inflight_requests;
        reader.release(&on_2, 0);
        assert_eq!(reader.nodes()[2].books().inflight_requests, before);
        if let Some(t) = on_new {
            reader.release(&t, 0);
        }
        // A poller restarted with fewer slots: the reader's extra ones leave.
        let c = reader.mirror_fleet(&Snapshot {
            nodes: snap(&poller).nodes[..2].to_vec(),
            prompt_ratio: None,
        });
        assert_eq!(c.left, vec![2]);
        // Without `membership` the nodes are the configured ones, whatever the snapshot.
        let mut fixed = Balancer::new(&cfg(&[8001]));
        assert_eq!(fixed.mirror_fleet(&snap(&poller)), MemberChange::default());
        assert_eq!(fixed.nodes().len(), 1);
    }

    /// What a worker needs of a node's engine reaches it through the snapshot: that it serves
    /// any name, and its per-slot context.
    #[test]
    fn the_engine_rule_and_the_context_reach_the_readers() {
        let llamacpp = include_str!("../../tests/data/metrics/llamacpp_real.prom");
        let list = include_bytes!("../../tests/data/models/llamacpp_real_noalias.json");
        let mut poller = Balancer::new(&cfg(&[8001, 8002]));
        poller.on_health(0, Some(llamacpp.as_bytes()), 0).unwrap();
        poller.on_models(0, list).unwrap();
        poller
            .on_health(1, Some(br#"{"tokens_per_sec_load":1}"#), 0)
            .unwrap();
        poller.on_models(1, br#"{"data":[{"id":"m"}]}"#).unwrap();
        let snap = Snapshot {
            nodes: poller.fleet_view(0),
            prompt_ratio: None,
        };
        let snap = Snapshot::decode(&snap.encode()).unwrap();
        let mut reader = Balancer::new(&cfg(&[8001, 8002]));
        reader.import_fleet(&snap);
        let m = |i: usize| reader.nodes()[i].models().clone();
        assert!(m(0).any_name() && !m(1).any_name());
        assert_eq!(
            (m(0).context_tokens(), m(1).context_tokens()),
            (Some(512), None)
        );
        // A name nobody lists goes to the node that serves any name.
        let mut rng = SplitMix64::new(2);
        let o = reader.route(
            W,
            Some("gpt-4o"),
            &Chain::NONE,
            10,
            &mut rng,
            false,
            &mut OwnBooks,
        );
        assert_eq!(routed(&o).map(|t| t.node), Some(0), "{o:?}");
    }
}
