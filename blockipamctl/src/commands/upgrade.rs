//! `upgrade status|finalize`: the stored format every writer writes, what each node reads, and
//! the finalize that moves writers to this release's format (`Ipam::upgrade_status`,
//! `Ipam::finalize_upgrade`).

use blockipam_store::DatastoreSettings;
use ipam_core::upgrade::{NodeFormats, SeenBinary};
use serde::Serialize;

use super::{open_ipam, to_json};
use crate::cli::UpgradeFinalizeArgs;
use crate::error::CtlError;
use crate::output::{Outcome, Table};
use crate::settings::OpenMode;

#[derive(Debug, Serialize)]
struct StatusJson {
    /// The format the store's record names; null when the store has none yet.
    recorded_format: Option<u8>,
    /// The format writers write now.
    writes_format: u8,
    this_build_reads: [u8; 2],
    /// True when every node seen reads this build's format: `upgrade finalize` would go ahead.
    ready_to_finalize: bool,
    nodes: Vec<NodeJson>,
}

#[derive(Debug, Serialize)]
struct NodeJson {
    node: String,
    reads_format: u8,
    agent: Option<SeenBinary>,
    plugin: Option<SeenBinary>,
    holds_blocks: bool,
}

fn seen(binary: &Option<SeenBinary>) -> String {
    match binary {
        None => "-".to_owned(),
        Some(b) => match b.reads_format {
            Some(reads) => format!("{} (format {reads})", b.version),
            None => format!("{} (format 3 at most)", b.version),
        },
    }
}

fn node_json(node: &NodeFormats) -> NodeJson {
    NodeJson {
        node: node.node.clone(),
        reads_format: node.reads_format(),
        agent: node.agent.clone(),
        plugin: node.plugin.clone(),
        holds_blocks: node.holds_blocks,
    }
}

/// `upgrade status`: exit status 1 while a node may read only an older format than this build's
/// (before the finalize) or than writers write (after it: such a node refuses the store), and
/// when a newer release finalized the store (this build refuses to write to it).
///
/// # Errors
/// Store trouble; damaged records.
pub async fn status(settings: &DatastoreSettings) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let status = ipam.upgrade_status().await?;
    let finalized = status.writes >= status.reads_up_to;
    // A newer release finalized the store: this build refuses every write to it.
    let newer = status.writes > status.reads_up_to;
    let behind = status
        .nodes
        .iter()
        .filter(|n| n.reads_format() < status.reads_up_to)
        .count();
    // After the finalize, a node reading less than writers write refuses the store.
    let refusing = status
        .nodes
        .iter()
        .filter(|n| n.reads_format() < status.writes)
        .count();
    let mut text = format!(
        "stored format: {}\nwriters write: format {}\nthis build reads formats {} to {} and writes {}\n",
        match status.recorded {
            Some(format) => format!("format {format} (recorded)"),
            None => "no record yet (a store in use counts as format 3)".to_owned(),
        },
        status.writes,
        status.reads_from,
        status.reads_up_to,
        status.reads_up_to,
    );
    let mut table = Table::new(&["NODE", "READS", "AGENT", "PLUGIN", "BLOCKS"]);
    for node in &status.nodes {
        table.row(vec![
            node.node.clone(),
            format!("format {}", node.reads_format()),
            seen(&node.agent),
            seen(&node.plugin),
            if node.holds_blocks { "yes" } else { "no" }.to_owned(),
        ]);
    }
    if !table.is_empty() {
        text.push_str(&table.render());
    }
    if newer {
        text.push_str(&format!(
            "finalized by a newer release: writers write format {}, newer than this build's {}; \
             this build refuses to write to this store (and to finalize it): use that release's \
             blockipamctl\n",
            status.writes, status.reads_up_to
        ));
    } else if finalized {
        text.push_str("finalized: writers use this build's format\n");
        if refusing > 0 {
            text.push_str(&format!(
                "{refusing} node(s) read only an older format and refuse this store: upgrade their binaries, or retire a node gone for good with `blockipamctl node retire <node> --apply`\n"
            ));
        }
    } else if behind == 0 {
        text.push_str(
            "every node seen reads this build's format: `upgrade finalize` will go ahead\n",
        );
    } else {
        text.push_str(&format!(
            "{behind} node(s) may read only an older format: upgrade (or retire) them before `upgrade finalize`\n"
        ));
    }
    let json = StatusJson {
        recorded_format: status.recorded,
        writes_format: status.writes,
        this_build_reads: [status.reads_from, status.reads_up_to],
        ready_to_finalize: behind == 0,
        nodes: status.nodes.iter().map(node_json).collect(),
    };
    Ok(Outcome {
        json: to_json(&json)?,
        table: text,
        problems_found: newer || if finalized { refusing > 0 } else { behind > 0 },
    })
}

/// `upgrade finalize [--force]`.
///
/// # Errors
/// Refused while a node may read only an older format (without `--force`); store trouble,
/// including a record changed by another writer meanwhile (run it again).
pub async fn finalize(
    settings: &DatastoreSettings,
    args: &UpgradeFinalizeArgs,
) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let outcome = ipam.finalize_upgrade(args.force).await?;
    let mut text = if outcome.changed {
        format!(
            "finalized: every writer now writes format {} (was {}); binaries that read only older formats refuse this store\n",
            outcome.writes,
            outcome
                .previous
                .map_or("format 3, unrecorded".to_owned(), |f| format!("format {f}"))
        )
    } else {
        format!(
            "already finalized at format {}: nothing written\n",
            outcome.writes
        )
    };
    for node in &outcome.overridden {
        text.push_str(&format!("finalized over (--force): {node}\n"));
    }
    Ok(Outcome::ok(to_json(&outcome)?, text))
}
