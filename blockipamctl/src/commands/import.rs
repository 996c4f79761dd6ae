//! `import calico`: read a Calico etcdv3 datastore at one revision, write the equivalent pools,
//! config, blocks and handles into the selected empty store (created when embedded and missing),
//! verify them, and report what could not be mapped (`blockipam-import` does the work).

use std::time::Duration;

use blockipam_import::{
    dry_run_report, inspect_target, read_plan, resume_revision, write_plan, CalicoEtcdSource,
    ImportError, ImportReport,
};
use blockipam_store::DatastoreSettings;
use serde::Serialize;

use super::to_json;
use crate::cli::ImportCalicoArgs;
use crate::error::{one_line, CtlError};
use crate::output::{counted, Ctx, Outcome, Table};
use crate::settings::{self, Env, OpenMode};

#[derive(Debug, Serialize)]
struct ImportJson<'a> {
    target: String,
    #[serde(flatten)]
    report: &'a ImportReport,
}

/// The Calico source the flags describe.
///
/// # Errors
/// [`CtlError::Usage`] for a password variable that is not set, or a user without one.
fn source(
    args: &ImportCalicoArgs,
    env: &Env,
    etcd_request_timeout: Option<Duration>,
) -> Result<CalicoEtcdSource, CtlError> {
    let password = match (&args.from_etcd_username, &args.from_etcd_password_env) {
        (None, None) => None,
        (Some(_), Some(var)) => Some(
            env.get(var)
                .ok_or_else(|| {
                    CtlError::usage(format!(
                        "--from-etcd-password-env names {var}, which is not set"
                    ))
                })?
                .to_owned(),
        ),
        (Some(_), None) => {
            return Err(CtlError::usage(
                "--from-etcd-username needs --from-etcd-password-env (the variable holding the password)",
            ))
        }
        (None, Some(_)) => {
            return Err(CtlError::usage(
                "--from-etcd-password-env needs --from-etcd-username",
            ))
        }
    };
    let source = CalicoEtcdSource {
        endpoints: DatastoreSettings::parse_endpoints(&args.from_etcd_endpoints),
        prefix: args.from_etcd_prefix.clone(),
        ca_cert_file: args.from_etcd_ca_cert_file.clone(),
        cert_file: args.from_etcd_cert_file.clone(),
        key_file: args.from_etcd_key_file.clone(),
        username: args.from_etcd_username.clone(),
        password,
        request_timeout: etcd_request_timeout.or(Some(Duration::from_secs(10))),
    };
    source
        .validate()
        .map_err(|e| usage_or_failed(&e, "--from-etcd"))?;
    Ok(source)
}

fn usage_or_failed(error: &ImportError, context: &str) -> CtlError {
    let message = one_line(&error.to_string());
    match error {
        ImportError::InvalidSource(_) => CtlError::usage(format!("{context}: {message}")),
        _ => CtlError::failed(message),
    }
}

/// `import calico`.
///
/// # Errors
/// [`CtlError::Usage`] for bad source flags; [`CtlError::Failed`] when Calico's etcd cannot be
/// read, its data cannot be mapped (nothing written), the target is not empty, or the written
/// store does not verify (the import marker then stays: run the same import again to resume).
pub async fn calico(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &ImportCalicoArgs,
    env: &Env,
    etcd_request_timeout: Option<Duration>,
) -> Result<Outcome, CtlError> {
    let source = source(args, env, etcd_request_timeout)?;
    ctx.progress(&format!("reading {} ...", source.describe()));
    // Read and map first: a refusal opens (and creates) nothing.
    let plan = read_plan(&source, None)
        .await
        .map_err(|e| usage_or_failed(&e, "--from-etcd"));
    ctx.progress_done();
    let plan = plan?;
    let target_desc = settings.describe();
    if args.dry_run {
        let report = dry_run_report(&source, &plan);
        return render(&report, &target_desc);
    }
    let target = settings::open(settings, OpenMode::Create)
        .await
        .map_err(|e| e.context("target"))?;
    let state = inspect_target(&target)
        .await
        .map_err(|e| usage_or_failed(&e, "target"))?;
    let plan = match resume_revision(&source, &state).map_err(|e| usage_or_failed(&e, "target"))? {
        Some(revision) => {
            ctx.progress(&format!(
                "resuming the interrupted import at revision {revision} ..."
            ));
            read_plan(&source, Some(revision))
                .await
                .map_err(|e| usage_or_failed(&e, "--from-etcd"))?
        }
        None => plan,
    };
    ctx.progress(&format!("writing into {target_desc} ..."));
    let written = write_plan(&source, &plan, &target, &state).await;
    ctx.progress_done();
    let report = written.map_err(|e| {
        CtlError::failed(format!(
            "import into {target_desc} failed: {}",
            one_line(&e.to_string())
        ))
    })?;
    render(&report, &target_desc)
}

fn render(report: &ImportReport, target: &str) -> Result<Outcome, CtlError> {
    let json = to_json(&ImportJson {
        target: target.to_owned(),
        report,
    })?;
    let n = |count: usize| count as u64;
    let mut text = if report.dry_run {
        format!(
            "Dry run: {} at revision {} would import into {target}:\n",
            report.source, report.calico_revision
        )
    } else {
        format!(
            "Imported {} at revision {} into {target}{}:\n",
            report.source,
            report.calico_revision,
            if report.resumed {
                " (resumed an interrupted import)"
            } else {
                ""
            }
        )
    };
    text.push_str(&format!(
        "  {}, {} ({} affine to a host), {}, {}, {}, {}, {}\n  config{}: strict_affinity {}, \
         auto_allocate_blocks {}, max_blocks_per_host {}, ip_cooldown_seconds {}; sequence floor \
         {}\n",
        counted(n(report.pools), "pool", "pools"),
        counted(n(report.blocks), "block", "blocks"),
        report.affine_blocks,
        counted(n(report.allocations), "allocation", "allocations"),
        counted(n(report.handles), "handle", "handles"),
        counted(n(report.reservations), "IP reservation", "IP reservations"),
        counted(n(report.labelled_nodes), "labelled node", "labelled nodes"),
        counted(
            n(report.cooling_addresses),
            "address in IP cooldown",
            "addresses in IP cooldown"
        ),
        if report.config_from_calico {
            ""
        } else {
            " (Calico's defaults: it stored none)"
        },
        report.config.strict_affinity,
        report.config.auto_allocate_blocks,
        report.config.max_blocks_per_host,
        report.config.ip_cooldown_seconds,
        report.sequence_floor,
    ));
    if report.dry_run {
        text.push_str("Nothing was written.\n");
    } else {
        text.push_str(&format!(
            "  {} written in {}{}.\nVerified: every Calico allocation is present with its handle \
             and attributes, handle counts match, and check is clean.\n",
            counted(n(report.keys_written), "key", "keys"),
            counted(n(report.transactions), "transaction", "transactions"),
            if report.keys_already_present > 0 {
                format!(
                    " ({} were written by the interrupted run)",
                    report.keys_already_present
                )
            } else {
                String::new()
            }
        ));
    }
    if report.not_mapped.is_empty() {
        text.push_str("Everything was mapped.\n");
    } else {
        text.push_str(&format!("\nNot mapped ({}):\n", report.not_mapped.len()));
        let mut table = Table::new(&["OBJECT", "FIELD", "VALUE", "NOTE"]);
        for item in &report.not_mapped {
            table.row(vec![
                item.object.clone(),
                if item.field.is_empty() {
                    "-".into()
                } else {
                    item.field.clone()
                },
                if item.value.is_empty() {
                    "-".into()
                } else {
                    item.value.clone()
                },
                item.note.clone(),
            ]);
        }
        text.push_str(&table.render());
    }
    Ok(Outcome::ok(json, text))
}
