//! A fake Envoy for the glue's unit tests: the `Host` trait over an in-memory world of
//! streams (each context's headers and bodies, and whether it was resumed or answered),
//! callouts sent, stats by name, shared data with CAS tokens, and a clock the test moves.
//!
//! Like Envoy, it acts on the effective context: a test `enter`s a context before calling
//! one of its callbacks, and `set_effective_context` moves it as the real host does.

use crate::host::Host;
use proxy_wasm::types::{MetricType, Status};
use std::cell::{RefCell, RefMut};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;
use token_balancer_core::share::{SetError, Store, StoreFailed};

/// One stream (HTTP context) as the host sees it.
#[derive(Debug, Default)]
pub struct Stream {
    pub request: Vec<(String, String)>,
    pub response: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub response_body: Vec<u8>,
    /// Times the paused request was resumed.
    pub resumed: u32,
    /// The status of the filter's own answer, if it sent one.
    pub reply: Option<u32>,
    /// The downstream address (`source.address`).
    pub source: Option<String>,
    /// The upstream host the response came from (`upstream.address`); `None`: Envoy cannot say.
    pub upstream: Option<String>,
    /// What the filter set in the stream's filter state, by key.
    pub filter_state: HashMap<String, String>,
}

/// A callout sent.
#[derive(Debug, Clone)]
pub struct Call {
    pub token: u32,
    pub cluster: String,
    pub path: String,
    /// `:authority`: the node's address, for the health cluster.
    pub authority: String,
}

#[derive(Debug, Default)]
pub struct World {
    pub now_ms: u64,
    /// The effective context.
    pub current: u32,
    pub streams: HashMap<u32, Stream>,
    /// Callouts sent, oldest first.
    pub calls: Vec<Call>,
    next_token: u32,
    /// The callout being answered: its status (`None`: reset) and body.
    pub answer: (Option<String>, Vec<u8>),
    pub configuration: Vec<u8>,
    pub root_id: Option<Vec<u8>>,
    pub tick: Option<Duration>,
    /// (kind, name, value), id = index + 1.
    metrics: Vec<(MetricType, String, i64)>,
    /// Calls to `define_metric` (Envoy keeps an id for each, even of a name defined before).
    pub defines: usize,
    /// Every host call made, in order, by name (with the header or key it named): what a
    /// callback costs in host crossings, which are most of the filter's cost inside Envoy.
    pub host_calls: Vec<String>,
    pub shared: HashMap<String, (Vec<u8>, u32)>,
    cas: u32,
    /// Header writes fail (Envoy refusing them).
    pub refuse_headers: bool,
    /// The wake-up queues registered, by name, each with the tokens in it.
    pub queues: Vec<(String, u32)>,
    /// The context whose callback is running (`enter`): `current` moves with
    /// `set_effective_context`, this does not.
    pub caller: u32,
    /// Local replies sent for a stream other than the one whose callback was running, as
    /// (caller, stream answered). Envoy stops the caller's own processing after such a reply
    /// when the caller is a stream in a request or response callback.
    pub answered_for_others: Vec<(u32, u32)>,
}

fn get<'a>(list: &'a [(String, String)], name: &str) -> Option<&'a str> {
    list.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn set(list: &mut Vec<(String, String)>, name: &str, value: &str) {
    list.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    list.push((name.to_string(), value.to_string()));
}

impl World {
    fn stream(&mut self) -> &mut Stream {
        self.streams.entry(self.current).or_default()
    }
}

/// The fake host; clones share one world.
#[derive(Debug, Clone, Default)]
pub struct FakeHost(Rc<RefCell<World>>);

impl FakeHost {
    pub fn world(&self) -> RefMut<'_, World> {
        self.0.borrow_mut()
    }

    /// Makes `context_id` the effective context (Envoy does before each callback).
    pub fn enter(&self, context_id: u32) {
        let mut w = self.world();
        w.current = context_id;
        w.caller = context_id;
    }

    /// Tokens waiting in the wake-up queues registered (a test registers one, by its VM).
    pub fn queued(&self) -> u32 {
        self.world().queues.iter().map(|(_, n)| n).sum()
    }

    /// The stream of `context_id`, made if new.
    pub fn stream(&self, context_id: u32) -> RefMut<'_, Stream> {
        RefMut::map(self.world(), |w| w.streams.entry(context_id).or_default())
    }

    /// A request header of stream `context_id`.
    pub fn request_header_of(&self, context_id: u32, name: &str) -> Option<String> {
        get(&self.stream(context_id).request, name).map(str::to_string)
    }

    /// A response header of stream `context_id`.
    pub fn response_header_of(&self, context_id: u32, name: &str) -> Option<String> {
        get(&self.stream(context_id).response, name).map(str::to_string)
    }

    /// The value of the stat `name` (0 if it was never defined).
    pub fn metric(&self, name: &str) -> i64 {
        let w = self.world();
        w.metrics
            .iter()
            .find(|(_, n, _)| n == name)
            .map_or(0, |(_, _, v)| *v)
    }

    /// Every stat defined, with its kind, in definition order.
    pub fn metric_names(&self) -> Vec<(MetricType, String)> {
        let w = self.world();
        w.metrics.iter().map(|(k, n, _)| (*k, n.clone())).collect()
    }

    /// The callouts sent and not yet taken by the test.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut self.world().calls)
    }

    pub fn advance(&self, ms: u64) {
        self.world().now_ms += ms;
    }
}

impl Store for FakeHost {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreFailed> {
        self.log(format!("shared get {key}"));
        Ok(self.world().shared.get(key).cloned())
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.log(format!("shared set {key}"));
        let mut w = self.world();
        if let (Some(cas), Some((_, now))) = (cas, w.shared.get(key)) {
            if cas != *now {
                return Err(SetError::CasMismatch);
            }
        }
        w.cas += 1;
        let cas = w.cas;
        w.shared.insert(key.to_string(), (value.to_vec(), cas));
        Ok(())
    }
}

impl FakeHost {
    /// Notes one host call (see `World::host_calls`).
    fn log(&self, what: String) {
        self.world().host_calls.push(what);
    }

    /// The host calls made since the last look.
    pub fn take_host_calls(&self) -> Vec<String> {
        std::mem::take(&mut self.world().host_calls)
    }
}

impl Host for FakeHost {
    fn now_ms(&self) -> u64 {
        self.log("now_ms".into());
        self.world().now_ms
    }

    fn request_header(&self, name: &str) -> Option<String> {
        self.log(format!("request_header {name}"));
        get(&self.world().stream().request, name).map(str::to_string)
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), Status> {
        self.log(format!("set_request_header {name}"));
        let mut w = self.world();
        if w.refuse_headers {
            return Err(Status::InternalFailure);
        }
        set(&mut w.stream().request, name, value);
        Ok(())
    }

    fn remove_request_header(&self, name: &str) {
        self.log(format!("remove_request_header {name}"));
        self.world()
            .stream()
            .request
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    }

    fn response_header(&self, name: &str) -> Option<String> {
        self.log(format!("response_header {name}"));
        get(&self.world().stream().response, name).map(str::to_string)
    }

    fn set_response_header(&self, name: &str, value: &str) {
        self.log(format!("set_response_header {name}"));
        set(&mut self.world().stream().response, name, value);
    }

    fn source_address(&self) -> Option<String> {
        self.log("source_address".into());
        self.world().stream().source.clone()
    }

    fn upstream_address(&self) -> Option<String> {
        self.log("upstream_address".into());
        self.world().stream().upstream.clone()
    }

    fn set_filter_state(&self, key: &str, value: &str) {
        self.log(format!("set_filter_state {key}"));
        let mut w = self.world();
        w.stream()
            .filter_state
            .insert(key.to_string(), value.to_string());
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        self.log("request_body".into());
        let mut w = self.world();
        let body = &w.stream().body;
        Some(body.get(..size.min(body.len()))?.to_vec())
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        self.log("response_body".into());
        let mut w = self.world();
        let body = &w.stream().response_body;
        Some(body.get(..size.min(body.len()))?.to_vec())
    }

    fn send_response(
        &self,
        status: u32,
        headers: Vec<(&str, &str)>,
        body: &[u8],
    ) -> Result<(), Status> {
        self.log("send_response".into());
        let mut w = self.world();
        if w.caller != w.current {
            let pair = (w.caller, w.current);
            w.answered_for_others.push(pair);
        }
        let s = w.stream();
        s.reply = Some(status);
        s.response = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        s.response_body = body.to_vec();
        Ok(())
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        self.log("set_effective_context".into());
        self.world().current = context_id;
        Ok(())
    }

    fn resume_request(&self) {
        self.log("resume_request".into());
        self.world().stream().resumed += 1;
    }

    fn register_queue(&self, name: &str) -> Option<u32> {
        let mut w = self.world();
        w.queues.push((name.to_string(), 0));
        Some(w.queues.len() as u32)
    }

    fn wake(&self, queue: u32) {
        self.log("wake".into());
        if let Some((_, n)) = self
            .world()
            .queues
            .get_mut((queue as usize).wrapping_sub(1))
        {
            *n += 1;
        }
    }

    fn drain_queue(&self, queue: u32) {
        if let Some((_, n)) = self
            .world()
            .queues
            .get_mut((queue as usize).wrapping_sub(1))
        {
            *n = 0;
        }
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        _timeout: Duration,
    ) -> Result<u32, Status> {
        self.log(format!("dispatch {cluster}"));
        let mut w = self.world();
        w.next_token += 1;
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
                .unwrap_or_default()
        };
        let call = Call {
            token: w.next_token,
            cluster: cluster.to_string(),
            path: header(":path"),
            authority: header(":authority"),
        };
        w.calls.push(call);
        Ok(w.next_token)
    }

    fn call_status(&self) -> Option<String> {
        self.world().answer.0.clone()
    }

    fn call_body(&self, size: usize) -> Option<Vec<u8>> {
        let w = self.world();
        Some(w.answer.1.get(..size.min(w.answer.1.len()))?.to_vec())
    }

    fn plugin_configuration(&self) -> Vec<u8> {
        self.world().configuration.clone()
    }

    fn root_id(&self) -> Option<Vec<u8>> {
        self.world().root_id.clone()
    }

    fn set_tick_period(&self, period: Duration) {
        self.world().tick = Some(period);
    }

    /// The tests install no logger: nothing to follow.
    fn follow_log_level(&self) {}

    fn define_metric(&self, kind: MetricType, name: &str) -> u32 {
        let mut w = self.world();
        w.defines += 1;
        if let Some(i) = w.metrics.iter().position(|(_, n, _)| n == name) {
            return i as u32 + 1;
        }
        w.metrics.push((kind, name.to_string(), 0));
        w.metrics.len() as u32
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        self.log("increment_metric".into());
        if let Some(m) = self.world().metrics.get_mut(id as usize - 1) {
            m.2 += delta;
        }
    }

    fn record_metric(&self, id: u32, value: u64) {
        self.log("record_metric".into());
        if let Some(m) = self.world().metrics.get_mut(id as usize - 1) {
            m.2 = value as i64;
        }
    }
}
