//! The blockipamctl executable: parse, run, print, exit (all logic lives in the library).

use std::io::IsTerminal;
use std::panic::AssertUnwindSafe;

fn main() {
    // A bug must still end as one line and a failure status, never a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!(
            "error: internal error (a bug in blockipamctl{location}): {}",
            message.replace('\n', " ")
        );
    }));
    let code = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let env = blockipamctl::Env::from_process();
        let stderr_is_terminal = std::io::stderr().is_terminal();
        let mut stdout = std::io::stdout().lock();
        let mut stderr = std::io::stderr();
        blockipamctl::run(
            std::env::args_os(),
            &env,
            &mut stdout,
            &mut stderr,
            stderr_is_terminal,
        )
    }))
    .unwrap_or(blockipamctl::EXIT_FAILURE);
    std::process::exit(code);
}
