//! `show`: pool usage, and optionally every block, borrowed addresses, or who holds one address.

use std::collections::BTreeMap;
use std::net::IpAddr;

use blockipam_store::DatastoreSettings;
use ipam_core::allocator::ATTR_NODE;
use ipam_core::{AllocationInfo, BlockUsage, UndecodableObject, Utilization};
use serde::Serialize;

use super::{open_ipam, state, to_json, undecodable_text};
use crate::cli::ShowArgs;
use crate::error::CtlError;
use crate::output::{human_count, percent, yes_no, Ctx, Outcome, Table};
use crate::settings::OpenMode;

/// One pool's usage as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolUsageJson {
    /// Pool name.
    pub name: String,
    /// Pool network.
    pub cidr: String,
    /// Block prefix length.
    pub block_size: u8,
    /// Whether the pool is disabled.
    pub disabled: bool,
    /// Addresses the pool spans.
    pub capacity: u128,
    /// Addresses allocated.
    pub in_use: u64,
    /// Addresses free: neither allocated nor reserved.
    pub free: u128,
    /// Addresses an IP reservation covers, allocated or not.
    pub reserved: u128,
    /// Released addresses still in IP cooldown: neither free nor in use.
    pub cooling: u64,
    /// Blocks that exist in the pool.
    pub block_count: usize,
}

/// One block's usage as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockJson {
    /// Block network.
    pub cidr: String,
    /// Its pool (null when it lies in none).
    pub pool: Option<String>,
    /// Its affine host (null when none).
    pub host: Option<String>,
    /// Addresses in it.
    pub capacity: u64,
    /// Allocated.
    pub in_use: u64,
    /// Free: neither allocated nor reserved.
    pub free: u64,
    /// Covered by an IP reservation, allocated or not.
    pub reserved: u64,
    /// Released addresses still in IP cooldown: neither free nor in use.
    pub cooling: u64,
}

impl From<&BlockUsage> for BlockJson {
    fn from(block: &BlockUsage) -> Self {
        BlockJson {
            cidr: block.cidr.to_string(),
            pool: block.pool.clone(),
            host: block.host.clone(),
            capacity: block.capacity,
            in_use: block.in_use,
            free: block.free,
            reserved: block.reserved,
            cooling: block.cooling,
        }
    }
}

/// An address used by a node other than its block's host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct BorrowedJson {
    ip: IpAddr,
    block: String,
    block_host: Option<String>,
    node: Option<String>,
    handle: String,
}

#[derive(Debug, Serialize)]
struct ShowJson {
    pools: Vec<PoolUsageJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    blocks: Option<Vec<BlockJson>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    borrowed: Option<Vec<BorrowedJson>>,
    /// Objects left out of the figures because they cannot be decoded (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    undecodable: Vec<UndecodableObject>,
}

#[derive(Debug, Serialize)]
struct IpJson {
    ip: IpAddr,
    allocated: bool,
    handle: Option<String>,
    block: Option<String>,
    block_host: Option<String>,
    pool: Option<String>,
    attributes: Option<BTreeMap<String, String>>,
    sequence: Option<u64>,
    /// While free and in IP cooldown: when it ends (seconds since the Unix epoch).
    cooling_until: Option<u64>,
    /// The reservations that cover it, by name.
    reserved_by: Vec<String>,
    /// Pool and reservation objects `pool` and `reserved_by` leave out because they cannot be
    /// decoded (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    undecodable: Vec<UndecodableObject>,
}

/// Pool usage rows for JSON.
pub fn pools_json(usage: &Utilization) -> Vec<PoolUsageJson> {
    usage
        .pools
        .iter()
        .map(|p| PoolUsageJson {
            name: p.pool.name.clone(),
            cidr: p.pool.cidr.to_string(),
            block_size: p.pool.block_size,
            disabled: p.pool.disabled,
            capacity: p.capacity,
            in_use: p.in_use,
            free: p.free,
            reserved: p.reserved,
            cooling: p.cooling,
            block_count: p.blocks.len(),
        })
        .collect()
}

/// Every block (those in no pool last) for JSON.
pub fn blocks_json(usage: &Utilization) -> Vec<BlockJson> {
    all_blocks(usage).map(BlockJson::from).collect()
}

fn all_blocks(usage: &Utilization) -> impl Iterator<Item = &BlockUsage> {
    usage
        .pools
        .iter()
        .flat_map(|p| p.blocks.iter())
        .chain(usage.orphan_blocks.iter())
}

/// The pool usage table.
pub fn pools_table(usage: &Utilization) -> String {
    if usage.pools.is_empty() {
        let pools_dir = ipam_core::model::keys::pools_dir();
        if usage
            .undecodable
            .iter()
            .any(|o| o.key.starts_with(&pools_dir))
        {
            return "No IP pool that can be decoded.\n".to_owned();
        }
        return "No IP pools. Create one with: blockipamctl pool add <CIDR>\n".to_owned();
    }
    let mut table = Table::new(&[
        "POOL",
        "CIDR",
        "BLOCK SIZE",
        "STATE",
        "ADDRESSES",
        "IN USE",
        "RESERVED",
        "COOLING",
        "FREE",
        "USED",
        "BLOCKS",
    ])
    .right_align(&[4, 5, 6, 7, 8, 9, 10]);
    for p in &usage.pools {
        table.row(vec![
            p.pool.name.clone(),
            p.pool.cidr.to_string(),
            format!("/{}", p.pool.block_size),
            state(&p.pool).to_owned(),
            human_count(p.capacity),
            human_count(u128::from(p.in_use)),
            human_count(p.reserved),
            human_count(u128::from(p.cooling)),
            human_count(p.free),
            percent(u128::from(p.in_use), p.capacity),
            p.blocks.len().to_string(),
        ]);
    }
    table.render()
}

/// The block table.
pub fn blocks_table(usage: &Utilization) -> String {
    let mut table = Table::new(&[
        "BLOCK",
        "POOL",
        "HOST",
        "ADDRESSES",
        "IN USE",
        "RESERVED",
        "COOLING",
        "FREE",
    ])
    .right_align(&[3, 4, 5, 6, 7]);
    for b in all_blocks(usage) {
        table.row(vec![
            b.cidr.to_string(),
            b.pool.clone().unwrap_or_else(|| "(none)".into()),
            b.host.clone().unwrap_or_else(|| "-".into()),
            human_count(u128::from(b.capacity)),
            human_count(u128::from(b.in_use)),
            human_count(u128::from(b.reserved)),
            human_count(u128::from(b.cooling)),
            human_count(u128::from(b.free)),
        ]);
    }
    if table.is_empty() {
        "No blocks: no address has been allocated yet.\n".to_owned()
    } else {
        table.render()
    }
}

fn borrowed(allocations: Vec<AllocationInfo>) -> Vec<BorrowedJson> {
    allocations
        .into_iter()
        .filter_map(|a| {
            let node = a.attributes.get(ATTR_NODE).cloned();
            (node != a.block_host).then(|| BorrowedJson {
                ip: a.ip,
                block: a.block.to_string(),
                block_host: a.block_host,
                node,
                handle: a.handle,
            })
        })
        .collect()
}

fn borrowed_table(rows: &[BorrowedJson]) -> String {
    if rows.is_empty() {
        return "No borrowed addresses: every address is used by its block's host.\n".to_owned();
    }
    let mut table = Table::new(&["IP", "BLOCK", "BLOCK HOST", "NODE", "HANDLE"]);
    for r in rows {
        table.row(vec![
            r.ip.to_string(),
            r.block.clone(),
            r.block_host.clone().unwrap_or_else(|| "-".into()),
            r.node.clone().unwrap_or_else(|| "-".into()),
            r.handle.clone(),
        ]);
    }
    table.render()
}

/// `show [--blocks] [--borrowed] | show --ip IP`.
///
/// # Errors
/// Store trouble.
pub async fn run(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &ShowArgs,
) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    if let Some(ip) = args.ip {
        return show_ip(&ipam, ip).await;
    }
    ctx.progress("reading pools and blocks ...");
    let (usage, borrowed_rows) = if args.borrowed {
        let (usage, allocations) = ipam.utilization_and_allocations().await?;
        (usage, Some(borrowed(allocations)))
    } else {
        (ipam.utilization().await?, None)
    };
    ctx.progress_done();
    let mut text = pools_table(&usage);
    if args.blocks {
        text.push('\n');
        text.push_str(&blocks_table(&usage));
    }
    if let Some(rows) = &borrowed_rows {
        text.push('\n');
        text.push_str(&borrowed_table(rows));
    }
    // An owner key (read with the allocations only) leaves its block's addresses out of the
    // borrowed list; the block itself still counts in the figures.
    let left_out_of = if args.borrowed {
        "what is shown above (for an owner key: its block's addresses, from the borrowed list only)"
    } else {
        "the figures above"
    };
    text.push_str(&undecodable_text(&usage.undecodable, left_out_of));
    let json = ShowJson {
        pools: pools_json(&usage),
        blocks: args.blocks.then(|| blocks_json(&usage)),
        borrowed: borrowed_rows,
        undecodable: usage.undecodable,
    };
    Ok(Outcome::ok(to_json(&json)?, text))
}

async fn show_ip(ipam: &ipam_core::Ipam, ip: IpAddr) -> Result<Outcome, CtlError> {
    let status = ipam.address_status(ip).await?;
    let mut info = status.allocation;
    let pool = status.pool.map(|p| p.name);
    let (block, block_host) = match status.block {
        Some((cidr, host)) => (Some(cidr), host),
        // In no pool: a block left from a deleted pool may still contain it, and hold it.
        None if pool.is_none() => {
            let (usage, allocations) = ipam.utilization_and_allocations().await?;
            info = allocations.into_iter().find(|a| a.ip == ip);
            // As for a block of a pool: who holds the address cannot be told past it.
            if let Some(object) = usage
                .undecodable
                .iter()
                .find(|o| o.covers().is_some_and(|cidr| cidr.contains(&ip)))
            {
                return Err(ipam_core::IpamError::Corrupt {
                    key: object.key.clone(),
                    message: object.message.clone(),
                }
                .into());
            }
            let found = all_blocks(&usage)
                .find(|b| b.cidr.contains(&ip))
                .map(|b| (Some(b.cidr), b.host.clone()));
            found.unwrap_or((None, None))
        }
        None => (None, None),
    };
    let json = IpJson {
        ip,
        allocated: info.is_some(),
        handle: info.as_ref().map(|a| a.handle.clone()),
        block: block.map(|b| b.to_string()),
        block_host: block_host.clone(),
        pool: pool.clone(),
        attributes: info.as_ref().map(|a| a.attributes.clone()),
        sequence: info.as_ref().map(|a| a.sequence),
        cooling_until: status.cooling_until,
        reserved_by: status.reserved_by.clone(),
        undecodable: status.undecodable,
    };
    let mut table = Table::new(&["FIELD", "VALUE"]);
    table.row(vec!["ip".into(), ip.to_string()]);
    table.row(vec!["allocated".into(), yes_no(info.is_some()).into()]);
    table.row(vec![
        "handle".into(),
        json.handle.clone().unwrap_or_else(|| "-".into()),
    ]);
    table.row(vec![
        "block".into(),
        match (&json.block, &block_host) {
            (Some(b), Some(h)) => format!("{b} (host {h})"),
            (Some(b), None) => format!("{b} (no host)"),
            (None, _) => "- (no block holds this address yet)".into(),
        },
    ]);
    let pools_dir = ipam_core::model::keys::pools_dir();
    let in_no_pool = if json
        .undecodable
        .iter()
        .any(|o| o.key.starts_with(&pools_dir))
    {
        "- (in no pool that can be decoded)"
    } else {
        "- (in no pool)"
    };
    table.row(vec![
        "pool".into(),
        pool.unwrap_or_else(|| in_no_pool.into()),
    ]);
    if let Some(until) = status.cooling_until {
        table.row(vec![
            "cooling until".into(),
            format!(
                "{} (IP cooldown: neither auto-assign nor a request naming it gets it before then)",
                ipam_core::model::timestamp::format_unix(until)
            ),
        ]);
    }
    if !status.reserved_by.is_empty() {
        table.row(vec![
            "reserved by".into(),
            format!(
                "{} (auto-assign never hands it out; a request naming it still gets it)",
                status.reserved_by.join(", ")
            ),
        ]);
    }
    if let Some(a) = &info {
        for (key, value) in &a.attributes {
            table.row(vec![format!("attribute {key}"), value.clone()]);
        }
        table.row(vec!["sequence".into(), a.sequence.to_string()]);
    }
    let mut text = table.render();
    text.push_str(&undecodable_text(
        &json.undecodable,
        "its pool and reservations",
    ));
    Ok(Outcome::ok(to_json(&json)?, text))
}
