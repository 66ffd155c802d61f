//! Asking the nodes where a stored response is, for a request that names one this Envoy has
//! not seen stored (`ingest::stored`): another Envoy replica saw it, or it was stored before
//! this Envoy started.
//!
//! The request waits while each node asked (`Balancer::nodes_to_ask`) answers
//! `GET /v1/responses/{id}`, through the health cluster as the polls go. The first node to
//! answer 200 stores it: the request goes there, and the response is noted as if this Envoy
//! had seen it stored, so that what comes back to it next goes there at once. When every node
//! has answered otherwise (404, an error, no answer within `health_timeout_ms`), nobody here
//! stores it, and the request goes on as any other would. This module only sends the asks and
//! reads their answers; the request decides what they mean for it (`request`).

use crate::host::Host;
use crate::polls;
use std::time::Duration;
use token_balancer_core::config::Config;
use token_balancer_core::ingest::stored;

/// What one answer told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    /// Not an answer to these asks, or some node has yet to answer.
    Waiting,
    /// The node at `address` stores the response; the conversation has `context_tokens` up to
    /// and with it.
    Found {
        address: String,
        context_tokens: u64,
    },
    /// Every node asked answered, none with the response.
    Nowhere,
}

/// The asks one request has out.
#[derive(Debug)]
pub struct Asking {
    /// (callout token, address of the node asked)
    out: Vec<(u32, String)>,
}

impl Asking {
    /// Asks each of `nodes` (addresses) for the stored response `id`; `None` when no ask
    /// could be sent.
    pub fn start<H: Host>(
        host: &H,
        config: &Config,
        id: &str,
        nodes: Vec<String>,
    ) -> Option<Asking> {
        let path = stored::ask_path(id);
        let timeout = Duration::from_millis(config.health_timeout_ms);
        let out: Vec<(u32, String)> = nodes
            .into_iter()
            .filter_map(|address| {
                let token = polls::callout(host, config, &address, &path, timeout).ok()?;
                Some((token, address))
            })
            .collect();
        (!out.is_empty()).then_some(Asking { out })
    }

    /// Takes the answer to callout `token`, of `body_size` bytes.
    pub fn answer<H: Host>(&mut self, host: &H, token: u32, body_size: usize) -> Heard {
        let Some(at) = self.out.iter().position(|(t, _)| *t == token) else {
            return Heard::Waiting;
        };
        let (_, address) = self.out.swap_remove(at);
        if host.call_status().as_deref() == Some("200") {
            let body = host.call_body(body_size).unwrap_or_default();
            return Heard::Found {
                address,
                context_tokens: stored::context_of(&body),
            };
        }
        if self.out.is_empty() {
            Heard::Nowhere
        } else {
            Heard::Waiting
        }
    }
}
