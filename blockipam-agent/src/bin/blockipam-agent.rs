//! The `blockipam-agent` binary: parses the flags, logs to stderr, runs the agent until SIGTERM or SIGINT.

use std::process::ExitCode;

use blockipam_agent::AgentArgs;
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};

fn main() -> ExitCode {
    let args = AgentArgs::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BLOCKIPAM_AGENT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
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
        blockipam_agent::run(&args, shutdown).await
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blockipam-agent: {e}");
            ExitCode::FAILURE
        }
    }
}
