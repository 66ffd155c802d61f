//! Replays every committed fuzz corpus file (fuzz/corpus/<target>/*) and every saved crash
//! reproducer (fuzz/artifacts-found/<target>/*) through the fuzz targets' own functions, on
//! stable Rust, in the ordinary `cargo test`. The targets live in fuzz/src/lib.rs, included here
//! as a module so that libFuzzer and this test run the very same code and invariants.

// Test code: a failed read or assertion is the test failing.
#![allow(clippy::unwrap_used, clippy::panic)]

#[path = "../../fuzz/src/lib.rs"]
mod targets;

use std::fs;
use std::path::{Path, PathBuf};

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_corpus_file_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut total = 0;
    for (name, target) in targets::TARGETS {
        let corpus = files(&root.join("corpus").join(name));
        assert!(!corpus.is_empty(), "no committed corpus for {name}");
        let found = files(&root.join("artifacts-found").join(name));
        for path in corpus.iter().chain(&found) {
            let data = fs::read(path).unwrap();
            // A failing file is named before the panic propagates.
            let ok = std::panic::catch_unwind(|| target(&data)).is_ok();
            assert!(ok, "{name}: {} fails its target", path.display());
            total += 1;
        }
    }
    println!("replayed {total} fuzz inputs");
}
