//! The `blockipam` executable: runtimes exec it with `CNI_*` variables and the netconf on stdin.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

fn main() {
    let env: BTreeMap<String, String> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    let status = blockipam::run_with_log_sink(
        &env,
        &mut std::io::stdin().lock(),
        &mut std::io::stdout().lock(),
        Arc::new(Mutex::new(std::io::stderr())),
    );
    std::process::exit(status);
}
