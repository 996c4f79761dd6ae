//! The blockipam-load executable: parse, run, print, exit (all logic lives in the library).

use std::io::IsTerminal;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let stderr_is_terminal = std::io::stderr().is_terminal();
    let code = blockipam_load::run_cli(
        std::env::args_os(),
        &mut std::io::stdout().lock(),
        &mut std::io::stderr(),
        stderr_is_terminal,
    );
    std::process::exit(code);
}
