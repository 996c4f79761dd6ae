//! `pool add|list|enable|disable|delete`.

use blockipam_store::DatastoreSettings;
use ipam_core::{Ipam, IpamError, Pool, PoolSpec};
use serde::Serialize;

use super::{block_capacity, open_ipam, state, to_json, PoolJson};
use crate::cli::{PoolAddArgs, PoolDeleteArgs};
use crate::error::{one_line, CtlError};
use crate::output::{counted, group_digits, human_count, Outcome, Table};
use crate::settings::OpenMode;

/// `pool add`: validates before touching the store (bad sizes and host bits are usage errors),
/// then creates the pool (overlaps and name clashes are failures).
///
/// # Errors
/// [`CtlError::Usage`] for an invalid spec; [`CtlError::Failed`] for overlap, name clash or store
/// trouble.
pub async fn add(settings: &DatastoreSettings, args: &PoolAddArgs) -> Result<Outcome, CtlError> {
    let spec = PoolSpec {
        cidr: args.cidr,
        name: args.name.clone(),
        block_size: args.block_size,
        disabled: args.disabled,
    };
    Ipam::pool_from_spec(&spec).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Create).await?;
    let pool = ipam.create_pool(&spec).await?;
    let table = format!(
        "Created IP pool {}: {}, /{} blocks of {} addresses, {} addresses in all, {}.\n",
        pool.name,
        pool.cidr,
        pool.block_size,
        group_digits(block_capacity(&pool)),
        human_count(pool.capacity()),
        state(&pool)
    );
    Ok(Outcome::ok(to_json(&PoolJson::from(&pool))?, table))
}

/// `pool list`.
///
/// # Errors
/// Store trouble.
pub async fn list(settings: &DatastoreSettings) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let pools = ipam.list_pools().await?;
    let json: Vec<PoolJson> = pools.iter().map(PoolJson::from).collect();
    let table = if pools.is_empty() {
        "No IP pools. Create one with: blockipamctl pool add <CIDR>\n".to_owned()
    } else {
        pools_table(&pools)
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

fn pools_table(pools: &[Pool]) -> String {
    let mut table =
        Table::new(&["NAME", "CIDR", "BLOCK SIZE", "STATE", "ADDRESSES"]).right_align(&[4]);
    for pool in pools {
        table.row(vec![
            pool.name.clone(),
            pool.cidr.to_string(),
            format!("/{}", pool.block_size),
            state(pool).to_owned(),
            human_count(pool.capacity()),
        ]);
    }
    table.render()
}

/// `pool enable` / `pool disable`.
///
/// # Errors
/// Unknown pool; store trouble.
pub async fn set_disabled(
    settings: &DatastoreSettings,
    name_or_cidr: &str,
    disabled: bool,
) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let pool = ipam.set_pool_disabled(name_or_cidr, disabled).await?;
    let table = format!(
        "IP pool {} ({}) is {}.\n",
        pool.name,
        pool.cidr,
        state(&pool)
    );
    Ok(Outcome::ok(to_json(&PoolJson::from(&pool))?, table))
}

/// What `pool delete` prints as JSON.
#[derive(Debug, Serialize)]
struct DeletionJson {
    pool: PoolJson,
    released_addresses: u64,
    deleted_blocks: u64,
}

/// `pool delete`.
///
/// # Errors
/// Unknown pool; addresses still allocated without `--force`; store trouble.
pub async fn delete(
    settings: &DatastoreSettings,
    args: &PoolDeleteArgs,
) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let deletion = ipam
        .delete_pool(&args.pool, args.force)
        .await
        .map_err(|e| match e {
            IpamError::PoolInUse { pool, in_use } => CtlError::failed(format!(
                "IP pool {pool:?} still has {in_use} allocated addresses: release them first, \
                 or pass --force to release them and delete the pool"
            )),
            other => other.into(),
        })?;
    let table = format!(
        "Deleted IP pool {} ({}): released {}, deleted {}.\n",
        deletion.pool.name,
        deletion.pool.cidr,
        counted(deletion.released_addresses, "address", "addresses"),
        counted(deletion.deleted_blocks, "block", "blocks")
    );
    let json = DeletionJson {
        pool: PoolJson::from(&deletion.pool),
        released_addresses: deletion.released_addresses,
        deleted_blocks: deletion.deleted_blocks,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// An allocator validation error without the generic "invalid argument: " lead.
pub(crate) fn invalid_text(error: &IpamError) -> String {
    match error {
        IpamError::InvalidArgument(message) => one_line(message),
        other => one_line(&other.to_string()),
    }
}
