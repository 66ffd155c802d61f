//! The model names the fleet serves by name, for the rule of engines that serve any name
//! (see `models`): a node whose engine answers any name is a candidate for a model only when
//! no node names that model.
//!
//! Telling that for a request would walk the fleet; instead the names every member serves by
//! name (configured, listed, seen in its metrics) are gathered once, when a node's models or
//! the set of nodes may have changed, and a request costs one lookup, and only in a fleet that
//! has a node serving any name at all.

use crate::fleet::node::NodeState;
use std::collections::HashSet;

/// Every name a member of the fleet serves by name, rebuilt when it may have changed.
#[derive(Debug, Clone, PartialEq)]
pub struct Named {
    names: HashSet<String>,
    /// Some member's engine serves any name.
    any_name: bool,
    dirty: bool,
}

impl Default for Named {
    fn default() -> Self {
        Named {
            names: HashSet::new(),
            any_name: false,
            dirty: true,
        }
    }
}

impl Named {
    /// A node's models or the set of nodes may have changed: rebuilt before the next lookup.
    pub fn invalidate(&mut self) {
        self.dirty = true;
    }

    /// Whether a node serving any name must leave `model` to the nodes that name it: some
    /// member serves `model` by name, and some member serves any name (else it does not
    /// matter, and nothing is looked up).
    pub fn named(&mut self, nodes: &[NodeState], model: &str) -> bool {
        if self.dirty {
            self.rebuild(nodes);
        }
        self.any_name && self.names.contains(model)
    }

    fn rebuild(&mut self, nodes: &[NodeState]) {
        self.dirty = false;
        self.names.clear();
        let members = || nodes.iter().filter(|n| n.member());
        self.any_name = members().any(|n| n.models().any_name());
        if self.any_name {
            for n in members() {
                self.names.extend(n.models().names().map(str::to_string));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::models::ServedModels;
    use crate::ingest::engine::Engine;
    use crate::ingest::prompt::Chain;

    fn node(address: &str, list: &[&str], engine: Engine) -> NodeState {
        let mut n = NodeState::new(address, None, None);
        n.models_mut()
            .set_list(list.iter().map(|s| s.to_string()).collect());
        n.models_mut().set_engine(engine);
        n
    }

    #[test]
    fn names_are_gathered_from_the_members_and_looked_up_only_when_needed() {
        let mut named = Named::default();
        let vllm = vec![
            node("10.0.0.1:80", &["m1"], Engine::Vllm),
            node("10.0.0.2:80", &["m2"], Engine::Vllm),
        ];
        // No node serves any name: nothing to leave to anyone.
        assert!(!named.named(&vllm, "m1"));
        let mut mixed = vllm.clone();
        mixed.push(node("10.0.0.3:80", &["/models/x.gguf"], Engine::LlamaCpp));
        let mut configured = NodeState::new("10.0.0.4:80", None, None);
        *configured.models_mut() = ServedModels::configured(vec!["alias".into()]);
        mixed.push(configured);
        // Stale until invalidated.
        assert!(!named.named(&mixed, "m1"));
        named.invalidate();
        for (model, want) in [
            ("m1", true),
            ("m2", true),
            ("/models/x.gguf", true),
            ("alias", true),
            ("gpt-4o", false),
        ] {
            assert_eq!(named.named(&mixed, model), want, "{model}");
        }
        // A node out of the cluster names nothing.
        mixed[0].set_member(false);
        named.invalidate();
        assert!(!named.named(&mixed, "m1"));
        assert!(named.named(&mixed, "m2"));
    }

    use crate::rng::SplitMix64;
    use crate::route::balancer::{Balancer, Outcome, OwnBooks};
    use crate::route::testing::{engine_cfg, routed_to, W};

    const LLAMACPP: &str = include_str!("../../tests/data/metrics/llamacpp_real.prom");
    const LLAMACPP_LIST: &[u8] =
        include_bytes!("../../tests/data/models/llamacpp_real_noalias.json");
    const VLLM: &str = include_str!("../../tests/data/metrics/vllm_v1.prom");

    /// Where requests for `model` go, over 40 tries (node indices, each once, sorted).
    fn destinations(b: &mut Balancer, model: Option<&str>) -> Result<Vec<usize>, Outcome> {
        let mut rng = SplitMix64::new(3);
        let mut seen = Vec::new();
        for _ in 0..40 {
            let o = b.route(W, model, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks);
            let Some(i) = routed_to(&o) else {
                return Err(o);
            };
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
            if !seen.contains(&i) {
                seen.push(i);
            }
        }
        seen.sort_unstable();
        Ok(seen)
    }

    /// (fleet, model asked, where it goes): the engines' rule end to end, from their metrics
    /// (which tell the engine) and model lists.
    #[test]
    fn engines_that_serve_any_name_take_names_no_node_names() {
        // Two llama.cpp servers started with a model file: they list its path.
        let mut llama = Balancer::new(&engine_cfg(&["", ""]));
        for i in 0..2 {
            llama.on_health(i, Some(LLAMACPP.as_bytes()), 0).unwrap();
            llama.on_models(i, LLAMACPP_LIST).unwrap();
        }
        let path = "/root/.cache/token-balancer/models/SmolLM2-135M-Instruct.Q4_1.gguf";
        for model in [Some(path), Some("smollm2"), Some("gpt-4o"), None] {
            assert_eq!(destinations(&mut llama, model), Ok(vec![0, 1]), "{model:?}");
            assert!(model.map_or(true, |m| !llama.model_unknown(m)));
        }
        // A vLLM node serving m1 beside a llama.cpp node: m1 is vLLM's alone (the llama.cpp
        // node would answer it with another model); a name nobody lists goes to llama.cpp,
        // which serves it, not to vLLM, which would answer 404.
        let mut mixed = Balancer::new(&engine_cfg(&["", ""]));
        mixed.on_health(0, Some(VLLM.as_bytes()), 0).unwrap();
        mixed.on_models(0, br#"{"data":[{"id":"m1"}]}"#).unwrap();
        mixed.on_health(1, Some(LLAMACPP.as_bytes()), 0).unwrap();
        mixed.on_models(1, LLAMACPP_LIST).unwrap();
        assert_eq!(destinations(&mut mixed, Some("m1")), Ok(vec![0]));
        assert_eq!(destinations(&mut mixed, Some("gpt-4o")), Ok(vec![1]));
        assert_eq!(destinations(&mut mixed, Some(path)), Ok(vec![1]));
        // vLLM alone is exact: an unlisted name is an unknown model.
        let mut vllm = Balancer::new(&engine_cfg(&[""]));
        vllm.on_health(0, Some(VLLM.as_bytes()), 0).unwrap();
        vllm.on_models(0, br#"{"data":[{"id":"m1"}]}"#).unwrap();
        assert_eq!(
            destinations(&mut vllm, Some("gpt-4o")),
            Err(Outcome::UnknownModel)
        );
        // A configured set stays exact whatever the engine: the operator's aliases.
        let mut aliased = Balancer::new(&engine_cfg(&[r#","models":["smollm2"]"#]));
        aliased.on_health(0, Some(LLAMACPP.as_bytes()), 0).unwrap();
        assert_eq!(destinations(&mut aliased, Some("smollm2")), Ok(vec![0]));
        assert_eq!(
            destinations(&mut aliased, Some("gpt-4o")),
            Err(Outcome::UnknownModel)
        );
        // The simple JSON format names no engine: its list is exact, as before.
        let mut seed = Balancer::new(&engine_cfg(&[""]));
        seed.on_health(0, Some(br#"{"tokens_per_sec_load":1}"#), 0)
            .unwrap();
        seed.on_models(0, br#"{"data":[{"id":"m1"}]}"#).unwrap();
        assert_eq!(
            destinations(&mut seed, Some("gpt-4o")),
            Err(Outcome::UnknownModel)
        );
    }
}
