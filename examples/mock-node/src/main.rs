//! mock-gpu-node: serves one or more mock GPU inference nodes, each on its own port, each an
//! OpenAI-compatible API in front of the continuous-batching engine model (`engine.rs`).
//! See README.md for the flags and endpoints.

mod api;
mod cli;
mod node;

use cli::Command;
use hyper_util::rt::TokioIo;
use node::Node;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

fn main() {
    // args_os: a non-UTF-8 argument is an error message, not a panic.
    let argv: Result<Vec<String>, String> = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not UTF-8"))
        })
        .collect();
    let args = match argv.and_then(cli::parse) {
        Ok(Command::Run(args)) => args,
        Ok(Command::Help) => {
            println!("{}", cli::USAGE);
            return;
        }
        Err(e) => {
            eprintln!("mock-gpu-node: {e}\n(try --help)");
            std::process::exit(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mock-gpu-node: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    runtime.block_on(run(args));
}

async fn run(args: cli::Args) {
    // Bind every port before announcing any, so "listening" means all nodes are up.
    let mut bound = vec![];
    for spec in &args.nodes {
        match TcpListener::bind((args.bind.as_str(), spec.port)).await {
            Ok(l) => bound.push(l),
            Err(e) => {
                eprintln!(
                    "mock-gpu-node: cannot listen on {}:{}: {e}",
                    args.bind, spec.port
                );
                std::process::exit(1);
            }
        }
    }
    let mut out = std::io::stdout().lock();
    for (spec, listener) in args.nodes.iter().zip(bound) {
        let port = listener.local_addr().map_or(spec.port, |a| a.port());
        let node = Node::new(spec, args.time_scale);
        tokio::spawn(node.clone().drive());
        tokio::spawn(serve(listener, node));
        let _ = writeln!(
            out,
            "listening name={} port={port} gpu={}",
            spec.name, spec.gpu
        );
    }
    let _ = out.flush();
    drop(out);
    // Serve until killed.
    std::future::pending::<()>().await;
}

async fn serve(listener: TcpListener, node: Arc<Node>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                eprintln!("mock-gpu-node: {}: accept: {e}", node.name);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let node = node.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| api::handle(node.clone(), req));
            // Keep-alive is hyper's default: Envoy pools its upstream connections.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
