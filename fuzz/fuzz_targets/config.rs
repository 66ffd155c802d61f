#![no_main]
// The target's logic and its invariants live in fuzz/src/lib.rs, shared with the corpus replay
// test (core/tests/fuzz_corpus.rs in the core crate), so the two never diverge.
libfuzzer_sys::fuzz_target!(|data: &[u8]| token_balancer_fuzz::config(data));
