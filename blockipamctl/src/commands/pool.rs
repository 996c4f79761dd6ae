//! `pool add|list|enable|disable|delete|set|split`.

use blockipam_store::DatastoreSettings;
use ipam_core::selector::Selector;
use ipam_core::{AllowedUses, Ipam, IpamError, Pool, PoolChange, PoolPolicy, PoolSpec};
use serde::Serialize;

use super::{block_capacity, open_ipam, state, to_json, PoolJson};
use crate::cli::{PoolAddArgs, PoolDeleteArgs, PoolSetArgs, PoolSplitArgs};
use crate::error::{one_line, CtlError};
use crate::output::{counted, group_digits, human_count, Outcome, Table};
use crate::settings::OpenMode;

/// `pool add`: validates before touching the store (bad sizes, host bits and link-local ranges
/// are usage errors),
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
    Ipam::new_pool_from_spec(&spec).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let change = parse_change(
        args.node_selector.as_deref(),
        args.assignment_mode.as_deref(),
        args.allowed_uses.as_deref(),
    )?;
    let policy = PoolPolicy {
        node_selector: change.node_selector.unwrap_or_default(),
        assignment_mode: change.assignment_mode.unwrap_or_default(),
        allowed_uses: change.allowed_uses.unwrap_or_default(),
    };
    let ipam = open_ipam(settings, OpenMode::Create).await?;
    let pool = ipam.create_pool_with_policy(&spec, &policy).await?;
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
    let (pools, damaged) = ipam.list_pools_each().await?;
    let json: Vec<PoolListed> = pools
        .iter()
        .map(|pool| PoolListed::Sound(PoolJson::from(pool)))
        .chain(damaged.iter().map(|(name, e)| PoolListed::Damaged {
            name: name.clone(),
            error: e.to_string(),
        }))
        .collect();
    let table = if json.is_empty() {
        "No IP pools. Create one with: blockipamctl pool add <CIDR>\n".to_owned()
    } else {
        pools_table(&pools, &damaged)
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// One entry of `pool list -o json`: a pool, or a pool object that cannot be decoded (its name,
/// from its key, and what is wrong).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum PoolListed {
    Sound(PoolJson),
    Damaged { name: String, error: String },
}

/// The state `pool list` shows for a pool object that cannot be decoded.
const UNDECODABLE_POOL: &str = "cannot be decoded";

fn pools_table(pools: &[Pool], damaged: &[(String, IpamError)]) -> String {
    let mut table = Table::new(&[
        "NAME",
        "CIDR",
        "BLOCK SIZE",
        "STATE",
        "ADDRESSES",
        "NODE SELECTOR",
        "MODE",
        "USES",
    ])
    .right_align(&[4]);
    for pool in pools {
        table.row(vec![
            pool.name.clone(),
            pool.cidr.to_string(),
            format!("/{}", pool.block_size),
            state(pool).to_owned(),
            human_count(pool.capacity()),
            pool.node_selector.to_string(),
            pool.assignment_mode.to_string(),
            pool.allowed_uses.to_string(),
        ]);
    }
    for (name, _) in damaged {
        table.row(vec![
            name.clone(),
            "?".into(),
            "?".into(),
            UNDECODABLE_POOL.into(),
        ]);
    }
    let mut text = table.render();
    for (name, e) in damaged {
        text.push_str(&format!(
            "Pool {name} cannot be decoded ({e}): every ADD fails until it is restored; see \
             `blockipamctl check`.\n"
        ));
    }
    text
}

/// The pool settings given on the command line, validated before the store is touched: a
/// selector that does not parse, an unknown mode or use, or an invalid set of uses is a usage
/// error naming what is wrong (a selector error names the character position).
fn parse_change(
    node_selector: Option<&str>,
    assignment_mode: Option<&str>,
    allowed_uses: Option<&str>,
) -> Result<PoolChange, CtlError> {
    let node_selector = node_selector
        .map(|text| {
            Selector::parse(text)
                .map_err(|e| CtlError::usage(format!("invalid --node-selector: {e}")))
        })
        .transpose()?;
    let assignment_mode = assignment_mode
        .map(|text| {
            text.parse().map_err(|e: IpamError| {
                CtlError::usage(format!("--assignment-mode: {}", invalid_text(&e)))
            })
        })
        .transpose()?;
    let allowed_uses = allowed_uses
        .map(|text| {
            AllowedUses::parse(text)
                .map_err(|e| CtlError::usage(format!("--allowed-uses: {}", invalid_text(&e))))
        })
        .transpose()?;
    Ok(PoolChange {
        node_selector,
        assignment_mode,
        allowed_uses,
        disabled: None,
        block_size: None,
    })
}

/// `pool set`: validates every given setting, then changes them in one compare-and-swap.
///
/// # Errors
/// [`CtlError::Usage`] for an invalid setting; unknown pool; store trouble.
pub async fn set(settings: &DatastoreSettings, args: &PoolSetArgs) -> Result<Outcome, CtlError> {
    let mut change = parse_change(
        args.node_selector.as_deref(),
        args.assignment_mode.as_deref(),
        args.allowed_uses.as_deref(),
    )?;
    change.disabled = args.disabled;
    change.block_size = args.block_size;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let pool = ipam
        .set_pool(&args.pool, &change)
        .await
        .map_err(|e| match e {
            IpamError::InvalidArgument(_) => CtlError::usage(invalid_text(&e)),
            other => other.into(),
        })?;
    let release = if change.node_selector.is_some() {
        Some(super::blocks::release_unselected_empty_blocks(&ipam).await?)
    } else {
        None
    };
    let released = release.as_ref().map_or("", |r| r.text.as_str());
    let table = format!(
        "IP pool {} ({}): {}, /{} blocks for new claims, node selector {}, {} assignment, allowed uses {}.\n{released}",
        pool.name,
        pool.cidr,
        state(&pool),
        pool.block_size,
        pool.node_selector,
        pool.assignment_mode,
        pool.allowed_uses
    );
    let json = PoolSetJson {
        pool: PoolJson::from(&pool),
        released_empty_blocks: release
            .map(|r| r.released)
            .filter(|released| !released.is_empty()),
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// What `pool set` prints as JSON: the pool, and, when `--node-selector` released any, the empty
/// blocks of any node that its pools no longer select.
#[derive(Debug, Serialize)]
struct PoolSetJson {
    #[serde(flatten)]
    pool: PoolJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    released_empty_blocks: Option<Vec<super::blocks::ReleasedEmptyBlock>>,
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
    let naming = ipam.namespaces_naming_pool(&pool).await?;
    let mut table = format!(
        "IP pool {} ({}) is {}.\n",
        pool.name,
        pool.cidr,
        state(&pool)
    );
    if disabled {
        table.push_str(&stranded_namespaces(&naming));
    }
    let json = DisabledJson {
        pool: PoolJson::from(&pool),
        named_by_namespaces: naming,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// What `pool enable` and `pool disable` print as JSON: the pool, and the namespaces whose pools
/// setting names it.
#[derive(Debug, Serialize)]
struct DisabledJson {
    #[serde(flatten)]
    pool: PoolJson,
    named_by_namespaces: Vec<String>,
}

/// What to tell about the namespaces whose pools setting names a pool that was disabled or
/// deleted: their pods' ADDs fail until the setting changes. Empty when there are none.
fn stranded_namespaces(naming: &[String]) -> String {
    if naming.is_empty() {
        return String::new();
    }
    format!(
        "Namespaces whose pools setting names it: {}. Their pods' ADDs fail (error 105) until \
         `blockipamctl namespace pools <namespace>` names other pools (or --clear).\n",
        naming.join(", ")
    )
}

/// What `pool delete` prints as JSON.
#[derive(Debug, Serialize)]
struct DeletionJson {
    pool: PoolJson,
    released_addresses: u64,
    deleted_blocks: u64,
    /// Namespaces whose pools setting still names the deleted pool.
    named_by_namespaces: Vec<String>,
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
    let deletion = match ipam.delete_pool(&args.pool, args.force).await {
        Err(IpamError::Corrupt { key, message })
            if key == ipam_core::model::keys::pool(&args.pool) =>
        {
            return delete_undecodable(&ipam, &args.pool, args.force, &message).await;
        }
        other => other,
    };
    let deletion = deletion.map_err(|e| match e {
        IpamError::PoolInUse { pool, in_use } => CtlError::failed(format!(
            "IP pool {pool:?} still has {in_use} allocated addresses: release them first, \
                 or pass --force to release them and delete the pool"
        )),
        other => other.into(),
    })?;
    let naming = ipam.namespaces_naming_pool(&deletion.pool).await?;
    let table = format!(
        "Deleted IP pool {} ({}): released {}, deleted {}.\n{}",
        deletion.pool.name,
        deletion.pool.cidr,
        counted(deletion.released_addresses, "address", "addresses"),
        counted(deletion.deleted_blocks, "block", "blocks"),
        stranded_namespaces(&naming)
    );
    let json = DeletionJson {
        pool: PoolJson::from(&deletion.pool),
        released_addresses: deletion.released_addresses,
        deleted_blocks: deletion.deleted_blocks,
        named_by_namespaces: naming,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// What `pool delete --force` prints as JSON for a pool object that could not be decoded.
#[derive(Debug, Serialize)]
struct UndecodableDeletionJson {
    pool: PoolListed,
    released_addresses: u64,
    deleted_blocks: u64,
}

/// `pool delete NAME` of a pool whose object cannot be decoded: its CIDR is unknown, so none of
/// its addresses can be counted or released. Without `--force`, nothing is deleted and the error
/// says what `--force` does; with it, the object alone is deleted (ADDs work again) and its
/// blocks and their allocations stay, until the pool is added again with its CIDR.
async fn delete_undecodable(
    ipam: &Ipam,
    name: &str,
    force: bool,
    reason: &str,
) -> Result<Outcome, CtlError> {
    if !force {
        return Err(CtlError::failed(format!(
            "IP pool {name:?} cannot be decoded ({reason}), so its addresses cannot be counted: \
             nothing deleted. Upgrade this tool if a newer blockipam wrote it, restore it from a \
             backup, or pass --force to delete the pool object alone: its blocks and their allocations stay, outside every pool until it is added \
             again with its CIDR"
        )));
    }
    let damage = ipam.delete_undecodable_pool(name).await?;
    let table = format!(
        "Deleted the object of IP pool {name}, which could not be decoded: no address released, \
         no block deleted. Its blocks and their allocations stay, outside every pool (`blockipamctl \
         check` lists them), until the pool is added again with its CIDR and block size.\n"
    );
    let json = UndecodableDeletionJson {
        pool: PoolListed::Damaged {
            name: name.to_owned(),
            error: damage.to_string(),
        },
        released_addresses: 0,
        deleted_blocks: 0,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// What `pool split` prints as JSON.
#[derive(Debug, Serialize)]
struct SplitJson {
    /// The pool that was replaced.
    pool: PoolJson,
    /// The sub-pools, in address order.
    pools: Vec<PoolJson>,
    /// Blocks that now lie in the sub-pools.
    blocks: u64,
    /// Namespaces whose pools setting was rewritten to name the sub-pools.
    namespaces: Vec<String>,
}

/// `pool split`: acts at once, like every pool command (one transaction; see
/// [`Ipam::split_pool`]).
///
/// # Errors
/// [`CtlError::Usage`] for a bad N or a pool that cannot be split that way; unknown pool; a
/// sub-pool name taken; store trouble.
pub async fn split(
    settings: &DatastoreSettings,
    args: &PoolSplitArgs,
) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let split = ipam
        .split_pool(&args.pool, args.parts)
        .await
        .map_err(|e| match e {
            IpamError::InvalidArgument(_) => CtlError::usage(invalid_text(&e)),
            other => other.into(),
        })?;
    let mut table = format!(
        "Split IP pool {} ({}) into {} pools ({}):\n",
        split.pool.name,
        split.pool.cidr,
        split.pools.len(),
        counted(split.blocks, "block stays", "blocks stay")
    );
    table.push_str(&pools_table(&split.pools, &[]));
    if !split.namespaces.is_empty() {
        table.push_str(&format!(
            "Namespace pools settings now naming the sub-pools: {}.\n",
            split.namespaces.join(", ")
        ));
    }
    let json = SplitJson {
        pool: PoolJson::from(&split.pool),
        pools: split.pools.iter().map(PoolJson::from).collect(),
        blocks: split.blocks,
        namespaces: split.namespaces.clone(),
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
