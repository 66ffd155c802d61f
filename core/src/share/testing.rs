//! Envoy's shared data for the tests of the books and of the sync protocol: an in-memory
//! store with a CAS token per key, host failures on demand, and another worker's writes
//! slipped in before one of ours.

use crate::share::{SetError, Store, StoreFailed};
use std::collections::HashMap;

/// Each key's value and CAS token.
pub(crate) type Data = HashMap<String, (Vec<u8>, u32)>;
/// Another worker's writes, slipped in before one of ours.
pub(crate) type Interference = Box<dyn FnMut(&mut Data, &mut u32)>;

/// Envoy's shared data, as the host implements it: a CAS token per key that changes on
/// every write. `interfere` runs before a write and may change the store behind the
/// writer's back (another worker); `fail` makes host calls fail; `calls` counts them.
#[derive(Default)]
pub(crate) struct FakeStore {
    pub(crate) data: Data,
    pub(crate) next_cas: u32,
    pub(crate) interfere: Option<Interference>,
    pub(crate) fail: bool,
    pub(crate) calls: usize,
}

impl Store for FakeStore {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreFailed> {
        self.calls += 1;
        if self.fail {
            return Err(StoreFailed);
        }
        Ok(self.data.get(key).cloned())
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.calls += 1;
        if self.fail {
            return Err(SetError::Failed);
        }
        if let Some(f) = self.interfere.as_mut() {
            f(&mut self.data, &mut self.next_cas);
        }
        if let (Some(cas), Some((_, now))) = (cas, self.data.get(key)) {
            if cas != *now {
                return Err(SetError::CasMismatch);
            }
        }
        self.next_cas += 1;
        self.data
            .insert(key.to_string(), (value.to_vec(), self.next_cas));
        Ok(())
    }
}
