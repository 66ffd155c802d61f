//! The picker's polls over HTTP: a timer that sends the polls `polls` says are due, and one
//! task per poll that GETs the node and hands the answer back to the picker.
//!
//! The filter's polls are Envoy callouts through its health cluster; here they are plain
//! HTTP/1.1 GETs from a pooled keep-alive client, each with the configured
//! `health_timeout_ms`. The first round goes out 50 ms after the start, as the filter's.
//! The lock on the picker is held only to decide and to take an answer, never across a wait.

use crate::picker::{lock, Picker};
use crate::polls::{Fetched, Poll, MAX_ANSWER_BYTES};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Wall-clock milliseconds, as the filter reads Envoy's clock; tests pass their own values.
pub type Clock = fn() -> u64;

/// Delay before the first round of polls.
const FIRST_POLL: Duration = Duration::from_millis(50);

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// Polls for ever: sends what is due, then sleeps for the period the schedule asks.
pub async fn run(picker: Arc<Mutex<Picker>>, clock: Clock) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(connector);
    tokio::time::sleep(FIRST_POLL).await;
    loop {
        let (due, period_ms) = lock(&picker).due_polls(clock());
        for poll in due {
            tokio::spawn(answer(client.clone(), picker.clone(), clock, poll));
        }
        tokio::time::sleep(Duration::from_millis(period_ms.max(1))).await;
    }
}

/// Sends `poll`, gives its answer to the picker, and sends at once the poll that answer
/// asks for (node discovery), until none.
async fn answer(client: HttpClient, picker: Arc<Mutex<Picker>>, clock: Clock, poll: Poll) {
    let mut poll = poll;
    loop {
        let fetched = fetch(&client, &poll).await;
        let next = lock(&picker).on_answer(poll.token, poll.kind, &fetched, clock());
        match next {
            Some(p) => poll = p,
            None => return,
        }
    }
}

async fn fetch(client: &HttpClient, poll: &Poll) -> Fetched {
    let Ok(uri) = format!("http://{}{}", poll.target, poll.path).parse::<hyper::Uri>() else {
        return Fetched::NoAnswer;
    };
    let Ok(request) = hyper::Request::get(uri)
        .header("user-agent", "token-balancer")
        .body(Empty::<Bytes>::new())
    else {
        return Fetched::NoAnswer;
    };
    let call = async {
        let Ok(response) = client.request(request).await else {
            return Fetched::NoAnswer;
        };
        let status = response.status().as_u16();
        if status != 200 {
            return Fetched::Status(status);
        }
        match Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
        {
            Ok(body) => Fetched::Body(body.to_bytes().to_vec()),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Fetched::TooLarge,
            Err(_) => Fetched::NoAnswer,
        }
    };
    tokio::time::timeout(poll.timeout, call)
        .await
        .unwrap_or(Fetched::NoAnswer)
}
