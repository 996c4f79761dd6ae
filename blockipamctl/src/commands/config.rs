//! `config show|set`: the IPAM-wide settings (strict affinity, automatic blocks, per-host block
//! limit, IP cooldown, empty-block reclaim age).

use blockipam_store::DatastoreSettings;
use ipam_core::IpamConfig;
use serde::Serialize;

use super::{open_ipam, to_json};
use crate::cli::ConfigSetArgs;
use crate::error::CtlError;
use crate::output::{Outcome, Table};
use crate::settings::OpenMode;

/// The configuration as JSON: `{strict_affinity, auto_allocate_blocks, max_blocks_per_host,
/// ip_cooldown_seconds, empty_block_reclaim_seconds}`.
#[derive(Debug, Serialize)]
struct ConfigJson {
    strict_affinity: bool,
    auto_allocate_blocks: bool,
    max_blocks_per_host: u32,
    ip_cooldown_seconds: u32,
    empty_block_reclaim_seconds: u32,
}

fn render(config: &IpamConfig, heading: Option<&str>) -> Result<Outcome, CtlError> {
    let json = ConfigJson {
        strict_affinity: config.strict_affinity,
        auto_allocate_blocks: config.auto_allocate_blocks,
        max_blocks_per_host: config.max_blocks_per_host,
        ip_cooldown_seconds: config.ip_cooldown_seconds,
        empty_block_reclaim_seconds: config.empty_block_reclaim_seconds,
    };
    let mut table = Table::new(&["SETTING", "VALUE"]);
    table.row(vec![
        "strict_affinity".into(),
        config.strict_affinity.to_string(),
    ]);
    table.row(vec![
        "auto_allocate_blocks".into(),
        config.auto_allocate_blocks.to_string(),
    ]);
    table.row(vec![
        "max_blocks_per_host".into(),
        if config.max_blocks_per_host == 0 {
            "0 (unlimited)".to_owned()
        } else {
            config.max_blocks_per_host.to_string()
        },
    ]);
    table.row(vec![
        "ip_cooldown_seconds".into(),
        if config.ip_cooldown_seconds == 0 {
            "0 (released addresses are reused at once)".to_owned()
        } else {
            config.ip_cooldown_seconds.to_string()
        },
    ]);
    table.row(vec![
        "empty_block_reclaim_seconds".into(),
        config.empty_block_reclaim_seconds.to_string(),
    ]);
    let mut text = heading.map(|h| format!("{h}\n")).unwrap_or_default();
    text.push_str(&table.render());
    Ok(Outcome::ok(to_json(&json)?, text))
}

/// `config show`.
///
/// # Errors
/// Store trouble.
pub async fn show(settings: &DatastoreSettings) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    render(&ipam.get_config().await?, None)
}

/// `config set`: changes the given settings, keeps the others.
///
/// # Errors
/// Store trouble, including a missing embedded store: `config set` does not create one (`pool
/// add` does).
pub async fn set(settings: &DatastoreSettings, args: &ConfigSetArgs) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    // Compare-and-swap: a concurrent `config set` of another field is kept, not overwritten.
    let config = ipam
        .update_config(|config| {
            if let Some(value) = args.strict_affinity {
                config.strict_affinity = value;
            }
            if let Some(value) = args.auto_allocate_blocks {
                config.auto_allocate_blocks = value;
            }
            if let Some(value) = args.max_blocks_per_host {
                config.max_blocks_per_host = value;
            }
            if let Some(value) = args.ip_cooldown_seconds {
                config.ip_cooldown_seconds = value;
            }
            if let Some(value) = args.empty_block_reclaim_seconds {
                config.empty_block_reclaim_seconds = value;
            }
        })
        .await?;
    render(&config, Some("IPAM configuration updated:"))
}
