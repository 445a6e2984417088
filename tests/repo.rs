//! The repository is self-contained: nothing in it refers to a folder beside the checkout.

use std::path::{Path, PathBuf};

/// Directories that are build outputs, caches, run outputs or git's own, not the product.
const SKIPPED_DIRS: [&str; 4] = ["target", ".git", ".cache", "runs"];

/// Every file under `dir`, skipping `SKIPPED_DIRS` at any depth.
fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let entry = entry.unwrap();
        let path = entry.path();
        let file_type = entry.file_type().unwrap();
        if file_type.is_dir() {
            let name = entry.file_name();
            if !SKIPPED_DIRS.iter().any(|s| name == *s) {
                files_under(&path, out);
            }
        } else if file_type.is_file() {
            out.push(path);
        }
    }
}

/// No file of the tree (code, configs, tests, scripts, docs, data) mentions the sibling
/// folder that our development machines have and a fresh clone does not.
#[test]
fn no_file_refers_to_a_folder_beside_the_repository() {
    // Built so that this file does not contain the needle itself.
    let needle = concat!("..", "/shared").as_bytes();
    let root = crate::util::repo_root();
    let mut files = Vec::new();
    files_under(&root, &mut files);
    assert!(
        files.iter().any(|p| p.ends_with("data/gsm8k/train.jsonl")),
        "the walk missed data/: {} files",
        files.len()
    );
    let offenders: Vec<String> = files
        .iter()
        .filter(|path| {
            let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            bytes.windows(needle.len()).any(|w| w == needle)
        })
        .map(|path| path.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    assert!(
        offenders.is_empty(),
        "these files refer to {}, which a fresh clone lacks: {}",
        String::from_utf8_lossy(needle),
        offenders.join(", ")
    );
}
