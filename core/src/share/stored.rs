//! Where each stored response is, for every VM of one Envoy: a bounded table in shared data
//! from a response's id to the node that stored it and the length of the conversation it
//! ends (see `ingest::stored` for why).
//!
//! - **Slots**: `slots` keys (`key`), an id in the slot its hash (FNV-1a) names. A new id
//!   overwrites whatever its slot held, so the table never grows past its slots (Envoy's
//!   shared data cannot delete a key) and keeps the most recent ids; an id whose slot was
//!   taken since is not found, and what comes back to it is routed as any request is. A
//!   lookup checks the whole id, so a slot never answers for another id.
//! - **Writes** are unconditional (no compare-and-swap): one id is written by the one VM that
//!   followed its answer, once when the id comes (so a background response's poll finds it at
//!   once) and again when the answer ends, with its output counted.
//! - **The value**: the id, the node's address (an address, not a slot: it means the same in
//!   every VM and across reconfigurations) and the conversation's tokens so far (its prompt,
//!   the stored turns included, and its output).

use super::codec::Reader;
use super::{Store, StoreFailed};

/// Slots by default: 16,384 conversations at about 100 bytes each, under 2 MB.
pub const DEFAULT_SLOTS: u32 = 16_384;
/// Most slots a configuration may ask for.
pub const MAX_SLOTS: u32 = 1 << 20;

/// What is known of one stored response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The node that answered it, as `ip:port`.
    pub address: String,
    /// The conversation's tokens up to and with this answer: what a turn continuing it adds
    /// to its own prompt.
    pub context_tokens: u64,
}

/// The key of the slot `id` goes in.
pub fn key(id: &str, slots: u32) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("token_balancer.stored.{}", h % u64::from(slots.max(1)))
}

fn encode(id: &str, s: &Stored) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + id.len() + s.address.len());
    for part in [id, s.address.as_str()] {
        let len = u16::try_from(part.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(part.as_bytes().get(..usize::from(len)).unwrap_or_default());
    }
    out.extend_from_slice(&s.context_tokens.to_le_bytes());
    out
}

fn decode(bytes: &[u8]) -> Option<(String, Stored)> {
    let mut r = Reader::new(bytes);
    let id = r.str()?;
    let address = r.str()?;
    let context_tokens = r.u64()?;
    Some((
        id,
        Stored {
            address,
            context_tokens,
        },
    ))
}

/// Notes that `id` is stored as `stored` says, in its slot.
pub fn record<S: Store>(store: &mut S, slots: u32, id: &str, stored: &Stored) -> bool {
    store
        .set(&key(id, slots), &encode(id, stored), None)
        .is_ok()
}

/// What is known of `id`: `Ok(None)` when its slot holds another id or nothing.
pub fn find<S: Store>(store: &mut S, slots: u32, id: &str) -> Result<Option<Stored>, StoreFailed> {
    let Some((bytes, _)) = store.get(&key(id, slots))? else {
        return Ok(None);
    };
    Ok(decode(&bytes)
        .filter(|(kept, _)| kept == id)
        .map(|(_, s)| s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::testing::FakeStore;

    fn at(address: &str, context_tokens: u64) -> Stored {
        Stored {
            address: address.to_string(),
            context_tokens,
        }
    }

    #[test]
    fn an_id_is_found_where_it_was_recorded_and_nowhere_else() {
        let mut store = FakeStore::default();
        assert_eq!(find(&mut store, 64, "resp_1"), Ok(None));
        assert!(record(&mut store, 64, "resp_1", &at("10.0.0.1:8000", 120)));
        assert_eq!(
            find(&mut store, 64, "resp_1"),
            Ok(Some(at("10.0.0.1:8000", 120)))
        );
        // Written again at its end, with its output.
        assert!(record(&mut store, 64, "resp_1", &at("10.0.0.1:8000", 180)));
        assert_eq!(
            find(&mut store, 64, "resp_1"),
            Ok(Some(at("10.0.0.1:8000", 180)))
        );
        assert_eq!(find(&mut store, 64, "resp_2"), Ok(None));
    }

    #[test]
    fn the_table_is_bounded_and_a_slot_answers_only_for_its_id() {
        let mut store = FakeStore::default();
        for i in 0..1000 {
            let id = format!("resp_{i}");
            assert!(record(&mut store, 8, &id, &at("10.0.0.1:8000", i)));
        }
        assert!(store.data.len() <= 8);
        // The last id of each slot is found; an id overwritten since is not, and never
        // another's.
        let found = (0..1000)
            .filter(|i| {
                let id = format!("resp_{i}");
                match find(&mut store, 8, &id).unwrap() {
                    Some(s) => {
                        assert_eq!(s.context_tokens, *i);
                        true
                    }
                    None => false,
                }
            })
            .count();
        assert!((1..=8).contains(&found), "{found}");
    }

    #[test]
    fn garbage_in_a_slot_is_no_entry() {
        let mut store = FakeStore::default();
        for bytes in [&b""[..], b"\x05\x00res", b"\x06\x00resp_1\x01\x00a"] {
            store.set(&key("resp_1", 4), bytes, None).unwrap();
            assert_eq!(find(&mut store, 4, "resp_1"), Ok(None));
        }
    }
}
