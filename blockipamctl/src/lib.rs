//! blockipamctl, the operator CLI of blockipam, as a library: [`run`] takes the arguments, the
//! environment and the output streams, so tests drive it in-process as well as through the binary.
//!
//! Exit statuses: [`EXIT_OK`] (0) success, [`EXIT_FAILURE`] (1) failure or problems found,
//! [`EXIT_USAGE`] (2) a command line that can never succeed as typed. Errors are one line on
//! stderr, plus `{"error": "..."}` on stdout under `-o json`.

pub mod cli;
pub mod commands;
pub mod demo;
pub mod error;
pub mod output;
pub mod settings;

use std::ffi::OsString;
use std::io::Write;

use clap::error::ErrorKind;
use clap::{CommandFactory, FromArgMatches};

pub use cli::{Cli, OutputFormat};
pub use error::{CtlError, EXIT_FAILURE, EXIT_OK, EXIT_USAGE};
pub use output::{Ctx, Outcome};
pub use settings::Env;

/// Runs blockipamctl with these arguments (the first is the program name) and returns the exit
/// status. Builds its own Tokio runtime; inside an async context use [`run_async`].
pub fn run<I, T>(
    args: I,
    env: &Env,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
    stderr_is_terminal: bool,
) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = writeln!(stderr, "error: cannot start the async runtime: {e}");
            return EXIT_FAILURE;
        }
    };
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    runtime.block_on(run_async(args, env, stdout, stderr, stderr_is_terminal))
}

/// As [`run`], on the caller's Tokio runtime (which must have the time and I/O drivers enabled).
pub async fn run_async(
    args: Vec<OsString>,
    env: &Env,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
    stderr_is_terminal: bool,
) -> i32 {
    let json_requested = wants_json(&args, env);
    let cli = match parser()
        .try_get_matches_from(&args)
        .and_then(|matches| Cli::from_arg_matches(&matches))
    {
        Ok(cli) => cli,
        Err(e) => return clap_error(&e, &args, json_requested, stdout, stderr),
    };
    let format = match settings::output_format(&cli.global, env) {
        Ok(format) => format,
        Err(e) => {
            let format = if json_requested {
                OutputFormat::Json
            } else {
                OutputFormat::Table
            };
            let mut ctx = Ctx::new(format, stdout, stderr, stderr_is_terminal);
            return report_error(&mut ctx, &e);
        }
    };
    let mut ctx = Ctx::new(format, stdout, stderr, stderr_is_terminal);
    match commands::dispatch(&mut ctx, &cli, env).await {
        Ok(outcome) => {
            match output::print(&mut ctx, &outcome) {
                // The reader stopped reading (`| head`, `| grep -q`): it took what it wanted, and
                // the command's own outcome stands.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                Err(e) => {
                    let _ = writeln!(ctx.stderr, "error: cannot write the output: {e}");
                    return EXIT_FAILURE;
                }
                Ok(()) => {}
            }
            if outcome.problems_found {
                EXIT_FAILURE
            } else {
                EXIT_OK
            }
        }
        Err(e) => report_error(&mut ctx, &e),
    }
}

/// Prints an error (one line on stderr; JSON on stdout under `-o json`) and returns its status.
fn report_error(ctx: &mut Ctx<'_>, error: &CtlError) -> i32 {
    ctx.progress_done();
    let message = error::one_line(&error.to_string());
    write_error(ctx.format, &message, ctx.stdout, ctx.stderr);
    error.exit_code()
}

fn write_error(
    format: OutputFormat,
    message: &str,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) {
    let _ = writeln!(stderr, "error: {message}");
    let _ = stderr.flush();
    if format == OutputFormat::Json {
        let doc = serde_json::json!({ "error": message });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        let _ = writeln!(stdout, "{text}");
        let _ = stdout.flush();
    }
}

/// Whether `-o json` / `--output json` appears, or `BLOCKIPAMCTL_OUTPUT=json` is set (used when
/// the command line does not parse).
fn wants_json(args: &[OsString], env: &Env) -> bool {
    let args: Vec<String> = args
        .iter()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut found = None;
    for (i, arg) in args.iter().enumerate() {
        if arg == "--" {
            break;
        }
        let value = if arg == "-o" || arg == "--output" {
            args.get(i + 1).map(String::as_str)
        } else if let Some(v) = arg.strip_prefix("--output=") {
            Some(v)
        } else if let Some(v) = arg.strip_prefix("-o") {
            Some(v.strip_prefix('=').unwrap_or(v))
        } else {
            None
        };
        if let Some(v) = value {
            found = Some(v == "json");
        }
    }
    found.unwrap_or_else(|| env.get(cli::ENV_OUTPUT) == Some("json"))
}

/// The command line's parser: every command takes a negative number as a value, so that a flag
/// given `-1` is refused naming the flag and why (`invalid value '-1' for '--max-blocks-per-host
/// <N>'`) rather than as an unknown argument `-1`.
fn parser() -> clap::Command {
    fn allow_negative_numbers(command: clap::Command) -> clap::Command {
        command
            .allow_negative_numbers(true)
            .mut_subcommands(allow_negative_numbers)
    }
    allow_negative_numbers(Cli::command())
}

/// The subcommands `args` name, in order, after the program's name (`blockipamctl pool add`).
fn subcommand_path(args: &[OsString]) -> String {
    let mut command = Cli::command();
    let mut path = vec![command.get_name().to_owned()];
    for arg in args.iter().skip(1).filter_map(|a| a.to_str()) {
        if arg == "--" {
            break;
        }
        if let Some(subcommand) = command.find_subcommand(arg).cloned() {
            path.push(subcommand.get_name().to_owned());
            command = subcommand;
        }
    }
    path.join(" ")
}

/// Handles clap's outcome when parsing fails: help and version go to stdout with status 0; every
/// usage error is one line on stderr with status 2.
fn clap_error(
    error: &clap::Error,
    args: &[OsString],
    json: bool,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = write!(stdout, "{error}");
            let _ = stdout.flush();
            return EXIT_OK;
        }
        _ => {}
    }
    let rendered = error.to_string();
    let usage = rendered
        .lines()
        .find_map(|l| l.trim().strip_prefix("Usage: "))
        .map(str::to_owned);
    let message = if error.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        "a subcommand is required".to_owned()
    } else {
        let mut parts: Vec<String> = Vec::new();
        let mut lines = rendered.lines().peekable();
        while let Some(line) = lines.next() {
            let line = line.trim();
            if let Some(first) = line.strip_prefix("error: ") {
                // What is missing is listed on the indented lines below the error line.
                let mut listed: Vec<&str> = Vec::new();
                while let Some(item) = lines.next_if(|l| {
                    l.starts_with(char::is_whitespace)
                        && !l.trim().is_empty()
                        && !l.trim().starts_with("tip: ")
                }) {
                    listed.push(item.trim());
                }
                if listed.is_empty() {
                    parts.push(first.to_owned());
                } else {
                    parts.push(format!("{first} {}", listed.join(", ")));
                }
            } else if let Some(tip) = line.strip_prefix("tip: ") {
                parts.push(tip.to_owned());
            }
        }
        if parts.is_empty() {
            error::one_line(&rendered)
        } else {
            parts.join("; ")
        }
    };
    let command = usage
        .as_deref()
        .map(|u| {
            u.split([' '])
                .take_while(|w| !w.starts_with('[') && !w.starts_with('<') && !w.starts_with('-'))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|c| !c.is_empty())
        // clap prints no usage for a bad value: the subcommands given say whose help to read.
        .unwrap_or_else(|| subcommand_path(args));
    let full = match usage {
        Some(usage) => format!("{message} (usage: {usage}); try '{command} --help'"),
        None => format!("{message}; try '{command} --help'"),
    };
    let format = if json {
        OutputFormat::Json
    } else {
        OutputFormat::Table
    };
    write_error(format, &full, stdout, stderr);
    EXIT_USAGE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_captured(args: &[&str]) -> (i32, String, String) {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let mut full = vec!["blockipamctl"];
        full.extend_from_slice(args);
        let code = run(full, &Env::default(), &mut out, &mut err, false);
        (
            code,
            String::from_utf8_lossy(&out).into_owned(),
            String::from_utf8_lossy(&err).into_owned(),
        )
    }

    #[test]
    fn help_and_version_exit_0_on_stdout() {
        let (code, out, err) = run_captured(&["--help"]);
        assert_eq!(code, EXIT_OK, "{err}");
        assert!(out.contains("Usage: blockipamctl"), "{out}");
        assert!(out.contains("DATASTORE_TYPE"), "{out}");
        let (code, out, _) = run_captured(&["--version"]);
        assert_eq!(code, EXIT_OK);
        assert!(out.starts_with("blockipamctl "), "{out}");
    }

    #[test]
    fn usage_errors_are_one_line_with_status_2() {
        for args in [
            &["frobnicate"][..],
            &["pool"][..],
            &["pool", "add"][..],
            &["pool", "add", "10.0.0.0/16", "--block-size", "abc"][..],
            &["config", "set", "--max-blocks-per-host", "-1"][..],
            &["config", "set"][..],
            &["show", "--ip", "not-an-ip"][..],
            &["release"][..],
            &["pool", "list", "--output", "yaml"][..],
        ] {
            let (code, out, err) = run_captured(args);
            assert_eq!(code, EXIT_USAGE, "{args:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{args:?}: {err:?}");
            assert!(err.starts_with("error: "), "{args:?}: {err}");
            assert!(out.is_empty(), "{args:?}: {out}");
        }
    }

    #[test]
    fn usage_errors_under_json_also_print_an_error_document() {
        let (code, out, _) = run_captured(&["-o", "json", "pool", "add", "10.0.0.0/33"]);
        assert_eq!(code, EXIT_USAGE);
        let doc: serde_json::Value = serde_json::from_str(&out).expect("json");
        assert!(
            doc["error"].as_str().is_some_and(|m| !m.is_empty()),
            "{out}"
        );
    }

    #[test]
    fn json_is_recognised_in_every_spelling() {
        let env = Env::default();
        for args in [
            &["x", "-o", "json"][..],
            &["x", "-ojson"][..],
            &["x", "-o=json"][..],
            &["x", "--output=json"][..],
            &["x", "--output", "json", "pool"][..],
        ] {
            let args: Vec<OsString> = args.iter().map(OsString::from).collect();
            assert!(wants_json(&args, &env), "{args:?}");
        }
        let args: Vec<OsString> = ["x", "-o", "table"].iter().map(OsString::from).collect();
        assert!(!wants_json(&args, &env));
        assert!(wants_json(
            &args[..1],
            &Env::new([("BLOCKIPAMCTL_OUTPUT", "json")])
        ));
    }
}
