//! extproc-picker: token-balancer's decision core as an external endpoint picker behind
//! Envoy's `ext_proc` HTTP filter, the way the Kubernetes Gateway API Inference Extension's
//! endpoint picker (EPP) sits behind Envoy: a gRPC stream to a separate process for every
//! request. It exists to measure what that architecture costs against the in-proxy Wasm
//! filter, running the same core on the same configuration (`examples/overhead.py`).
//!
//! ```text
//! extproc-picker --listen 127.0.0.1:9002 --stats 127.0.0.1:9003 --config '{"nodes": [...], ...}' [--follow-output]
//! ```
//!
//! `--config` is the filter's JSON configuration (`docs/CONFIGURATION.md`), or `@file` to read
//! it from a file; `membership` is refused (following the cluster needs Envoy's admin).
//! `--stats` serves the picker's counters at `GET /stats`. The picker polls every node
//! itself (`poller`, `polls`) and answers Envoy's ext_proc streams (`service`, `picker`), all
//! on one thread (a tokio current-thread runtime), its state behind one mutex: like the filter
//! with `poller: vm` on a single Envoy worker.
//!
//! Processing mode, as Envoy must be configured for it:
//!
//! | phase | mode | what the picker does |
//! |---|---|---|
//! | request headers | `SEND` | removes a client's routing header; skips the rest for requests whose body cannot be read (`mode_override`, with `allow_mode_override: true`) |
//! | request body | `BUFFERED` | reads it, routes, answers with the `x-gateway-destination-endpoint` header mutation (no route cache clearing: `override_host` reads the header at host selection) |
//! | response headers | `SEND` | releases the request's booking |
//! | response body, trailers | `NONE`, `SKIP` | - (with `--follow-output`, the body `STREAMED`: each piece advances the booking, the last releases it) |
//!
//! Three messages and three answers per routed request, each a round trip on the request's
//! path. The inference gateway's own configurations ask at least as much of Envoy: its Helm
//! chart's Envoy Gateway policy is the same (request body buffered, response headers sent),
//! and its Envoy patch streams the request body (`FULL_DUPLEX_STREAMED`) with request trailers
//! `SEND`, and optionally the response body and trailers too (for usage accounting), which is
//! a message more per body chunk. So this is the cheapest configuration that still routes on
//! the body and releases on the response: it favours the peer.

mod picker;
mod poller;
mod polls;
mod service;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use picker::Picker;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use token_balancer_core::config::Config;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

struct Args {
    listen: SocketAddr,
    stats: Option<SocketAddr>,
    config: Vec<u8>,
    follow_output: bool,
}

const USAGE: &str =
    "usage: extproc-picker --listen IP:PORT [--stats IP:PORT] --config JSON|@FILE [--follow-output]";

fn args() -> Result<Args, String> {
    let mut listen = None;
    let mut stats = None;
    let mut config = None;
    let mut follow_output = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--follow-output" {
            follow_output = true;
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--listen" => listen = Some(value.parse().map_err(|e| format!("--listen: {e}"))?),
            "--stats" => stats = Some(value.parse().map_err(|e| format!("--stats: {e}"))?),
            "--config" => {
                config = Some(match value.strip_prefix('@') {
                    Some(path) => {
                        std::fs::read(path).map_err(|e| format!("--config {path}: {e}"))?
                    }
                    None => value.into_bytes(),
                })
            }
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    Ok(Args {
        listen: listen.ok_or(format!("--listen is required\n{USAGE}"))?,
        stats,
        config: config.ok_or(format!("--config is required\n{USAGE}"))?,
        follow_output,
    })
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let config = match Config::parse(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if config.membership.is_some() {
        eprintln!("extproc-picker: `membership` is not supported (it needs Envoy's admin); list the nodes");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("extproc-picker: no runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("extproc-picker: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args, config: Config) -> Result<(), Box<dyn std::error::Error>> {
    let nodes = config.nodes.len();
    let seed = now_ms() ^ (u64::from(std::process::id()) << 20);
    let mut picker = Picker::new(config, seed);
    picker.follow_output = args.follow_output;
    let picker = Arc::new(Mutex::new(picker));
    if let Some(addr) = args.stats {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tokio::spawn(service::serve_stats(listener, picker.clone()));
    }
    tokio::spawn(poller::run(picker.clone(), now_ms));
    let grpc = tokio::net::TcpListener::bind(args.listen).await?;
    eprintln!(
        "extproc-picker listening on {} ({nodes} nodes)",
        grpc.local_addr()?
    );
    let incoming = accepted(grpc);
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(ExternalProcessorServer::new(service::Service {
            picker,
            clock: now_ms,
        }))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}

/// The accepted connections of `listener`, with Nagle off (answers are small and latency is
/// what is measured).
fn accepted(
    listener: tokio::net::TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(s, _)| {
            let _ = s.set_nodelay(true);
            s
        });
        Some((accepted, listener))
    })
}
