//! Logging of this plugin and the store crates, to stderr or `log_file_path`, never stdout.
//!
//! Logging: `tracing` events of this plugin and the store crates, at `log_level`, to stderr or
//! `log_file_path`; never to stdout.

use std::fs::{DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};

use tracing::level_filters::LevelFilter;
use tracing::Dispatch;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

use crate::netconf::LogLevel;

/// Where log lines go: shared, because the subscriber outlives any one borrow.
pub type Sink = Arc<Mutex<dyn Write + Send>>;

/// A `Write` that appends to a [`Sink`].
#[derive(Clone)]
pub struct SinkWriter(Sink);

impl SinkWriter {
    /// A writer appending to `sink`.
    pub fn new(sink: Sink) -> Self {
        SinkWriter(sink)
    }
}

impl std::fmt::Debug for SinkWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SinkWriter")
    }
}

impl Write for SinkWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self.0.lock() {
            Ok(mut inner) => inner.write(buf),
            Err(poisoned) => poisoned.into_inner().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self.0.lock() {
            Ok(mut inner) => inner.flush(),
            Err(poisoned) => poisoned.into_inner().flush(),
        }
    }
}

impl<'a> MakeWriter<'a> for SinkWriter {
    type Writer = SinkWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

fn level_filter(level: LogLevel) -> LevelFilter {
    match level {
        LogLevel::Off => LevelFilter::OFF,
        LogLevel::Error => LevelFilter::ERROR,
        LogLevel::Warn => LevelFilter::WARN,
        LogLevel::Info => LevelFilter::INFO,
        LogLevel::Debug => LevelFilter::DEBUG,
        LogLevel::Trace => LevelFilter::TRACE,
    }
}

/// A dispatcher logging blockipam's own crates at `level` (other crates at warnings and above,
/// capped by `level`) to `sink`, or to `log_file` when given and openable.
pub fn dispatch(level: LogLevel, sink: Sink, log_file: Option<&Path>) -> Dispatch {
    let mut problem = None;
    let sink: Sink = match log_file {
        None => sink,
        Some(path) => match open_log_file(path) {
            Ok(file) => Arc::new(Mutex::new(file)),
            Err(e) => {
                problem = Some(format!(
                    "cannot open log_file_path {}: {e}; logging to stderr",
                    path.display()
                ));
                sink
            }
        },
    };
    let own = level_filter(level);
    let others = own.min(LevelFilter::WARN);
    let targets = Targets::new()
        .with_default(others)
        .with_target("blockipam", own)
        .with_target("blockipam_store", own)
        .with_target("ipam_core", own)
        .with_target("backend_sled", own)
        .with_target("backend_redb", own)
        .with_target("backend_etcd", own);
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_target(false)
        .with_writer(SinkWriter(sink))
        .with_filter(targets);
    let dispatch = Dispatch::new(tracing_subscriber::registry().with(layer));
    if let Some(problem) = problem {
        tracing::dispatcher::with_default(&dispatch, || tracing::warn!("{problem}"));
    }
    dispatch
}

/// Opens `path` for appending. The log holds pod names and addresses, so a file (and any
/// missing directory) this creates is its owner's only (0600, directories 0700); an existing
/// file's mode is the operator's and is left as it is. A symbolic link at `path` is refused, never
/// followed (`O_NOFOLLOW`): whoever can plant one in the log directory must not get the plugin,
/// running as root, to append to (or create) a file of their choosing.
fn open_log_file(path: &Path) -> std::io::Result<std::fs::File> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?;
    }
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            // O_NOFOLLOW reports a link at the last component as ELOOP.
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::other(
                    "it is a symbolic link, which is never followed; point log_file_path at the \
                     file itself",
                )
            } else {
                e
            }
        })
}
