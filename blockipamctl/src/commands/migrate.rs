//! `migrate`: copy every blockipam key (pools, blocks, affinities, claims, handles, config) from the
//! selected store into an empty target store, verify the copy, and undo it if anything fails.
//!
//! The copy is raw: each key under `ipam/v1/` is written with its bytes unchanged, in transactions
//! of at most `MAX_TXN_OPS` operations and `MAX_TXN_BYTES` bytes (under etcd's request limit), each
//! key guarded by an "absent" condition so that nothing in the target is ever overwritten.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use blockipam_store::DatastoreSettings;
use ipam_core::kv::{MAX_TXN_BYTES, MAX_TXN_OPS};
use ipam_core::model::{keys, ROOT};
use ipam_core::{Condition, Ipam, KeyValue, KvStore, Op, Txn};
use serde::Serialize;

use super::to_json;
use crate::cli::MigrateArgs;
use crate::error::{one_line, CtlError};
use crate::output::{counted, Ctx, Outcome};
use crate::settings::{self, Env, OpenMode};

#[derive(Debug, Default, Serialize)]
struct MigrateJson {
    source: String,
    target: String,
    keys_copied: usize,
    transactions: usize,
    pools: usize,
    blocks: usize,
    affine_blocks: usize,
    claims: usize,
    handles: usize,
    config: bool,
    verified: bool,
}

/// `migrate`.
///
/// # Errors
/// [`CtlError::Usage`] for bad target flags or a target that is the source;
/// [`CtlError::Failed`] for a non-empty target, an inconsistent or empty source, store trouble,
/// or a copy that does not verify (the target is emptied again in that case).
pub async fn run(
    ctx: &mut Ctx<'_>,
    source_settings: &DatastoreSettings,
    args: &MigrateArgs,
    env: &Env,
    etcd_request_timeout: Option<Duration>,
) -> Result<Outcome, CtlError> {
    let target_settings =
        settings::resolve_target(args, source_settings, env, etcd_request_timeout)?;
    if settings::same_store(source_settings, &target_settings) {
        let how = if source_settings.datastore_type() == target_settings.datastore_type() {
            String::new()
        } else {
            format!(
                " ({}): one path holds one store",
                source_settings.describe()
            )
        };
        return Err(CtlError::usage(format!(
            "the target ({}) is the source store itself{how}",
            target_settings.describe()
        )));
    }
    let source_desc = source_settings.describe();
    let target_desc = target_settings.describe();
    let source = settings::open(source_settings, OpenMode::Existing)
        .await
        .map_err(|e| e.context("source"))?;
    let target = settings::open(&target_settings, OpenMode::Create)
        .await
        .map_err(|e| e.context("target"))?;

    let present = target.list(ROOT).await.map_err(|e| {
        CtlError::failed(format!(
            "cannot read the target store ({target_desc}): {}",
            one_line(&e.to_string())
        ))
    })?;
    if !present.is_empty() {
        return Err(CtlError::failed(format!(
            "the target store ({target_desc}) is not empty: it holds {} keys under {ROOT}; \
             migrate copies only into an empty store. Nothing was written",
            present.len()
        )));
    }

    ctx.progress("checking the source store ...");
    let source_ipam = Ipam::new(source.clone());
    let report = source_ipam.check(false).await?;
    if let Some(first) = report.problems.first() {
        ctx.progress_done();
        return Err(CtlError::failed(format!(
            "the source store ({source_desc}) has {} (first: {}: {}); run \
             `blockipamctl check --repair` (and fix the rest by hand) before migrating. Nothing was written",
            counted(report.problems.len() as u64, "problem", "problems"),
            first.kind,
            first.detail
        )));
    }
    ctx.progress("reading the source store ...");
    let mut snapshot = source.list(ROOT).await?;
    // Liveness keys and the reclaimer leader key belong to the source's running agents (on etcd,
    // to their leases): copied, they would outlive those leases and make dead nodes look alive
    // forever. The agents write them again on the target.
    // Grace countdowns are on leases too, and a reclaimer's mark names revisions of the source:
    // both are dropped, so every node starts the target unjudged.
    let liveness = ipam_core::dead_nodes::liveness_dir();
    let countdowns = ipam_core::dead_nodes::countdown_dir();
    let leader = ipam_core::dead_nodes::reclaimer_leader_key();
    snapshot.retain(|kv| {
        !kv.key.starts_with(&liveness) && !kv.key.starts_with(&countdowns) && kv.key != leader
    });
    let agents = ipam_core::dead_nodes::agents_dir();
    for kv in snapshot.iter_mut().filter(|kv| kv.key.starts_with(&agents)) {
        if let Ok(mut registration) =
            serde_json::from_slice::<ipam_core::dead_nodes::Registration>(&kv.value)
        {
            registration.missing_mark = None;
            registration.missing_since = None;
            if let Ok(value) = serde_json::to_vec(&registration) {
                kv.value = value;
            }
        }
    }
    if snapshot.is_empty() {
        ctx.progress_done();
        return Err(CtlError::failed(format!(
            "the source store ({source_desc}) holds no blockipam data (no key under {ROOT}): \
             nothing to migrate"
        )));
    }

    let mut summary = summarize(&snapshot);
    summary.source = source_desc.clone();
    summary.target = target_desc.clone();

    let copied = copy(ctx, &target, &snapshot).await;
    let outcome = match copied {
        Ok(transactions) => {
            summary.transactions = transactions;
            ctx.progress("verifying the copy ...");
            verify(&source_ipam, &target, &snapshot).await
        }
        Err(message) => Err(message),
    };
    ctx.progress_done();
    if let Err(message) = outcome {
        let undo = match undo(&target, &snapshot).await {
            Ok(0) => "the target was left empty".to_owned(),
            Ok(1) => "the one key copied so far was removed from the target again".to_owned(),
            Ok(n) => format!("the {n} keys copied so far were removed from the target again"),
            Err(e) => format!(
                "removing the keys copied so far failed too ({e}): empty the target before trying again"
            ),
        };
        return Err(CtlError::failed(format!(
            "migration to {target_desc} failed: {message}; {undo}"
        )));
    }
    summary.keys_copied = snapshot.len();
    summary.verified = true;

    let n = |count: usize| count as u64;
    let table = format!(
        "Migrated {source_desc} -> {target_desc}:\n  \
         {}, {} ({} affine to a host), {}, {}, config: {}\n  \
         {} in {}.\n\
         Verified: the target holds exactly the source's keys, its check is clean, and its \
         `show --blocks` equals the source's.\n",
        counted(n(summary.pools), "pool", "pools"),
        counted(n(summary.blocks), "block", "blocks"),
        summary.affine_blocks,
        counted(
            n(summary.claims),
            "claim index entry",
            "claim index entries"
        ),
        counted(n(summary.handles), "handle", "handles"),
        if summary.config {
            "copied"
        } else {
            "never set (defaults)"
        },
        counted(n(summary.keys_copied), "key", "keys"),
        counted(n(summary.transactions), "transaction", "transactions"),
    );
    Ok(Outcome::ok(to_json(&summary)?, table))
}

fn summarize(snapshot: &[KeyValue]) -> MigrateJson {
    let count = |prefix: &str| {
        snapshot
            .iter()
            .filter(|kv| kv.key.starts_with(prefix))
            .count()
    };
    MigrateJson {
        pools: count(&keys::pools_dir()),
        blocks: count(&keys::blocks_dir()),
        affine_blocks: count(&keys::affine_blocks_dir()),
        claims: count(&keys::claims_dir()),
        handles: count(&keys::handles_dir()),
        config: snapshot.iter().any(|kv| kv.key == keys::config()),
        ..MigrateJson::default()
    }
}

/// Splits the snapshot into transactions of at most `MAX_TXN_OPS` keys and `MAX_TXN_BYTES` bytes,
/// counted as `Txn::validate` counts them: each key twice (its put and its condition) plus its value.
fn chunks(snapshot: &[KeyValue]) -> Vec<&[KeyValue]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, kv) in snapshot.iter().enumerate() {
        let size = 2 * kv.key.len() + kv.value.len();
        let count = i - start;
        if count > 0 && (count == MAX_TXN_OPS || bytes + size > MAX_TXN_BYTES) {
            out.push(&snapshot[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < snapshot.len() {
        out.push(&snapshot[start..]);
    }
    out
}

async fn copy(
    ctx: &mut Ctx<'_>,
    target: &Arc<dyn KvStore>,
    snapshot: &[KeyValue],
) -> Result<usize, String> {
    let chunks = chunks(snapshot);
    let mut done = 0;
    for (n, chunk) in chunks.iter().enumerate() {
        ctx.progress(&format!(
            "copying: {done}/{} keys (transaction {}/{}) ...",
            snapshot.len(),
            n + 1,
            chunks.len()
        ));
        target.commit(copy_txn(chunk)).await.map_err(|e| {
            if e.is_conflict() {
                format!(
                    "another writer created key {:?} in the target during the copy",
                    conflict_key(&e)
                )
            } else {
                format!(
                    "writing keys {done}..{} failed: {}",
                    done + chunk.len(),
                    one_line(&e.to_string())
                )
            }
        })?;
        done += chunk.len();
    }
    Ok(chunks.len())
}

/// The transaction that copies `chunk`: each key put only where it is absent.
fn copy_txn(chunk: &[KeyValue]) -> Txn {
    Txn {
        conditions: chunk.iter().map(|kv| Condition::absent(&kv.key)).collect(),
        ops: chunk
            .iter()
            .map(|kv| Op::put(&kv.key, kv.value.clone()))
            .collect(),
    }
}

fn conflict_key(error: &ipam_core::KvError) -> String {
    match error {
        ipam_core::KvError::Conflict { key } => key.clone(),
        other => other.to_string(),
    }
}

async fn verify(
    source: &Ipam,
    target: &Arc<dyn KvStore>,
    snapshot: &[KeyValue],
) -> Result<(), String> {
    let copied = target
        .list(ROOT)
        .await
        .map_err(|e| format!("cannot read the target back: {}", one_line(&e.to_string())))?;
    let wanted: BTreeMap<&str, &[u8]> = snapshot
        .iter()
        .map(|kv| (kv.key.as_str(), kv.value.as_slice()))
        .collect();
    let found: BTreeMap<&str, &[u8]> = copied
        .iter()
        .map(|kv| (kv.key.as_str(), kv.value.as_slice()))
        .collect();
    if wanted != found {
        let differing = wanted
            .iter()
            .find(|(k, v)| found.get(*k) != Some(*v))
            .map(|(k, _)| (*k).to_owned())
            .or_else(|| {
                found
                    .keys()
                    .find(|k| !wanted.contains_key(*k))
                    .map(|k| (*k).to_owned())
            })
            .unwrap_or_default();
        return Err(format!(
            "the target does not hold exactly the source's keys (first difference: {differing:?})"
        ));
    }
    let target_ipam = Ipam::new(target.clone());
    let report = target_ipam
        .check(false)
        .await
        .map_err(|e| format!("cannot check the target: {}", one_line(&e.to_string())))?;
    if let Some(first) = report.problems.first() {
        return Err(format!(
            "the target's check found {} (first: {}: {})",
            counted(report.problems.len() as u64, "problem", "problems"),
            first.kind,
            first.detail
        ));
    }
    let source_usage = source
        .utilization()
        .await
        .map_err(|e| format!("cannot read the source again: {}", one_line(&e.to_string())))?;
    let target_usage = target_ipam.utilization().await.map_err(|e| {
        format!(
            "cannot read the target's usage: {}",
            one_line(&e.to_string())
        )
    })?;
    if source_usage != target_usage {
        return Err(
            "the target's `show --blocks` differs from the source's (did something write to the \
             source during the migration? stop the plugins and try again)"
                .to_owned(),
        );
    }
    Ok(())
}

/// Deletes from the target every key the copy wrote (those still holding the copied bytes, each
/// at the revision it was read at); returns how many.
async fn undo(target: &Arc<dyn KvStore>, snapshot: &[KeyValue]) -> Result<usize, String> {
    let ours: BTreeMap<&str, &[u8]> = snapshot
        .iter()
        .map(|kv| (kv.key.as_str(), kv.value.as_slice()))
        .collect();
    let present = target
        .list(ROOT)
        .await
        .map_err(|e| one_line(&e.to_string()))?;
    let doomed: Vec<KeyValue> = present
        .into_iter()
        .filter(|kv| ours.get(kv.key.as_str()) == Some(&kv.value.as_slice()))
        .collect();
    for chunk in doomed.chunks(MAX_TXN_OPS) {
        let txn = Txn {
            conditions: chunk
                .iter()
                .map(|kv| Condition::at_revision(&kv.key, kv.revision))
                .collect(),
            ops: chunk.iter().map(|kv| Op::delete(&kv.key)).collect(),
        };
        target
            .commit(txn)
            .await
            .map_err(|e| one_line(&e.to_string()))?;
    }
    Ok(doomed.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::Revision;

    fn kv(key: &str, size: usize) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: vec![0; size],
            revision: Revision(1),
        }
    }

    #[test]
    fn chunks_respect_the_operation_limit() {
        let snapshot: Vec<KeyValue> = (0..300).map(|i| kv(&format!("k{i:03}"), 10)).collect();
        let sizes: Vec<usize> = chunks(&snapshot).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, vec![128, 128, 44]);
    }

    #[test]
    fn chunks_respect_the_byte_budget_and_never_come_out_empty() {
        let snapshot = vec![
            kv("a", 800 * 1024),
            kv("b", 800 * 1024),
            kv("c", 2 * 1024 * 1024),
            kv("d", 1),
            kv("e", 300 * 1024),
        ];
        let sizes: Vec<usize> = chunks(&snapshot).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, vec![1, 1, 1, 2]);
        for chunk in chunks(&snapshot) {
            let total: usize = chunk
                .iter()
                .map(|kv| 2 * kv.key.len() + kv.value.len())
                .sum();
            assert!(chunk.len() == 1 || total <= MAX_TXN_BYTES);
        }
        assert!(chunks(&[]).is_empty());
        assert_eq!(
            chunks(&[kv("big", MAX_TXN_BYTES + 10)])
                .iter()
                .map(|c| c.len())
                .collect::<Vec<_>>(),
            vec![1],
            "a value over the budget alone is one chunk, not an empty one before it"
        );
    }

    /// Two keys of 100 bytes whose puts and conditions fill the byte budget exactly: one
    /// transaction, which `Txn::validate` accepts; one byte more: two.
    #[test]
    fn chunks_count_each_key_twice_as_the_transaction_limit_does() {
        let key = |c: char| format!("ipam/v1/handles/{}", c.to_string().repeat(84));
        let (first, second) = (key('a'), key('b'));
        assert_eq!(first.len(), 100);
        let half = MAX_TXN_BYTES / 2 - 200;
        for (extra, expected) in [(0, vec![2]), (1, vec![1, 1])] {
            let snapshot = vec![kv(&first, half), kv(&second, half + extra)];
            let sizes: Vec<usize> = chunks(&snapshot).iter().map(|c| c.len()).collect();
            assert_eq!(sizes, expected, "{extra} byte(s) over an exact fit");
            for chunk in chunks(&snapshot) {
                copy_txn(chunk)
                    .validate()
                    .expect("each chunk is one valid transaction");
            }
            let whole = copy_txn(&snapshot).validate();
            assert_eq!(whole.is_ok(), extra == 0, "{whole:?}");
        }
    }

    #[test]
    fn the_summary_says_whether_the_config_was_ever_set() {
        let pool = kv(&keys::pool("main"), 10);
        assert!(!summarize(std::slice::from_ref(&pool)).config);
        let with_config = summarize(&[kv(&keys::config(), 10), pool]);
        assert!(with_config.config);
        assert_eq!(with_config.pools, 1);
    }

    #[test]
    fn a_conflict_names_the_key_another_writer_created() {
        let run = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let target: Arc<dyn KvStore> = Arc::new(ipam_core::MemoryStore::new());
        let snapshot = vec![kv(&keys::pool("a"), 1), kv(&keys::pool("b"), 1)];
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let mut ctx = Ctx::new(
            crate::cli::OutputFormat::Table,
            &mut stdout,
            &mut stderr,
            false,
        );
        let message = run.block_on(async {
            target
                .put(&keys::pool("b"), b"theirs".to_vec())
                .await
                .expect("another writer's key");
            copy(&mut ctx, &target, &snapshot)
                .await
                .expect_err("the copy meets the other writer's key")
        });
        assert_eq!(
            message,
            format!(
                "another writer created key {:?} in the target during the copy",
                keys::pool("b")
            )
        );
    }

    /// A memory store holding `snapshot`'s keys and values.
    async fn copy_of(snapshot: &[KeyValue]) -> Arc<dyn KvStore> {
        let target: Arc<dyn KvStore> = Arc::new(ipam_core::MemoryStore::new());
        for kv in snapshot {
            target.put(&kv.key, kv.value.clone()).await.expect("put");
        }
        target
    }

    /// `verify` against stores that differ from the snapshot in each way it looks for.
    #[test]
    fn verify_finds_each_kind_of_difference() {
        let run = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        run.block_on(async {
            let source_store: Arc<dyn KvStore> = Arc::new(ipam_core::MemoryStore::new());
            let source = Ipam::new(source_store.clone());
            source
                .create_pool(&ipam_core::PoolSpec {
                    cidr: "10.70.0.0/24".parse().expect("a pool"),
                    name: Some("main".into()),
                    block_size: Some(28),
                    disabled: false,
                })
                .await
                .expect("a pool");
            let assign = |handle: &str| ipam_core::AutoAssignRequest {
                handle: handle.into(),
                host: "host-a".into(),
                num_v4: 1,
                ..ipam_core::AutoAssignRequest::default()
            };
            source.auto_assign(&assign("net.a")).await.expect("assign");
            let snapshot = source_store.list(ROOT).await.expect("the snapshot");
            let exact = copy_of(&snapshot).await;
            verify(&source, &exact, &snapshot)
                .await
                .expect("an exact copy verifies");

            let handle = keys::handle("net.a");
            let missing = copy_of(&snapshot).await;
            missing.delete(&handle).await.expect("delete");
            let changed = copy_of(&snapshot).await;
            changed.put(&handle, b"{}".to_vec()).await.expect("put");
            let extra = copy_of(&snapshot).await;
            let stranger = keys::handle("net.stranger");
            extra.put(&stranger, b"{}".to_vec()).await.expect("put");
            for (target, key) in [(missing, &handle), (changed, &handle), (extra, &stranger)] {
                let error = verify(&source, &target, &snapshot)
                    .await
                    .expect_err("a copy that differs");
                assert_eq!(
                    error,
                    format!(
                        "the target does not hold exactly the source's keys (first difference: \
                         {key:?})"
                    )
                );
            }

            // A snapshot (and its copy) that is not consistent: the target's check says so.
            let mut inconsistent = snapshot.clone();
            let overcounting = inconsistent
                .iter_mut()
                .find(|kv| kv.key == handle)
                .expect("the handle");
            let mut decoded: ipam_core::model::Handle =
                ipam_core::model::decode(&handle, &overcounting.value).expect("a handle");
            for count in decoded.blocks.values_mut() {
                *count += 5;
            }
            overcounting.value = ipam_core::model::encode(&decoded).expect("encode");
            let target = copy_of(&inconsistent).await;
            let error = verify(&source, &target, &inconsistent)
                .await
                .expect_err("an inconsistent copy");
            assert!(
                error.starts_with(
                    "the target's check found 1 problem (first: handle-count-mismatch"
                ),
                "{error}"
            );

            // The source written to after the snapshot: its usage no longer matches the copy's.
            source.auto_assign(&assign("net.b")).await.expect("assign");
            let error = verify(&source, &exact, &snapshot)
                .await
                .expect_err("a source that moved on");
            assert!(error.contains("differs from the source's"), "{error}");
        });
    }
}
