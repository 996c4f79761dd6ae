//! This node's name when none is given, found the same way by the plugin and the agent.

use std::path::Path;

/// Calico's node-name file: read when no node name is given.
pub const DEFAULT_NODENAME_FILE: &str = "/var/lib/calico/nodename";

/// The files the OS host name is read from, in order.
const HOST_NAME_FILES: [&str; 2] = ["/proc/sys/kernel/hostname", "/etc/hostname"];

/// The text of `nodename_file`, trimmed, when it exists and is not blank (as Calico reads it),
/// else the OS host name lower-cased; `None` when neither gives a name.
pub fn from_file_or_host(nodename_file: &Path) -> Option<String> {
    trimmed_text_of(nodename_file).or_else(|| {
        HOST_NAME_FILES
            .iter()
            .find_map(|file| trimmed_text_of(Path::new(file)))
            .map(|name| name.to_ascii_lowercase())
    })
}

/// The trimmed text of `file` when it can be read and is not blank.
fn trimmed_text_of(file: &Path) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    let name = text.trim();
    (!name.is_empty()).then(|| name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_name() -> String {
        std::fs::read_to_string(HOST_NAME_FILES[0])
            .expect("this machine's host name")
            .trim()
            .to_ascii_lowercase()
    }

    /// The node-name file's name wins, trimmed and with its case kept; a blank or missing file
    /// gives the host name, lower-cased.
    #[test]
    fn the_node_name_file_comes_first_then_the_host_name_lower_cased() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("nodename");
        std::fs::write(&file, "  Worker-3\n").expect("write");
        assert_eq!(from_file_or_host(&file).as_deref(), Some("Worker-3"));
        std::fs::write(&file, " \n").expect("write");
        assert_eq!(from_file_or_host(&file), Some(host_name()));
        let missing = dir.path().join("missing");
        assert_eq!(from_file_or_host(&missing), Some(host_name()));
        assert!(!host_name().is_empty());
    }
}
