//! Where each stored response is, for every VM of one Envoy: a bounded table in shared data
//! from a response's id to the node that stored it and the length of the conversation it
//! ends (see `ingest::stored` for why).
//!
//! - **Buckets**: `slots / WAYS` keys (`key`), each holding up to `WAYS` ids, the most recently
//!   written first; an id goes in the bucket its hash (`prompt::hash_str`) names. A new id pushes out the
//!   bucket's oldest, so the table never grows past its slots (Envoy's shared data cannot
//!   delete a key) and keeps the most recent ids. One id a key would lose an id whenever two
//!   live conversations' ids met in one key: with a thousand conversations alive in 16,384
//!   keys, one in fifty or so (measured through Envoy: 18 to 28 turns of 950 not found); four
//!   a key lose one only when five meet. An id pushed out is not found, and what comes back to
//!   it is routed as any request is. A lookup checks the whole id, so a bucket never answers
//!   for another id.
//! - **Writes** read the bucket and write it back with compare-and-swap, retried up to
//!   `MAX_CAS_RETRIES` times (two workers writing one bucket at once must not drop each
//!   other's id). A key's first write cannot be conditional (Envoy's shared data has no
//!   create-if-absent), so two first writes to one key at once keep only one id. One id is written by the one VM that followed its answer, once when the id
//!   comes (so a background response's poll finds it at once) and again when the answer
//!   ends, with its output counted.
//! - **An entry**: the id, the node's address (an address, not a slot: it means the same in
//!   every VM and across reconfigurations) and the conversation's tokens so far (its prompt,
//!   the stored turns included, and its output).

use super::codec::Reader;
use super::{SetError, Store, StoreFailed, MAX_CAS_RETRIES};
use crate::ingest::prompt::hash_str;

/// Ids by default: 16,384 conversations at about 100 bytes each, under 2 MB.
pub const DEFAULT_SLOTS: u32 = 16_384;
/// Most ids a configuration may ask for.
pub const MAX_SLOTS: u32 = 1 << 20;
/// Ids one key holds.
pub const WAYS: usize = 4;
/// Nodes asked by default where a response this Envoy has not seen is stored (see
/// `ingest::stored`): every node of a fleet of up to 32.
pub const DEFAULT_ASK_NODES: u32 = 32;
/// Most nodes a configuration may have asked for one request.
pub const MAX_ASK_NODES: u32 = 256;

/// What is known of one stored response.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stored {
    /// The node that answered it, as `ip:port`.
    pub address: String,
    /// The conversation's tokens up to and with this answer: what a turn continuing it adds
    /// to its own prompt.
    pub context_tokens: u64,
    /// Its prompt's tokens (the stored turns before it included): KV its node held from its
    /// first token to its end.
    pub prompt_tokens: u64,
    /// When its first bytes came back (ms), and when it ended (0: not yet): a report of its
    /// node taken between the two counts its prompt as KV in use.
    pub seen_ms: u64,
    pub ended_ms: u64,
}

impl Stored {
    /// Of a turn continuing this answer, the prompt tokens a report of its node taken at
    /// `reported_at_ms` still counts as KV in use: this answer's prompt when the report was
    /// taken while it ran (a turn comes right after the one before it, sooner than the next
    /// report), none otherwise (the engine then counts them as cached, free until the turn
    /// takes them back).
    pub fn shown_at(&self, reported_at_ms: u64) -> u64 {
        let ran = self.seen_ms <= reported_at_ms && reported_at_ms < self.ended_ms;
        if ran {
            self.prompt_tokens
        } else {
            0
        }
    }
}

/// The key of the bucket `id` goes in, of a table of `slots` ids.
pub fn key(id: &str, slots: u32) -> String {
    let h = hash_str(0, id);
    let buckets = (u64::from(slots) / WAYS as u64).max(1);
    format!("token_balancer.stored.{}", h % buckets)
}

type Entry = (String, Stored);

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * 100);
    for (id, s) in entries {
        for part in [id.as_str(), s.address.as_str()] {
            let len = u16::try_from(part.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(part.as_bytes().get(..usize::from(len)).unwrap_or_default());
        }
        for n in [s.context_tokens, s.prompt_tokens, s.seen_ms, s.ended_ms] {
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    out
}

/// A bucket's entries; what follows a malformed one is dropped.
fn decode(bytes: &[u8]) -> Vec<Entry> {
    let mut r = Reader::new(bytes);
    let mut out = Vec::new();
    while out.len() < WAYS {
        let entry = (|| {
            let id = r.str()?;
            let address = r.str()?;
            Some((
                id,
                Stored {
                    address,
                    context_tokens: r.u64()?,
                    prompt_tokens: r.u64()?,
                    seen_ms: r.u64()?,
                    ended_ms: r.u64()?,
                },
            ))
        })();
        match entry {
            Some(e) => out.push(e),
            None => break,
        }
    }
    out
}

/// Notes that `id` is stored as `stored` says, first in its bucket; false when the write
/// failed (or lost every compare-and-swap).
pub fn record<S: Store>(store: &mut S, slots: u32, id: &str, stored: &Stored) -> bool {
    let key = key(id, slots);
    for _ in 0..=MAX_CAS_RETRIES {
        let Ok(current) = store.get(&key) else {
            return false;
        };
        let (mut entries, cas) = match current {
            Some((bytes, cas)) => (decode(&bytes), Some(cas)),
            None => (Vec::new(), None),
        };
        entries.retain(|(kept, _)| kept != id);
        entries.insert(0, (id.to_string(), stored.clone()));
        entries.truncate(WAYS);
        match store.set(&key, &encode(&entries), cas) {
            Ok(()) => return true,
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Failed) => return false,
        }
    }
    false
}

/// What is known of `id`: `Ok(None)` when its bucket does not hold it.
pub fn find<S: Store>(store: &mut S, slots: u32, id: &str) -> Result<Option<Stored>, StoreFailed> {
    let Some((bytes, _)) = store.get(&key(id, slots))? else {
        return Ok(None);
    };
    Ok(decode(&bytes)
        .into_iter()
        .find(|(kept, _)| kept == id)
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
            prompt_tokens: context_tokens / 2,
            seen_ms: 10,
            ended_ms: 20,
        }
    }

    #[test]
    fn a_report_taken_while_the_answer_ran_still_counts_its_prompt() {
        let s = at("10.0.0.1:8000", 300);
        assert_eq!(s.shown_at(5), 0, "before it started");
        assert_eq!(s.shown_at(10), 150);
        assert_eq!(s.shown_at(19), 150);
        assert_eq!(s.shown_at(20), 0, "after it ended");
        let running = Stored { ended_ms: 0, ..s };
        assert_eq!(
            running.shown_at(15),
            0,
            "not ended: no turn continues it yet"
        );
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
    fn the_table_is_bounded_and_keeps_the_newest_ids() {
        let mut store = FakeStore::default();
        for i in 0..1000 {
            let id = format!("resp_{i}");
            assert!(record(&mut store, 8, &id, &at("10.0.0.1:8000", i)));
        }
        // Two keys of four ids.
        assert!(store.data.len() <= 2);
        let found: Vec<u64> = (0..1000)
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
            .collect();
        assert_eq!(found.len(), 8, "{found:?}");
        assert!(found.iter().all(|i| *i >= 990), "the newest: {found:?}");
    }

    #[test]
    fn ids_that_share_a_key_are_all_kept() {
        let mut store = FakeStore::default();
        // One key: every id shares it, and the four newest are found.
        for i in 0..WAYS as u64 + 1 {
            assert!(record(
                &mut store,
                1,
                &format!("resp_{i}"),
                &at("10.0.0.1:8000", i)
            ));
        }
        assert_eq!(find(&mut store, 1, "resp_0"), Ok(None));
        for i in 1..=WAYS as u64 {
            assert_eq!(
                find(&mut store, 1, &format!("resp_{i}")),
                Ok(Some(at("10.0.0.1:8000", i)))
            );
        }
        // Written again, an id moves to the front and is not kept twice.
        assert!(record(&mut store, 1, "resp_1", &at("10.0.0.2:8000", 9)));
        assert!(record(&mut store, 1, "resp_5", &at("10.0.0.1:8000", 5)));
        assert_eq!(
            find(&mut store, 1, "resp_1"),
            Ok(Some(at("10.0.0.2:8000", 9)))
        );
        assert_eq!(find(&mut store, 1, "resp_2"), Ok(None));
    }

    #[test]
    fn a_write_racing_another_workers_keeps_both() {
        let mut store = FakeStore::default();
        assert!(record(&mut store, 1, "resp_a", &at("10.0.0.1:8000", 1)));
        // Another worker writes its id between our read and our write, once.
        let mut once = true;
        store.interfere = Some(Box::new(move |data, cas| {
            if std::mem::take(&mut once) {
                let k = key("resp_b", 1);
                let theirs = encode(&[
                    ("resp_b".to_string(), at("10.0.0.2:8000", 2)),
                    ("resp_a".to_string(), at("10.0.0.1:8000", 1)),
                ]);
                *cas += 1;
                data.insert(k, (theirs, *cas));
            }
        }));
        assert!(record(&mut store, 1, "resp_c", &at("10.0.0.3:8000", 3)));
        store.interfere = None;
        for (id, addr) in [
            ("resp_a", "10.0.0.1:8000"),
            ("resp_b", "10.0.0.2:8000"),
            ("resp_c", "10.0.0.3:8000"),
        ] {
            assert_eq!(
                find(&mut store, 1, id).unwrap().map(|s| s.address),
                Some(addr.to_string()),
                "{id}"
            );
        }
        // With the store failing, nothing is written and nothing panics.
        store.fail = true;
        assert!(!record(&mut store, 1, "resp_d", &at("10.0.0.1:8000", 1)));
        assert_eq!(find(&mut store, 1, "resp_a"), Err(StoreFailed));
    }

    #[test]
    fn garbage_in_a_bucket_is_no_entry() {
        let mut store = FakeStore::default();
        for bytes in [&b""[..], b"\x05\x00res", b"\x06\x00resp_1\x01\x00a"] {
            store.set(&key("resp_1", 4), bytes, None).unwrap();
            assert_eq!(find(&mut store, 4, "resp_1"), Ok(None));
        }
        // A record over garbage replaces it.
        assert!(record(&mut store, 4, "resp_1", &at("10.0.0.1:8000", 7)));
        assert_eq!(
            find(&mut store, 4, "resp_1"),
            Ok(Some(at("10.0.0.1:8000", 7)))
        );
    }
}
