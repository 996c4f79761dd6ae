//! The `blockipam-agent` binary: parses the flags, logs to stderr, runs the agent until SIGTERM or SIGINT.

use std::io::IsTerminal;
use std::process::ExitCode;

use blockipam_agent::AgentArgs;
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};

fn main() -> ExitCode {
    let args = AgentArgs::parse();
    // Taken before any thread starts: the variables are removed from the environment.
    let listen_environment = blockipam_agent::activation::ListenEnvironment::take_from_process();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal, never into the journal or a file.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BLOCKIPAM_AGENT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let inherited = match blockipam_agent::activation::inherited_listener(&listen_environment) {
        Ok(inherited) => inherited,
        Err(e) => {
            eprintln!("blockipam-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("blockipam-agent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        let (mut terminate, mut interrupt) = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(terminate), Ok(interrupt)) => (terminate, interrupt),
            (Err(e), _) | (_, Err(e)) => {
                return Err(blockipam_agent::AgentError::new(format!(
                    "cannot handle SIGTERM/SIGINT: {e}"
                )))
            }
        };
        let shutdown = async move {
            tokio::select! {
                _ = terminate.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = interrupt.recv() => tracing::info!("SIGINT: shutting down"),
            }
        };
        blockipam_agent::run_on(&args, inherited, shutdown).await
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blockipam-agent: {e}");
            ExitCode::FAILURE
        }
    }
}
