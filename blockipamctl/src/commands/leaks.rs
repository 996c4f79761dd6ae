//! `gc --leaks [--report PATH] [--apply]`: this node's leaks as its agent's last look at the container runtime found them (what, why, since when), and with `--apply` the release of those past their grace, each guarded by its sequence number.

use ipam_core::model::timestamp::unix_now;
use std::path::PathBuf;

use blockipam_store::DatastoreSettings;
use ipam_core::allocator::leaks::{
    AddressHolder, LeakRelease, LeakReport, MissingAllocation, ATTR_CONTAINER_ID, ATTR_NAMESPACE,
    ATTR_POD, LEAK_REPORT_FILE, LEAK_REPORT_VERSION,
};
use ipam_core::allocator::ATTR_NODE;
use serde::Serialize;

use super::{open_ipam, to_json};
use crate::cli::GcArgs;
use crate::error::CtlError;
use crate::output::{counted, Ctx, Outcome, Table};
use crate::settings::OpenMode;

/// Looks older than this many of the agent's intervals (plus a margin) are too old to act on.
const STALE_INTERVALS: u64 = 3;
const STALE_MARGIN_SECONDS: u64 = 10;

/// Whether a look `age` seconds old, by an agent that looks every `scan_seconds`, is too old to
/// act on: older than [`STALE_INTERVALS`] intervals and [`STALE_MARGIN_SECONDS`].
fn too_old_to_act_on(age: u64, scan_seconds: u64) -> bool {
    age > scan_seconds
        .saturating_mul(STALE_INTERVALS)
        .saturating_add(STALE_MARGIN_SECONDS)
}

#[derive(Debug, Serialize)]
struct LeaksJson<'a> {
    report_path: String,
    /// Seconds since the agent's look.
    report_age_seconds: u64,
    report: &'a LeakReport,
    applied: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    release: Option<LeakRelease>,
}

/// `gc --leaks`.
///
/// # Errors
/// [`CtlError::Usage`] with `--dead-nodes` flags; [`CtlError::Failed`] when the report cannot be
/// read or understood, or `--apply` is asked of a report that is stale, unanswered or unproven;
/// store trouble.
pub async fn run(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &GcArgs,
) -> Result<Outcome, CtlError> {
    let path = args.report.clone().unwrap_or_else(|| {
        settings
            .agent_socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(blockipam_store::DEFAULT_AGENT_SOCKET))
            .with_file_name(LEAK_REPORT_FILE)
    });
    let bytes = std::fs::read(&path).map_err(|e| {
        CtlError::failed(format!(
            "cannot read the agent's leak report {}: {e} (the agent writes it at each look when \
             --leak-collection is release or report; --report names another file)",
            path.display()
        ))
    })?;
    let report: LeakReport = serde_json::from_slice(&bytes).map_err(|e| {
        CtlError::failed(format!(
            "{} is not a leak report this blockipamctl reads: {e}",
            path.display()
        ))
    })?;
    if report.version != LEAK_REPORT_VERSION {
        return Err(CtlError::failed(format!(
            "{} is a leak report of version {}; this blockipamctl reads version \
             {LEAK_REPORT_VERSION}",
            path.display(),
            report.version
        )));
    }
    let now = unix_now();
    let age = now.saturating_sub(report.observed_at);

    let mut text = format!(
        "Node {}: the agent's look at {} {}s ago (grace {}s, a look every {}s).\n",
        report.node, report.runtime, age, report.grace_seconds, report.scan_seconds
    );
    let mut problems_found = false;
    let mut release = None;
    if let Some(error) = &report.runtime_error {
        text.push_str(&format!(
            "The container runtime could not be asked: {error}\nNothing is known about leaks \
             until it answers.\n"
        ));
        problems_found = true;
    }
    if let Some(decisions) = &report.decisions {
        let mut missing: Vec<(&MissingAllocation, &str)> = decisions
            .leaked
            .iter()
            .map(|m| (m, "due: released at the next look, or by --apply"))
            .chain(decisions.waiting.iter().map(|m| {
                let due =
                    report.observed_at.saturating_sub(m.missing_since) >= report.grace_seconds;
                (
                    m,
                    if decisions.runtime_unproven && due {
                        "held: the runtime runs none of this node's pods"
                    } else {
                        "waiting for its grace"
                    },
                )
            }))
            .collect();
        missing.sort_by_key(|(m, _)| m.allocation.ip);
        if missing.is_empty() {
            text.push_str(&format!(
                "No leak: every one of this node's {} pod allocations has its container running.\n",
                decisions.live
            ));
        } else {
            let mut table = Table::new(&["ADDRESS", "POD", "CONTAINER", "MISSING FOR", "STATE"]);
            for (m, state) in &missing {
                let field = |key: &str| {
                    m.allocation
                        .attributes
                        .get(key)
                        .map_or("-", String::as_str)
                        .to_owned()
                };
                let container = field(ATTR_CONTAINER_ID);
                table.row(vec![
                    m.allocation.ip.to_string(),
                    format!("{}/{}", field(ATTR_NAMESPACE), field(ATTR_POD)),
                    container.chars().take(13).collect(),
                    format!("{}s", report.observed_at.saturating_sub(m.missing_since)),
                    (*state).to_owned(),
                ]);
            }
            text.push_str(&format!(
                "{} whose container the runtime does not run ({} running):\n{}",
                counted(missing.len() as u64, "allocation", "allocations"),
                decisions.live,
                table.render()
            ));
        }
        if decisions.runtime_unproven && !missing.is_empty() {
            text.push_str(
                "The runtime runs none of the containers this node's allocations name: is it the \
                 runtime the kubelet uses? Nothing is released until it is.\n",
            );
        }
        if !decisions.disagreements.is_empty() {
            problems_found = true;
            let mut table = Table::new(&["ADDRESS", "POD", "SANDBOX", "THE STORE SAYS"]);
            for d in &decisions.disagreements {
                let says = match &d.holder {
                    AddressHolder::Free => {
                        "free (re-assert it, or restore the allocation)".to_owned()
                    }
                    AddressHolder::Other(holder) => format!(
                        "DUPLICATE: held by {} on {}",
                        holder.handle,
                        holder.attributes.get(ATTR_NODE).map_or("-", String::as_str)
                    ),
                };
                table.row(vec![
                    d.address.to_string(),
                    d.pod.clone(),
                    d.sandbox_id.chars().take(13).collect(),
                    says,
                ]);
            }
            text.push_str(&format!(
                "\nLive pods' addresses the store does not record for them:\n{}",
                table.render()
            ));
        }
        if !decisions.undecodable.is_empty() {
            problems_found = true;
            text.push_str(&super::undecodable_text(
                &decisions.undecodable,
                "the look (no address they cover is judged)",
            ));
        }
        if args.apply {
            if too_old_to_act_on(age, report.scan_seconds) {
                return Err(CtlError::failed(format!(
                    "the agent's last look is {age}s old (it looks every {}s): is it running? \
                     nothing released",
                    report.scan_seconds
                )));
            }
            if decisions.runtime_unproven {
                return Err(CtlError::failed(
                    "the runtime the agent asks runs none of this node's pods: nothing released",
                ));
            }
            let ipam = open_ipam(settings, OpenMode::Existing).await?;
            ctx.progress("releasing the leaks past their grace ...");
            let outcome = ipam.release_leaked(&decisions.leaked).await?;
            text.push_str(&format!(
                "\nReleased {}; left alone {} (changed hands or already free since the look).\n",
                counted(outcome.released.len() as u64, "address", "addresses"),
                outcome.skipped.len()
            ));
            release = Some(outcome);
        } else if !decisions.leaked.is_empty() {
            text.push_str("\nRun again with --apply to release the ones past their grace.\n");
        }
    } else if args.apply {
        return Err(CtlError::failed(
            "the agent's last look has no decisions (the runtime could not be asked): nothing \
             released",
        ));
    }
    let json = LeaksJson {
        report_path: path.display().to_string(),
        report_age_seconds: age,
        report: &report,
        applied: release.is_some(),
        release,
    };
    Ok(Outcome {
        json: to_json(&json)?,
        table: text,
        problems_found,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_look_is_acted_on_up_to_three_intervals_and_ten_seconds_old() {
        assert!(!too_old_to_act_on(0, 60));
        assert!(!too_old_to_act_on(190, 60));
        assert!(too_old_to_act_on(191, 60));
        assert!(!too_old_to_act_on(10, 0));
        assert!(too_old_to_act_on(11, 0));
        assert!(!too_old_to_act_on(u64::MAX, u64::MAX));
    }
}
