//! What the filter decided for one request, in words: the one rendering of the debug header's
//! value and of the explanation an operator asks for on one request, and the source networks
//! such a request may come from.
//!
//! Both are written from the same `Decision`, which the glue keeps for every request (it is
//! made of values the decision produced anyway, moved, not copied) and renders only when a
//! response is to carry it: every response with `debug_header`; one response, asked for with
//! `explain.header` from an allowed source; or the access log's filter state with
//! `explain.access_log`. The explanation is the debug header's value with more fields: the
//! verdict and why first, then the model, the weight and every node of the routing header with
//! the predicted time to serve, KV-cache use and cached prompt tokens it was weighed with. Both are one header value
//! of `key=value` fields separated by `; `.

use crate::config::Rule;
use crate::ingest::request::Weight;
use crate::route::choice::Ranked;
use std::fmt::Write;
use std::net::{IpAddr, SocketAddr};

/// Bytes of a model name the explanation shows; a longer one is cut, with `...`.
const MAX_MODEL_SHOWN: usize = 256;

/// What happened to one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The routing header was written.
    Routed(Route),
    /// The filter left the request to Envoy's balancer; the reason as the stats name it
    /// (`no_body`, `no_fresh_nodes`, ...).
    Fallback(&'static str),
    /// The filter answered the request itself (`unknown_model`).
    Rejected(&'static str),
}

/// A routed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// The routing header as written: the chosen node, then the retry hosts.
    pub header_value: String,
    /// Prompt tokens and the output counted for the request (its weight).
    pub weight: Weight,
    /// Prompt tokens the chosen node is believed to hold in its prefix cache.
    pub cached_tokens: u64,
    /// The request's own output cap.
    pub output_cap: u64,
    /// Predicted time to serve on the chosen node, seconds (an ordering key).
    pub predicted_seconds: f64,
    /// Requests in flight on the chosen node before this one.
    pub inflight_before: u64,
    /// Every fresh node would pass the VRAM ceiling: this one overflows least.
    pub over_ceiling: bool,
    /// The nodes of the routing header, in its order, as they were weighed.
    pub compared: Box<[Ranked]>,
    /// Candidates the choice compared per request when it chose (0: every node); with
    /// `choices: auto` it follows how many routers share the fleet.
    pub choices: usize,
    /// The node that served the request when it was not the chosen one (Envoy retried it
    /// further down the routing header), as Envoy names it.
    pub served_by: Option<String>,
}

/// One request's decision, as the debug header and the explanation tell it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    /// How long the request waited in the hold queue, if it did.
    pub held_ms: Option<u64>,
}

/// How much of a decision is rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detail {
    /// The debug header's value.
    Brief,
    /// The explanation: the debug header's fields and the request's model, weight and
    /// compared nodes. `policy` names the rule that chose.
    Full(Rule),
}

/// What the explanation adds of the request itself: its model and its estimate with its cap,
/// when its body was read.
#[derive(Debug, Clone, Copy, Default)]
pub struct Asked<'a> {
    pub model: Option<&'a str>,
    pub weight: Option<Weight>,
}

impl Decision {
    pub fn fallback(reason: &'static str) -> Decision {
        Decision {
            verdict: Verdict::Fallback(reason),
            held_ms: None,
        }
    }

    /// The header value: `Detail::Brief` is the debug header's, `Detail::Full` the
    /// explanation's (see docs/OBSERVABILITY.md for both, field by field).
    pub fn render(&self, detail: Detail, asked: Asked<'_>) -> String {
        let full = match detail {
            Detail::Brief => None,
            Detail::Full(rule) => Some(rule),
        };
        let mut out = String::with_capacity(if full.is_some() { 320 } else { 128 });
        match &self.verdict {
            Verdict::Routed(r) => {
                if let Some(rule) = full {
                    let why = match (r.over_ceiling, rule) {
                        (true, _) => "every_node_over_vram_ceiling",
                        (false, Rule::TokenThroughput) => "shortest_predicted_time",
                        (false, Rule::LeastReportedLoad) => "least_reported_load",
                        (false, Rule::GatewayProfile) => "gateway_profile",
                    };
                    let _ = write!(out, "decision=routed; why={why}; ");
                    if let Some(name) = asked.model {
                        model(&mut out, name);
                        out.push_str("; ");
                    }
                }
                let _ = write!(
                    out,
                    "node={}; prompt_tokens={}; cached_tokens={}; output_tokens={}; output_cap={}; predicted_ms={:.1}; inflight={}",
                    r.header_value,
                    r.weight.prompt_tokens,
                    r.cached_tokens,
                    r.weight.output_tokens,
                    r.output_cap,
                    r.predicted_seconds * 1000.0,
                    r.inflight_before
                );
                if let Some(ms) = self.held_ms {
                    let _ = write!(out, "; held_ms={ms}");
                }
                if let Some(node) = &r.served_by {
                    let _ = write!(out, "; served_by={node}");
                }
                if full.is_some() {
                    let _ = write!(
                        out,
                        "; weight_tokens={}; choices={}; candidates=",
                        r.weight.total(),
                        r.choices
                    );
                    for (i, (address, n)) in r.header_value.split(',').zip(&r.compared).enumerate()
                    {
                        let sep = if i == 0 { "" } else { "," };
                        let _ = write!(
                            out,
                            "{sep}{address} predicted_ms={:.1} kv=",
                            n.seconds * 1000.0
                        );
                        match n.kv_fraction {
                            Some(kv) => {
                                let _ = write!(out, "{kv:.3}");
                            }
                            None => out.push_str("unknown"),
                        }
                        let _ = write!(out, " cached={}", n.cached);
                        if let Some(t) = n.first_token_seconds {
                            let _ = write!(out, " first_token_ms={:.1}", t * 1000.0);
                        }
                        if let Some(t) = n.tpot_seconds {
                            let _ = write!(out, " tpot_ms={:.1}", t * 1000.0);
                        }
                        if let Some(t) = n.prefill_room_seconds {
                            let _ = write!(out, " prefill_room_ms={:.1}", t * 1000.0);
                        }
                    }
                }
            }
            Verdict::Fallback(why) | Verdict::Rejected(why) => {
                let word = match self.verdict {
                    Verdict::Rejected(_) => "rejected",
                    _ => "fallback",
                };
                if full.is_some() {
                    let _ = write!(out, "decision={word}; why={why}");
                    if let Some(name) = asked.model {
                        out.push_str("; ");
                        model(&mut out, name);
                    }
                    if let Some(w) = asked.weight {
                        let _ = write!(
                            out,
                            "; prompt_tokens={}; output_cap={}",
                            w.prompt_tokens, w.output_tokens
                        );
                    }
                } else {
                    let _ = write!(out, "{word}={why}");
                }
                if let Some(ms) = self.held_ms {
                    let _ = write!(out, "; held_ms={ms}");
                }
            }
        }
        out
    }
}

/// `model=<name>`: the name percent-encoded outside letters, digits and `._~:/@+-` (it comes
/// from the client and goes into a header value), at most `MAX_MODEL_SHOWN` of its bytes.
fn model(out: &mut String, name: &str) {
    out.push_str("model=");
    for (i, b) in name.bytes().enumerate() {
        if i == MAX_MODEL_SHOWN {
            out.push_str("...");
            break;
        }
        if b.is_ascii_alphanumeric() || b"._~:/@+-".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// An IP network: an address and a prefix length (`10.0.0.0/8`, `fd00::/8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Reads `a.b.c.d/n` or `ipv6/n`; an address alone is that one address (`/32`, `/128`).
    /// Host bits set under the prefix (`10.0.0.1/8`) are refused: they are a typo more often
    /// than not.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let net: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP network (a.b.c.d/n or ipv6/n)"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(n) if n <= max && !p.starts_with('+') => n,
                _ => return Err(format!("{s:?}: the prefix length must be 0 to {max}")),
            },
        };
        // An IPv4 network written as mapped IPv6 (`::ffff:10.0.0.0/104`) is that IPv4 network,
        // as the addresses it is matched against are (see `contains`).
        let (net, prefix) = match net.to_canonical() {
            IpAddr::V4(v4) if net.is_ipv6() && prefix >= 96 => {
                (IpAddr::V4(v4), prefix.saturating_sub(96))
            }
            _ => (net, prefix),
        };
        let cidr = Cidr { net, prefix };
        if cidr.masked(net) != bits(net) {
            let base = match net {
                IpAddr::V4(_) => IpAddr::from(std::net::Ipv4Addr::from(
                    u32::try_from(cidr.masked(net)).unwrap_or(0),
                )),
                IpAddr::V6(_) => IpAddr::from(std::net::Ipv6Addr::from(cidr.masked(net))),
            };
            return Err(format!(
                "{s:?} has bits set past its prefix (the network is {base}/{prefix})"
            ));
        }
        Ok(cidr)
    }

    /// The address's bits under this network's prefix.
    fn masked(&self, ip: IpAddr) -> u128 {
        let width: u32 = if ip.is_ipv4() { 32 } else { 128 };
        let host_bits = width.saturating_sub(u32::from(self.prefix));
        let mask = u128::MAX.checked_shl(host_bits).unwrap_or(0);
        bits(ip) & mask
    }

    /// Whether `ip` is in this network. An IPv4 address mapped into IPv6 (`::ffff:a.b.c.d`,
    /// as a dual-stack listener sees IPv4 clients) is matched as the IPv4 address it is.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.net.is_ipv4() && self.masked(ip) == self.masked(self.net)
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.net, self.prefix)
    }
}

/// The IP of a downstream address as Envoy gives it (`10.0.0.7:51234`, `[fd00::7]:51234`, or
/// an address alone); `None` for anything else (a pipe, an internal listener).
pub fn source_ip(address: &str) -> Option<IpAddr> {
    address
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| address.parse::<IpAddr>())
        .ok()
}

/// Whether a request from `address` may ask for an explanation: its IP is in one of `sources`.
pub fn allowed(sources: &[Cidr], address: Option<&str>) -> bool {
    address
        .and_then(source_ip)
        .is_some_and(|ip| sources.iter().any(|c| c.contains(ip)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(over_ceiling: bool, held_ms: Option<u64>) -> Decision {
        Decision {
            verdict: Verdict::Routed(Route {
                header_value: "10.0.0.1:8000,[fd00::2]:8000".into(),
                weight: Weight {
                    prompt_tokens: 812,
                    output_tokens: 214,
                },
                cached_tokens: 512,
                output_cap: 1024,
                predicted_seconds: 0.0417,
                inflight_before: 3,
                over_ceiling,
                choices: 16,
                served_by: None,
                compared: vec![
                    Ranked {
                        node: 0,
                        seconds: 0.0417,
                        kv_fraction: Some(0.4712),
                        cached: 0,
                        first_token_seconds: Some(0.02),
                        queued_seconds: Some(0.01),
                        tpot_seconds: Some(0.0184),
                        prefill_room_seconds: Some(0.75),
                    },
                    Ranked {
                        node: 1,
                        seconds: 0.055,
                        kv_fraction: None,
                        cached: 512,
                        first_token_seconds: None,
                        queued_seconds: None,
                        tpot_seconds: None,
                        prefill_room_seconds: None,
                    },
                ]
                .into(),
            }),
            held_ms,
        }
    }

    const ASKED: Asked = Asked {
        model: Some("llama-3-8b"),
        weight: Some(Weight {
            prompt_tokens: 812,
            output_tokens: 1024,
        }),
    };

    #[test]
    fn the_debug_value_is_the_brief_rendering() {
        let d = routed(false, None);
        assert_eq!(
            d.render(Detail::Brief, ASKED),
            "node=10.0.0.1:8000,[fd00::2]:8000; prompt_tokens=812; cached_tokens=512; output_tokens=214; output_cap=1024; predicted_ms=41.7; inflight=3"
        );
        assert_eq!(
            routed(false, Some(350)).render(Detail::Brief, ASKED),
            "node=10.0.0.1:8000,[fd00::2]:8000; prompt_tokens=812; cached_tokens=512; output_tokens=214; output_cap=1024; predicted_ms=41.7; inflight=3; held_ms=350"
        );
        // Envoy's retries served it on the second node of the routing header.
        let mut retried = routed(false, None);
        if let Verdict::Routed(r) = &mut retried.verdict {
            r.served_by = Some("[fd00::2]:8000".into());
        }
        assert!(retried
            .render(Detail::Brief, ASKED)
            .ends_with("; inflight=3; served_by=[fd00::2]:8000"));
        assert!(retried
            .render(Detail::Full(Rule::TokenThroughput), ASKED)
            .contains("; inflight=3; served_by=[fd00::2]:8000; weight_tokens="));
        let f = Decision::fallback("no_body");
        assert_eq!(
            f.render(Detail::Brief, Asked::default()),
            "fallback=no_body"
        );
        let r = Decision {
            verdict: Verdict::Rejected("unknown_model"),
            held_ms: Some(5),
        };
        assert_eq!(
            r.render(Detail::Brief, ASKED),
            "rejected=unknown_model; held_ms=5"
        );
    }

    #[test]
    fn the_explanation_adds_why_model_weight_and_candidates() {
        let full = Detail::Full(Rule::TokenThroughput);
        assert_eq!(
            routed(false, Some(350)).render(full, ASKED),
            "decision=routed; why=shortest_predicted_time; model=llama-3-8b; \
             node=10.0.0.1:8000,[fd00::2]:8000; prompt_tokens=812; cached_tokens=512; output_tokens=214; \
             output_cap=1024; predicted_ms=41.7; inflight=3; held_ms=350; weight_tokens=1026; \
             choices=16; candidates=10.0.0.1:8000 predicted_ms=41.7 kv=0.471 cached=0 first_token_ms=20.0 tpot_ms=18.4 prefill_room_ms=750.0,[fd00::2]:8000 predicted_ms=55.0 kv=unknown cached=512"
        );
        let over = routed(true, None).render(full, Asked::default());
        assert!(
            over.starts_with("decision=routed; why=every_node_over_vram_ceiling; node="),
            "{over}"
        );
        assert_eq!(
            Decision::fallback("no_fresh_nodes").render(full, ASKED),
            "decision=fallback; why=no_fresh_nodes; model=llama-3-8b; prompt_tokens=812; output_cap=1024"
        );
        assert_eq!(
            Decision::fallback("no_body").render(full, Asked::default()),
            "decision=fallback; why=no_body"
        );
        let rejected = Decision {
            verdict: Verdict::Rejected("unknown_model"),
            held_ms: None,
        };
        assert_eq!(
            rejected.render(
                Detail::Full(Rule::LeastReportedLoad),
                Asked {
                    model: Some("x"),
                    weight: None
                }
            ),
            "decision=rejected; why=unknown_model; model=x"
        );
        assert!(routed(false, None)
            .render(Detail::Full(Rule::LeastReportedLoad), ASKED)
            .starts_with("decision=routed; why=least_reported_load; "));
    }

    #[test]
    fn a_model_name_is_made_safe_for_a_header() {
        let evil = "a b;c=d\r\nx-evil: 1\u{e9}";
        let s = Decision::fallback("no_fresh_nodes").render(
            Detail::Full(Rule::TokenThroughput),
            Asked {
                model: Some(evil),
                weight: None,
            },
        );
        assert_eq!(
            s,
            "decision=fallback; why=no_fresh_nodes; model=a%20b%3Bc%3Dd%0D%0Ax-evil:%201%C3%A9"
        );
        let long = "m".repeat(1000);
        let s = routed(false, None).render(
            Detail::Full(Rule::TokenThroughput),
            Asked {
                model: Some(&long),
                weight: None,
            },
        );
        assert!(
            s.contains(&format!("model={}...; node=", "m".repeat(256))),
            "{s}"
        );
        assert!(s.bytes().all(|b| b.is_ascii_graphic() || b == b' '));
    }

    #[test]
    fn networks_contain_their_addresses_in_both_families() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let c = |s: &str| Cidr::parse(s).unwrap();
        assert!(c("127.0.0.1/32").contains(ip("127.0.0.1")));
        assert!(!c("127.0.0.1/32").contains(ip("127.0.0.2")));
        assert!(c("10.0.0.0/8").contains(ip("10.255.1.2")));
        assert!(!c("10.0.0.0/8").contains(ip("11.0.0.1")));
        assert!(c("0.0.0.0/0").contains(ip("203.0.113.9")));
        assert!(
            !c("0.0.0.0/0").contains(ip("2001:db8::1")),
            "no family crossing"
        );
        assert!(c("fd00::/8").contains(ip("fd12:3456::1")));
        assert!(!c("fd00::/8").contains(ip("fe80::1")));
        assert!(c("::/0").contains(ip("2001:db8::1")));
        assert!(c("::1").contains(ip("::1")));
        assert!(c("192.168.1.7").contains(ip("192.168.1.7")));
        // A dual-stack listener sees IPv4 clients as mapped IPv6 addresses.
        assert!(c("127.0.0.0/8").contains(ip("::ffff:127.0.0.1")));
        assert!(c("::ffff:127.0.0.0/104").contains(ip("127.0.0.1")));
        assert_eq!(c("::ffff:127.0.0.0/104"), c("127.0.0.0/8"));
        assert_eq!(c("10.0.0.0/8").to_string(), "10.0.0.0/8");
    }

    #[test]
    fn bad_networks_say_why() {
        for (s, says) in [
            ("10.0.0.0/33", "0 to 32"),
            ("fd00::/129", "0 to 128"),
            ("10.0.0.0/", "0 to 32"),
            ("10.0.0.0/+8", "0 to 32"),
            ("10.0.0.0/x", "0 to 32"),
            ("10.0.0/8", "not an IP network"),
            ("localhost", "not an IP network"),
            ("", "not an IP network"),
            ("10.0.0.1/8", "the network is 10.0.0.0/8"),
            ("fd00::1/64", "the network is fd00::/64"),
        ] {
            let e = Cidr::parse(s).unwrap_err();
            assert!(e.contains(says), "{s}: {e}");
        }
    }

    #[test]
    fn the_source_address_decides() {
        let sources = [
            Cidr::parse("127.0.0.1/32").unwrap(),
            Cidr::parse("fd00::/8").unwrap(),
        ];
        assert!(allowed(&sources, Some("127.0.0.1:51234")));
        assert!(allowed(&sources, Some("[fd00::7]:443")));
        assert!(allowed(&sources, Some("127.0.0.1")));
        assert!(!allowed(&sources, Some("127.0.0.2:51234")));
        assert!(!allowed(&sources, Some("[fe80::1]:443")));
        assert!(!allowed(&sources, Some("envoy://internal")));
        assert!(!allowed(&sources, None));
        assert!(!allowed(&[], Some("127.0.0.1:1")));
    }
}
