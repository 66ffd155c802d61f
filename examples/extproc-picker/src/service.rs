//! The ext_proc gRPC service: one bidirectional stream per HTTP request, each message answered
//! by the request's `Session` under the picker's lock; and a small HTTP endpoint with the
//! picker's counters, which the benchmark reads to know the picks came from here.
//!
//! Answers are produced as tonic asks for them (`stream::unfold` over the inbound messages),
//! without a task or a channel per request. When the stream ends (Envoy closes it, or the
//! request is reset) the session is dropped and releases whatever it still has booked.

use crate::picker::{lock, Picker, Session};
use crate::poller::Clock;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status, Streaming};

pub struct Service {
    pub picker: Arc<Mutex<Picker>>,
    pub clock: Clock,
}

/// One request's stream: its session, released when the stream is dropped.
struct Open {
    picker: Arc<Mutex<Picker>>,
    session: Session,
    clock: Clock,
}

impl Open {
    fn on_message(&mut self, msg: ProcessingRequest) -> Option<ProcessingResponse> {
        let now = (self.clock)();
        self.session.on_message(&mut lock(&self.picker), msg, now)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.session.end(&mut lock(&self.picker));
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let inbound = request.into_inner();
        let open = Open {
            picker: self.picker.clone(),
            session: Session::new(&mut lock(&self.picker)),
            clock: self.clock,
        };
        let answers =
            futures_util::stream::unfold((inbound, open), |(mut inbound, mut open)| async move {
                loop {
                    match inbound.message().await {
                        Ok(Some(msg)) => {
                            if let Some(reply) = open.on_message(msg) {
                                return Some((Ok(reply), (inbound, open)));
                            }
                        }
                        Ok(None) | Err(_) => return None,
                    }
                }
            });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// Serves `GET /stats` (the picker's counters as JSON) on `listener`, for ever.
pub async fn serve_stats(listener: TcpListener, picker: Arc<Mutex<Picker>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let picker = picker.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let picker = picker.clone();
                    async move {
                        let (status, body) = if req.uri().path() == "/stats" {
                            (200, lock(&picker).stats_json())
                        } else {
                            (404, String::from("{\"error\": \"only GET /stats\"}"))
                        };
                        let response = hyper::Response::builder()
                            .status(status)
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from(body)))
                            .unwrap_or_else(|_| hyper::Response::new(Full::new(Bytes::new())));
                        Ok::<_, Infallible>(response)
                    }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
