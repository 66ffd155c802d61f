//! State shared by every VM of one Envoy process: the fleet snapshot the poller publishes and
//! the in-flight books all workers write.
//!
//! Envoy runs one Wasm VM per worker thread plus one on the main thread, and each VM has its
//! own memory. Left alone, every VM polls every node (five polls per tick with four workers)
//! and counts only its own dispatches, so a worker cannot see what the other workers sent a
//! node since its last report: the herding the in-flight books exist to stop comes back, one
//! worker at a time. proxy-wasm's shared data (a key-value store per `vm_id`, with a
//! compare-and-swap token per key) is the one memory all of them see. This module is what goes
//! into it, and the rules for changing it, as plain Rust behind the narrow `Store` trait.
//!
//! - **The fleet snapshot** (`Snapshot`, under `FLEET_KEY`): per node its last good report and
//!   when it was taken, its report epoch, whether it is ejected or out of the cluster, and what
//!   is known of its models. One writer (the poller service) replaces it whole; readers (the
//!   filter VMs) re-read it only when the small version record under `VERSION_KEY` changes,
//!   which they check once per request and per tick. The version record also carries the
//!   poller's heartbeat, written every tick, so a reader tells a dead poller from a quiet fleet.
//!   The encoding is a compact binary layout (about 120 bytes a node): decoding 1,000 nodes
//!   (120 KB) takes about 0.16 ms natively and 0.67 ms as wasm32-wasip1 under Node's V8,
//!   release builds (`decode_cost_of_a_thousand_nodes`, run with `--ignored`).
//! - **The books** (`Books`, one key per slot of the poller's fleet, `books_key`): in-flight
//!   requests and tokens, the unreflected part (dispatched since the report of `epoch`) and
//!   the KV growth still to come: the same `fleet::books` a balancer keeps for itself, changed
//!   by the same `Change`s. Every VM read-modify-writes them with CAS (`Ledger::update`),
//!   retrying up to `MAX_CAS_RETRIES` times. No key per request or per address: a slot is a
//!   node's index in the snapshot, at most `membership::MAX_NODES` of them, and a slot freed
//!   by a node that left the cluster is reused for the next new one once its books are empty.
//!   The books outlive a VM's reconfiguration: a request routed before it is still released
//!   into them, at its node's address (`Balancer::holder`).
//! - **The tenant rule**: books carry the address they count for (`node::tenant_of`), and
//!   the poller claims a reused slot's books for the new address (`ensure_books`) before it
//!   publishes the snapshot showing it. A change booked for the former address (a release
//!   that was kept for later, a worker whose snapshot is older) finds another tenant and is
//!   dropped (`Written::Gone`): it can never land on the new node's books.
//! - **The epoch rule** (`fleet::books`): a node's report epoch grows with every report the
//!   poller takes. When an update finds the snapshot's epoch newer than the books', the
//!   unreflected part resets (that report now reflects that work) before the change applies;
//!   a change's unreflected part applies only if the books are at the epoch it was booked at.
//!   So a release never takes away work a newer report already cleared.
//!
//! Changes are signed deltas (`Change`), so a change that could not be written (retries
//! exhausted, key missing, host error) is kept in the VM (`Ledger`'s pending changes), merged
//! into the next write to that node and retried on every tick: nothing is lost, and when every
//! dispatch is released the books are exactly zero again. What that costs: until the pending
//! change is written, the other workers do not see it (they decide on books that miss it, as
//! every VM did before shared books), and this VM sees it only in its own view (`view` adds
//! its pending changes).
//!
//! - **The wake list** (`wake`, under `wake::WAKE_KEY`): the slots of nodes the workers sent a
//!   prompt to while the poller polls them less often than every tick, so it polls them every
//!   tick again while the prompt waits, without reading every quiet node's books every tick.
//!
//! The parts: `codec` (the bytes of the snapshot, the version record and the books), `ledger`
//! (the read-modify-writes of the books), `fleet` (a balancer's nodes to the snapshot and
//! back), `sync` (the protocol between the poller service and the workers' VMs over them).
pub mod codec;
pub mod fleet;
pub mod journal;
pub mod ledger;
pub mod stored;
pub mod sync;
#[cfg(test)]
pub(crate) mod testing;
pub mod wake;

pub use crate::fleet::books::{Books, Change, Unreflected};
pub use codec::{Malformed, NodeView, Snapshot, Version, BOOKS_LEN};
pub use ledger::{ensure_books, read as read_books, Ledger, Written};

/// Root id of the poller service: the bootstrap extension loads the same `.wasm` with this
/// `root_id`, and the plugin tells its role by its `plugin_root_id` property.
pub const POLLER_ROOT_ID: &str = "token_balancer_poller";
/// Key of the fleet snapshot.
pub const FLEET_KEY: &str = "token_balancer.fleet";
/// Key of the snapshot's version record (`Version`).
pub const VERSION_KEY: &str = "token_balancer.fleet.version";
/// Compare-and-swap attempts after the first before a change is kept for later.
pub const MAX_CAS_RETRIES: u32 = 8;

/// The books of the node in slot `slot` of the poller's fleet (its index in the snapshot) live
/// under this key. Keys are per slot, not per address: Envoy's shared data cannot delete a key,
/// so keys named after addresses would grow with every pod ever replaced, while slots are
/// reused (see `membership`) and bounded by `membership::MAX_NODES`.
pub fn books_key(slot: usize) -> String {
    format!("token_balancer.books.{slot}")
}

/// A host call to the store failed (not a CAS mismatch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFailed;

/// Why a write did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetError {
    /// The value changed since it was read (its CAS token no longer matches).
    CasMismatch,
    Failed,
}

/// A value read from the store, with the CAS token it was read at.
pub type Read = (Vec<u8>, u32);

/// proxy-wasm shared data, as this module needs it.
pub trait Store {
    /// The value under `key` with its CAS token; `Ok(None)` when there is none.
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreFailed>;
    /// Writes `value` under `key` if its CAS token is still `cas` (`None`: unconditionally).
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
}
