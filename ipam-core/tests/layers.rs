//! The crate's layers stack one way: `kv` names nothing above it, `model` names only `kv`, and
//! only `allocator` names `allocator`. Read from the source itself: every `crate::` path in every
//! file of a layer (imports and paths written inline alike).

use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The first segment after each `crate::` in `text` (`kv`, `model`, ...), and `{` for a grouped
/// `use crate::{...}`.
fn crate_paths(text: &str) -> Vec<String> {
    text.match_indices("crate::")
        .filter(|(at, _)| {
            // Not part of a longer identifier such as `some_crate::`.
            !text[..*at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
        .map(|(at, _)| {
            text[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '{')
                .collect::<String>()
        })
        .map(|segment| {
            if segment.starts_with('{') {
                "{".to_owned()
            } else {
                segment
            }
        })
        .collect()
}

/// The crate paths each file under `layer` names that `allowed` does not list.
fn violations(layer: &str, allowed: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = sources(&root.join(layer));
    assert!(!files.is_empty(), "no source files under src/{layer}");
    let mut found = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).expect("read a source file");
        for segment in crate_paths(&text) {
            if !allowed.contains(&segment.as_str()) {
                found.push(format!(
                    "{}: crate::{segment}",
                    file.strip_prefix(&root).unwrap_or(&file).display()
                ));
            }
        }
    }
    found
}

#[test]
fn kv_names_nothing_above_it() {
    assert_eq!(violations("kv", &["kv"]), Vec::<String>::new());
}

#[test]
fn model_names_only_kv_and_itself() {
    assert_eq!(violations("model", &["kv", "model"]), Vec::<String>::new());
}

#[test]
fn allocator_names_the_layers_below_and_the_crash_points() {
    assert_eq!(
        violations("allocator", &["kv", "model", "allocator", "fault"]),
        Vec::<String>::new()
    );
}

#[test]
fn the_check_sees_an_upward_path() {
    // The reader itself: an upward path in a layer is reported, a longer identifier is not.
    let text =
        "use crate::allocator::Ipam;\nlet x = other_crate::model::Y;\nuse crate::{kv, model};";
    assert_eq!(crate_paths(text), vec!["allocator", "{"]);
}

#[test]
fn only_the_three_layers_and_the_crash_points_sit_at_the_root() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut entries: Vec<String> = fs::read_dir(&root)
        .expect("read src")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        ["allocator", "fault.rs", "kv", "lib.rs", "model"],
        "a module outside the layers"
    );
    let fault = fs::read_to_string(root.join("fault.rs")).expect("read fault.rs");
    assert_eq!(crate_paths(&fault), Vec::<String>::new());
}
