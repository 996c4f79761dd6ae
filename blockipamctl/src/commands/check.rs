//! `check [--repair]`: find inconsistencies between stored objects (exit status 1 when any), and
//! fix the ones that are safe to fix.

use blockipam_store::DatastoreSettings;
use ipam_core::check::kinds;
use ipam_core::{CheckReport, Problem};
use serde::Serialize;

use super::report::{ReportStore, REPORT_NAME, REPORT_VERSION};
use super::{open_ipam, to_json};
use crate::cli::CheckArgs;
use crate::error::CtlError;
use crate::output::{counted, yes_no, Ctx, Outcome, Table};
use crate::settings::OpenMode;

/// The check report: a versioned document naming the store it was made from, which
/// `release --from-report` reads back (`report.rs`).
#[derive(Debug, Serialize)]
struct CheckJson {
    /// Always [`REPORT_NAME`].
    report: &'static str,
    /// [`REPORT_VERSION`].
    version: u32,
    /// The store checked.
    store: ReportStore,
    clean: bool,
    problems: Vec<Problem>,
    repaired: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    remaining: Option<Vec<Problem>>,
    blocks_checked: u64,
    handles_checked: u64,
    allocations_checked: u64,
}

/// An interrupted `import calico` (its marker is still in the store): not repairable by `check`,
/// finished by running the same import again.
async fn unfinished_import(ipam: &ipam_core::Ipam) -> Result<Option<Problem>, CtlError> {
    let marker = blockipam_import::interrupted_import(ipam.store())
        .await
        .map_err(|e| CtlError::failed(crate::error::one_line(&e.to_string())))?;
    Ok(marker.map(|marker| {
        Problem::new(
            kinds::IMPORT_IN_PROGRESS,
            false,
            format!(
                "an import of {} (etcd revision {}) did not finish: the store may lack blocks, \
                 handles or pools",
                marker.source, marker.calico_revision
            ),
        )
    }))
}

fn problems_table(problems: &[Problem]) -> String {
    let mut table = Table::new(&["KIND", "REPAIRABLE", "DETAIL"]);
    for p in problems {
        table.row(vec![
            p.kind.clone(),
            yes_no(p.repairable).into(),
            p.detail.clone(),
        ]);
    }
    let mut text = table.render();
    text.push_str("What to do:\n");
    let mut explained = std::collections::BTreeSet::new();
    for p in problems {
        if !explained.insert(p.kind.as_str()) {
            continue;
        }
        // A report from an older build carries no remedy: this build's text for the kind.
        let remedy = if p.remedy.is_empty() {
            kinds::remedy(&p.kind)
        } else {
            &p.remedy
        };
        text.push_str(&format!("  {}: {remedy}\n", p.kind));
    }
    text
}

/// `check`: exit status 0 when the store is consistent (after the repair, with `--repair`), 1
/// otherwise.
///
/// # Errors
/// Store trouble.
pub async fn run(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &CheckArgs,
) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let unfinished_import = unfinished_import(&ipam).await?;
    // An import that did not finish is finished by running it again, which resumes from the
    // store as the import left it: handles rewritten from the blocks written so far would differ
    // from what it writes, and it would refuse to go on. So nothing is repaired until it is done.
    let repair_held_back = args.repair && unfinished_import.is_some();
    let repair = args.repair && !repair_held_back;
    ctx.progress(if repair {
        "checking and repairing the store ..."
    } else {
        "checking the store ..."
    });
    let mut report: CheckReport = ipam.check(repair).await?;
    report.problems.extend(unfinished_import.clone());
    let remaining = if repair_held_back {
        Some(report.problems.clone())
    } else if args.repair && !report.problems.is_empty() {
        ctx.progress("checking the store again after the repair ...");
        let mut again = ipam.check(false).await?.problems;
        again.extend(unfinished_import.clone());
        Some(again)
    } else if args.repair {
        Some(Vec::new())
    } else {
        None
    };
    ctx.progress_done();
    let mut text = format!(
        "Checked {}, {} and {}: ",
        counted(report.blocks_checked, "block", "blocks"),
        counted(report.handles_checked, "handle", "handles"),
        counted(
            report.allocations_checked,
            "allocated address",
            "allocated addresses"
        )
    );
    if report.problems.is_empty() {
        text.push_str("no problems.\n");
    } else {
        let repairable = report.problems.iter().filter(|p| p.repairable).count();
        text.push_str(&format!(
            "{} ({repairable} repairable).\n",
            counted(report.problems.len() as u64, "problem", "problems")
        ));
        text.push_str(&problems_table(&report.problems));
        if !args.repair && repairable > 0 && unfinished_import.is_none() {
            text.push_str(
                "Run `blockipamctl check --repair` to fix the repairable ones; the others need a person.\n",
            );
        }
    }
    if repair_held_back {
        text.push_str(
            "Nothing was repaired: an `import calico` did not finish. Run the same import again \
             first (it resumes and completes the store), then check again.\n",
        );
    } else if args.repair && !report.problems.is_empty() {
        if report.repaired.is_empty() {
            text.push_str("Nothing was repaired.\n");
        } else {
            text.push_str("Repaired:\n");
            for action in &report.repaired {
                text.push_str(&format!("  {action}\n"));
            }
        }
    }
    if let Some(left) = remaining.as_ref().filter(|_| !repair_held_back) {
        if !report.problems.is_empty() {
            if left.is_empty() {
                text.push_str("Checked again after the repair: no problems.\n");
            } else {
                text.push_str(&format!(
                    "Checked again after the repair: {} remain.\n",
                    counted(left.len() as u64, "problem", "problems")
                ));
                text.push_str(&problems_table(left));
            }
        }
    }
    let problems_found = match &remaining {
        Some(left) => !left.is_empty(),
        None => !report.problems.is_empty(),
    };
    let json = CheckJson {
        report: REPORT_NAME,
        version: REPORT_VERSION,
        store: ReportStore::of(settings),
        clean: !problems_found,
        problems: report.problems,
        repaired: report.repaired,
        remaining,
        blocks_checked: report.blocks_checked,
        handles_checked: report.handles_checked,
        allocations_checked: report.allocations_checked,
    };
    Ok(Outcome {
        json: to_json(&json)?,
        table: text,
        problems_found,
    })
}
