//! The `blockipam` executable: runtimes exec it with `CNI_*` variables and the netconf on stdin.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use blockipam::arena::CallAllocator;

/// One call's allocations come from a bump arena (`blockipam::arena::CALL_ARENA`): no allocator
/// work and no `mmap`/`munmap` per allocation; past its 8 MiB, or once the call opens a sled
/// store itself, the system allocator.
#[global_allocator]
static ALLOCATOR: CallAllocator = CallAllocator;

fn main() {
    // A panic inside a store engine (redb panics on some damaged pages) is caught by the adapter
    // and answered as a CNI error; this hook keeps its report to one log line on stderr.
    std::panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".to_owned());
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("ERROR blockipam: internal failure{location}: {message}");
    }));
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
