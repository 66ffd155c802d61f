//! The filter's beliefs, for an operator: what the balancer knows of each node at `now_ms`
//! (its last report and age, the capacity it ranks it with, its health, membership, models,
//! the work in flight there) and what it would predict for a typical request, rendered as
//! JSON. Pure: the caller gives the time and the books (its own, or the ones every worker
//! shares), and the held-request count of its queue.

use crate::fleet::node::NodeState;
use crate::ingest::request::Weight;
use crate::route::balancer::{Balancer, BookSource};
use crate::route::choice::{evaluate, Ask, AssumedCapacity, FleetWide};
use serde_json::{json, Map, Value};

/// Prompt tokens of the typical request until the mean request size is known.
pub const DEFAULT_PROMPT_TOKENS: u64 = 768;
/// Output tokens of the typical request until output lengths are learned.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 256;

/// The typical request the predictions are made for: the learned mean output (else
/// `DEFAULT_OUTPUT_TOKENS`), and as prompt the rest of the running mean request size (else
/// `DEFAULT_PROMPT_TOKENS`). Also says where each figure came from.
fn typical(b: &Balancer) -> (Weight, &'static str) {
    let learned = b.outputs().fleet().map(|o| o.mean.max(0.0).round() as u64);
    let output = learned.unwrap_or(DEFAULT_OUTPUT_TOKENS);
    match b.mean_request_tokens() {
        Some(mean) => {
            let total = mean.max(0.0).round() as u64;
            let weight = Weight {
                prompt_tokens: total.saturating_sub(output).max(1),
                output_tokens: output,
            };
            (weight, "mean")
        }
        None => (
            Weight {
                prompt_tokens: DEFAULT_PROMPT_TOKENS,
                output_tokens: output,
            },
            "default",
        ),
    }
}

/// A finite number as JSON, else null.
fn num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

fn opt(x: Option<f64>) -> Value {
    x.map_or(Value::Null, num)
}

/// The balancer's view of its fleet at `now_ms`, as JSON. `books` gives each node's current
/// in-flight books (`None` keeps the balancer's own); `held` is the number of requests waiting
/// in the caller's hold queue, when it has one.
pub fn render(b: &Balancer, now_ms: u64, books: &mut dyn BookSource, held: Option<usize>) -> Value {
    let p = b.params();
    let nodes = b.nodes();
    let mut assumed = AssumedCapacity::default();
    for n in nodes {
        if let Some(r) = n.fresh_report(now_ms, p.stale_after_ms) {
            assumed.add(n, r);
        }
    }
    let (weight, source) = typical(b);
    let fleet = FleetWide {
        assumed_capacity: assumed.value(),
        mean_request_tokens: b.mean_request_tokens().unwrap_or(weight.total() as f64),
    };
    let ask = Ask {
        weight,
        growth: b.growth(weight),
        model: None,
        named: false,
        prefix: None,
        pin: None,
    };
    let rendered: Vec<Value> = nodes
        .iter()
        .enumerate()
        .map(|(slot, n)| {
            let mut n = n.clone();
            if let Some(current) = books.books(slot, n.epoch()) {
                n.set_books(&current);
            }
            node(slot, &n, now_ms, &ask, &fleet, b)
        })
        .collect();
    let outputs = b.outputs();
    json!({
        "now_ms": now_ms,
        "stale_after_ms": p.stale_after_ms,
        "vram_ceiling": num(p.vram_ceiling),
        "nodes": rendered,
        "fleet": {
            "nodes": nodes.len(),
            "mean_request_tokens": opt(b.mean_request_tokens()),
            "assumed_capacity_tokens_per_sec": num(fleet.assumed_capacity),
            "learned_output": {
                "samples": outputs.samples(),
                "mean_tokens": opt(outputs.fleet().map(|o| o.mean)),
                "sd_tokens": opt(outputs.fleet().map(|o| o.sd)),
            },
            "prompt_ratio": {
                "samples": b.prompt_samples(),
                "engine_tokens_per_estimated_token": num(b.prompt_ratio()),
                "engine_counters": opt(b.engine_prompt_ratio()),
                "models": b.model_prompt_scales().into_iter().map(|(model, s)| json!({
                    "model": model,
                    "samples": s.samples(),
                    "engine_tokens_per_estimated_token": num(s.ratio()),
                })).collect::<Vec<_>>(),
            },
            "held_requests": held,
            "typical_request": {
                "prompt_tokens": weight.prompt_tokens,
                "output_tokens": weight.output_tokens,
                "source": source,
            },
        },
    })
}

/// One node's beliefs.
fn node(
    slot: usize,
    n: &NodeState,
    now_ms: u64,
    ask: &Ask,
    fleet: &FleetWide,
    b: &Balancer,
) -> Value {
    let p = b.params();
    let report = n.report_taken().map(|(r, at)| {
        json!({
            "age_ms": now_ms.saturating_sub(at),
            "fresh": n.fresh_until(p.stale_after_ms).is_some_and(|until| now_ms <= until),
            "load_tokens_per_sec": num(r.load_tokens_per_sec),
            "capacity_tokens_per_sec": opt(r.capacity_tokens_per_sec),
            "capacity_used_tokens_per_sec": num(n.capacity(&r, fleet.assumed_capacity)),
            "sustained_tokens_per_sec": opt(r.sustained_tokens_per_sec),
            "forecast_tokens_per_sec": num(n.forecast_rate(&r, fleet.assumed_capacity)),
            "kv_cache_usage": opt(r.kv_cache_usage),
            "kv_cache_tokens": opt(r.kv_cache_tokens),
            "vram_used_bytes": opt(r.vram_used_bytes),
            "vram_total_bytes": opt(r.vram_total_bytes),
            "queue_depth": opt(r.queue_depth),
            "running_requests": opt(r.running_requests),
        })
    });
    let books = n.books();
    let predicted = n.fresh_report(now_ms, p.stale_after_ms).map(|r| {
        let (ranked, over) = evaluate(slot, n, r, ask, fleet, p);
        json!({
            "seconds": num(ranked.seconds),
            "kv_fraction": opt(ranked.kv_fraction),
            "over_vram_ceiling": over,
        })
    });
    let models = n.models();
    let mut out = Map::new();
    out.insert("address".into(), json!(n.address()));
    out.insert("slot".into(), json!(slot));
    out.insert("member".into(), json!(n.member()));
    out.insert("ejected".into(), json!(n.ejected()));
    out.insert("failures_in_row".into(), json!(n.failures_in_row()));
    out.insert(
        "failed_request_since_report".into(),
        json!(n.failed_since_report()),
    );
    out.insert(
        "telemetry".into(),
        json!({
            "path": n.health_path(),
            "format": format!("{:?}", n.format()).to_ascii_lowercase(),
            "discovered": n.probe().discovers(),
            "not_found": n.probe().not_found(),
        }),
    );
    out.insert("report".into(), report.unwrap_or(Value::Null));
    out.insert(
        "in_flight".into(),
        json!({
            "requests": books.inflight_requests,
            "tokens": books.inflight_tokens,
            "sent_since_report_requests": books.unreflected_requests,
            "sent_since_report_tokens": books.unreflected_tokens,
            "sent_since_report_prompt_tokens": books.unreflected_prompt_tokens,
            "ended_since_report_requests": books.ended_requests,
            "kv_growth_to_come_tokens": books.growth_tokens,
            "prefill_to_come_tokens": books.prefill_tokens,
            "tightest_tpot_budget_ms": n.tightest_budget_ms(),
        }),
    );
    out.insert(
        "models".into(),
        json!({
            "names": models.names().collect::<Vec<_>>(),
            "configured": models.is_configured(),
            "listed": models.listed().is_some(),
            "any_name": models.any_name(),
        }),
    );
    let figure = |f: Option<(f64, u64)>| {
        f.map_or(Value::Null, |(seconds, at)| {
            json!({"ms": num(seconds * 1000.0), "age_ms": now_ms.saturating_sub(at)})
        })
    };
    let [completed, long, pace] = n.decoding();
    out.insert(
        "time_per_token".into(),
        json!({
            "completed": figure(completed),
            "long_contexts": figure(long),
            "running_pace": figure(pace),
        }),
    );
    out.insert("predicted_typical".into(), predicted.unwrap_or(Value::Null));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::ingest::prompt::Chain;
    use crate::rng::SplitMix64;
    use crate::route::balancer::OwnBooks;

    fn balancer(nodes: &str) -> Balancer {
        let cfg = Config::parse(
            format!(r#"{{"health_cluster":"h","nodes":[{nodes}],"stale_after_ms":3000}}"#)
                .as_bytes(),
        )
        .unwrap();
        Balancer::new(&cfg)
    }

    #[test]
    fn a_fleet_with_no_reports_has_nodes_without_predictions() {
        let b = balancer(r#"{"address":"10.0.0.1:8000"},{"address":"10.0.0.2:8000"}"#);
        let v = render(&b, 5_000, &mut OwnBooks, Some(0));
        let nodes = v["nodes"].as_array().unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0]["address"], "10.0.0.1:8000");
        assert_eq!(nodes[1]["slot"], 1);
        assert_eq!(nodes[0]["report"], Value::Null);
        assert_eq!(nodes[0]["predicted_typical"], Value::Null);
        assert_eq!(nodes[0]["member"], true);
        assert_eq!(nodes[0]["ejected"], false);
        assert_eq!(nodes[0]["in_flight"]["requests"], 0);
        assert_eq!(v["fleet"]["typical_request"]["source"], "default");
        assert_eq!(
            v["fleet"]["typical_request"]["prompt_tokens"],
            DEFAULT_PROMPT_TOKENS
        );
        assert_eq!(v["fleet"]["mean_request_tokens"], Value::Null);
        assert_eq!(v["fleet"]["held_requests"], 0);
        assert_eq!(v["fleet"]["learned_output"]["samples"], 0);
    }

    #[test]
    fn reports_books_and_predictions_per_node() {
        let mut b = balancer(
            r#"{"address":"10.0.0.1:8000","health_path":"/health","kv_cache_tokens":10000},{"address":"10.0.0.2:8000","capacity_tokens_per_sec":5000}"#,
        );
        let r0 = br#"{"tokens_per_sec_load":100,"tokens_per_sec_capacity":1000,"kv_cache_usage":0.25,"queue_depth":2,"running_requests":3}"#;
        let r1 = br#"{"tokens_per_sec_load":4000}"#;
        assert!(b.on_health(0, Some(r0), 1_000).is_ok());
        assert!(b.on_health(1, Some(r1), 1_500).is_ok());
        // One request routed: the books show it, the mean request size is set.
        let mut rng = SplitMix64::new(7);
        let w = Weight {
            prompt_tokens: 100,
            output_tokens: 50,
        };
        let out = b.route(w, None, &Chain::NONE, 2_000, &mut rng, false, &mut OwnBooks);
        assert!(matches!(
            out,
            crate::route::balancer::Outcome::Routed { .. }
        ));
        let v = render(&b, 2_000, &mut OwnBooks, None);
        let nodes = v["nodes"].as_array().unwrap();
        let n0 = &nodes[0];
        assert_eq!(n0["report"]["age_ms"], 1_000);
        assert_eq!(n0["report"]["fresh"], true);
        assert_eq!(n0["report"]["load_tokens_per_sec"], 100.0);
        assert_eq!(n0["report"]["capacity_tokens_per_sec"], 1000.0);
        assert_eq!(n0["report"]["capacity_used_tokens_per_sec"], 1000.0);
        assert_eq!(n0["report"]["kv_cache_usage"], 0.25);
        assert_eq!(n0["report"]["queue_depth"], 2.0);
        assert_eq!(n0["report"]["running_requests"], 3.0);
        assert_eq!(n0["telemetry"]["path"], "/health");
        assert_eq!(n0["telemetry"]["format"], "auto");
        // The configured capacity wins over the reported (none here).
        let n1 = &nodes[1];
        assert_eq!(n1["report"]["capacity_tokens_per_sec"], Value::Null);
        assert_eq!(n1["report"]["capacity_used_tokens_per_sec"], 5000.0);
        assert_eq!(n1["report"]["kv_cache_usage"], Value::Null);
        let total: u64 = nodes
            .iter()
            .map(|n| n["in_flight"]["requests"].as_u64().unwrap())
            .sum();
        assert_eq!(total, 1);
        let sent: u64 = nodes
            .iter()
            .map(|n| n["in_flight"]["sent_since_report_tokens"].as_u64().unwrap())
            .sum();
        assert_eq!(sent, 150);
        for n in nodes {
            assert!(n["predicted_typical"]["seconds"].as_f64().unwrap() > 0.0);
        }
        assert!(n0["predicted_typical"]["kv_fraction"].as_f64().unwrap() > 0.25);
        assert_eq!(n1["predicted_typical"]["kv_fraction"], Value::Null);
        assert_eq!(v["fleet"]["typical_request"]["source"], "mean");
        assert_eq!(v["fleet"]["mean_request_tokens"], 150.0);
        assert_eq!(v["fleet"]["held_requests"], Value::Null);
        // A stale report stays, with its age, but predicts nothing.
        let later = render(&b, 9_000, &mut OwnBooks, None);
        assert_eq!(later["nodes"][0]["report"]["fresh"], false);
        assert_eq!(later["nodes"][0]["report"]["age_ms"], 8_000);
        assert_eq!(later["nodes"][0]["predicted_typical"], Value::Null);
        // A request failed at node 1 after its report: out of the choice, and said so.
        assert_eq!(n1["failed_request_since_report"], false);
        b.note_failed_request(1, 2_100);
        let failed = render(&b, 2_200, &mut OwnBooks, None);
        assert_eq!(failed["nodes"][1]["failed_request_since_report"], true);
        assert_eq!(failed["nodes"][1]["report"]["fresh"], true);
        assert_eq!(failed["nodes"][1]["predicted_typical"], Value::Null);
        assert_eq!(failed["nodes"][0]["failed_request_since_report"], false);
    }

    #[test]
    fn books_come_from_the_source() {
        struct Fixed;
        impl BookSource for Fixed {
            fn books(&mut self, node: usize, epoch: u64) -> Option<crate::share::Books> {
                (node == 0).then(|| crate::share::Books {
                    epoch,
                    inflight_requests: 7,
                    inflight_tokens: 700,
                    growth_tokens: 42,
                    ..Default::default()
                })
            }
        }
        let b = balancer(r#"{"address":"10.0.0.1:8000"},{"address":"10.0.0.2:8000"}"#);
        let v = render(&b, 1, &mut Fixed, None);
        assert_eq!(v["nodes"][0]["in_flight"]["requests"], 7);
        assert_eq!(v["nodes"][0]["in_flight"]["tokens"], 700);
        assert_eq!(v["nodes"][0]["in_flight"]["kv_growth_to_come_tokens"], 42);
        assert_eq!(v["nodes"][1]["in_flight"]["requests"], 0);
    }
}
