//! `blocks release-empty [--older-than D] [--apply]`: the empty blocks hosts no longer need, and
//! with `--apply` their release (`Ipam::release_empty_blocks`).

use blockipam_store::DatastoreSettings;
use ipam_core::{EmptyBlockFilter, EmptyBlockReason};
use serde::Serialize;

use super::{open_ipam, to_json};
use crate::cli::ReleaseEmptyArgs;
use crate::error::CtlError;
use crate::output::{counted, Outcome, Table};
use crate::settings::OpenMode;

#[derive(Debug, Serialize)]
struct ReleaseEmptyJson {
    /// The clock reading the decisions were made at (unix seconds).
    now: u64,
    older_than_seconds: u64,
    applied: bool,
    blocks: Vec<EmptyBlockJson>,
    /// Block objects that could not be decoded: none is released.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    undecodable: Vec<ipam_core::UndecodableObject>,
}

#[derive(Debug, Serialize)]
struct EmptyBlockJson {
    cidr: String,
    host: Option<String>,
    pool: Option<String>,
    /// Unix seconds; 0 when the block was written by format 3 or earlier, which never recorded it.
    empty_since: u64,
    reason: EmptyBlockReason,
    released: bool,
}

/// Parses `90`, `90s`, `15m`, `2h` or `1d` into seconds.
///
/// # Errors
/// A usage error naming the accepted forms.
pub fn parse_duration_seconds(text: &str) -> Result<u64, CtlError> {
    let text = text.trim();
    let (number, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let multiplier = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => 0,
    };
    match number.parse::<u64>() {
        Ok(n) if multiplier > 0 => n
            .checked_mul(multiplier)
            .ok_or_else(|| CtlError::usage(format!("duration {text:?} is too long"))),
        _ => Err(CtlError::usage(format!(
            "duration {text:?}: expected seconds, or a number with s, m, h or d (90, 15m, 2h)"
        ))),
    }
}

/// `blocks release-empty`.
///
/// # Errors
/// A bad duration; store trouble.
pub async fn release_empty(
    settings: &DatastoreSettings,
    args: &ReleaseEmptyArgs,
) -> Result<Outcome, CtlError> {
    let older_than = args
        .older_than
        .as_deref()
        .map(parse_duration_seconds)
        .transpose()?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let older_than_seconds = match older_than {
        Some(seconds) => seconds,
        None => u64::from(ipam.get_config().await?.empty_block_reclaim_seconds),
    };
    let now = ipam.now();
    let (found, undecodable) = ipam
        .release_empty_blocks_each(
            EmptyBlockFilter {
                older_than_seconds,
                only_unselected: false,
            },
            args.apply,
        )
        .await?;
    let mut table = Table::new(&["BLOCK", "HOST", "POOL", "EMPTY FOR", "REASON", "ACTION"]);
    for block in &found {
        table.row(vec![
            block.cidr.to_string(),
            block.host.clone().unwrap_or_else(|| "-".into()),
            block.pool.clone().unwrap_or_else(|| "-".into()),
            if block.empty_since == 0 {
                "unknown (older format)".into()
            } else {
                format!("{}s", now.saturating_sub(block.empty_since))
            },
            block.reason.to_string(),
            match (args.apply, block.released) {
                (false, _) => "would release".into(),
                (true, true) => "released".into(),
                (true, false) => "changed meanwhile, left alone".into(),
            },
        ]);
    }
    let released = found.iter().filter(|b| b.released).count() as u64;
    let mut text = if found.is_empty() {
        format!("No empty block to release (empty for at least {older_than_seconds} s).\n")
    } else {
        table.render()
    };
    if args.apply {
        text.push_str(&format!(
            "Released {}.\n",
            counted(released, "empty block", "empty blocks")
        ));
    } else if !found.is_empty() {
        text.push_str("Nothing was written; run again with --apply to release them.\n");
    }
    text.push_str(&super::undecodable_text(
        &undecodable,
        "this pass (none is released)",
    ));
    let json = ReleaseEmptyJson {
        now,
        older_than_seconds,
        applied: args.apply,
        undecodable,
        blocks: found
            .into_iter()
            .map(|b| EmptyBlockJson {
                cidr: b.cidr.to_string(),
                host: b.host,
                pool: b.pool,
                empty_since: b.empty_since,
                reason: b.reason,
                released: b.released,
            })
            .collect(),
    };
    Ok(Outcome::ok(to_json(&json)?, text))
}

/// An empty block released because its pools no longer select its host (`pool set
/// --node-selector`, `node label`), as their JSON output lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReleasedEmptyBlock {
    /// The block.
    pub cidr: String,
    /// The host it belonged to.
    pub host: Option<String>,
}

/// What [`release_unselected_empty_blocks`] released, and its lines for the table output.
#[derive(Debug)]
pub struct UnselectedRelease {
    /// The blocks released.
    pub released: Vec<ReleasedEmptyBlock>,
    /// What the table output says of them (empty when nothing was released or left out).
    pub text: String,
}

/// Releases, at once, the empty blocks of nodes that their pools no longer select: what `pool set
/// --node-selector` and `node label` do after their change. Returns a line for the table output
/// naming them (empty when none).
///
/// # Errors
/// Store trouble.
pub async fn release_unselected_empty_blocks(
    ipam: &ipam_core::Ipam,
) -> Result<UnselectedRelease, CtlError> {
    let (found, undecodable) = ipam
        .release_empty_blocks_each(
            EmptyBlockFilter {
                older_than_seconds: 0,
                only_unselected: true,
            },
            true,
        )
        .await?;
    let released: Vec<ReleasedEmptyBlock> = found
        .into_iter()
        .filter(|b| b.released)
        .map(|b| ReleasedEmptyBlock {
            cidr: b.cidr.to_string(),
            host: b.host,
        })
        .collect();
    let mut text = if released.is_empty() {
        String::new()
    } else {
        format!(
            "Released {} of nodes their pools no longer select: {}.\n",
            counted(released.len() as u64, "empty block", "empty blocks"),
            released
                .iter()
                .map(|b| format!("{} ({})", b.cidr, b.host.as_deref().unwrap_or("-")))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    text.push_str(&super::undecodable_text(
        &undecodable,
        "the release of empty blocks (none is released)",
    ));
    Ok(UnselectedRelease { released, text })
}

#[cfg(test)]
mod tests {
    use super::parse_duration_seconds;

    #[test]
    fn durations_parse_with_and_without_units() {
        assert_eq!(parse_duration_seconds("90").expect("plain"), 90);
        assert_eq!(parse_duration_seconds("90s").expect("s"), 90);
        assert_eq!(parse_duration_seconds("15m").expect("m"), 900);
        assert_eq!(parse_duration_seconds("2h").expect("h"), 7200);
        assert_eq!(parse_duration_seconds("1d").expect("d"), 86_400);
        for bad in ["", "m", "5x", "-5", "1.5h", "99999999999999999999d"] {
            assert!(parse_duration_seconds(bad).is_err(), "{bad:?} accepted");
        }
    }
}
