//! The commands: each opens the selected store, does its work through the allocator, and returns
//! an [`Outcome`] (JSON document plus table text); the JSON shapes shared by several live here.

pub mod blocks;
pub mod check;
pub mod config;
pub mod gc;
pub mod import;
pub mod install_cni;
mod leaks;
pub mod migrate;
pub mod namespace;
pub mod node;
pub mod node_inventory;
pub mod pool;
pub mod release;
pub mod report;
pub mod reservation;
pub mod show;
#[cfg(test)]
mod test_support;
pub mod tunnel;
pub mod upgrade;

use blockipam_store::DatastoreSettings;
use ipam_core::model::Family;
use ipam_core::{Ipam, Pool};
use serde::Serialize;

use crate::cli::{
    Cli, Command, ConfigCommand, NamespaceCommand, NodeCommand, PoolCommand, TunnelAddressCommand,
};
use crate::error::CtlError;
use crate::output::{Ctx, Outcome};
use crate::settings::{self, Env, OpenMode};

/// Runs the parsed command line.
///
/// # Errors
/// Whatever the command fails with.
pub async fn dispatch(ctx: &mut Ctx<'_>, cli: &Cli, env: &Env) -> Result<Outcome, CtlError> {
    if let Command::Demo(args) = &cli.command {
        let lock_wait = settings::lock_wait(&cli.global, env)?;
        return crate::demo::run(ctx, args, env, lock_wait).await;
    }
    if let Command::InstallCni(args) = &cli.command {
        return install_cni::run(&cli.global, args, env);
    }
    let store = settings::resolve(&cli.global, env)?;
    match &cli.command {
        Command::Pool(PoolCommand::Add(args)) => pool::add(&store, args).await,
        Command::Pool(PoolCommand::List) => pool::list(&store).await,
        Command::Pool(PoolCommand::Enable(args)) => {
            pool::set_disabled(&store, &args.pool, false).await
        }
        Command::Pool(PoolCommand::Disable(args)) => {
            pool::set_disabled(&store, &args.pool, true).await
        }
        Command::Pool(PoolCommand::Delete(args)) => pool::delete(&store, args).await,
        Command::Pool(PoolCommand::Set(args)) => pool::set(&store, args).await,
        Command::Pool(PoolCommand::Split(args)) => pool::split(&store, args).await,
        Command::Namespace(NamespaceCommand::Pools(args)) => namespace::pools(&store, args).await,
        Command::Reservation(crate::cli::ReservationCommand::Add(args)) => {
            reservation::add(&store, args).await
        }
        Command::Reservation(crate::cli::ReservationCommand::List) => {
            reservation::list(&store).await
        }
        Command::Reservation(crate::cli::ReservationCommand::Delete(args)) => {
            reservation::delete(&store, args).await
        }
        Command::TunnelAddress(TunnelAddressCommand::Assign(args)) => {
            tunnel::assign(&store, args).await
        }
        Command::TunnelAddress(TunnelAddressCommand::Release(args)) => {
            tunnel::release(&store, args).await
        }
        Command::Config(ConfigCommand::Show) => config::show(&store).await,
        Command::Config(ConfigCommand::Set(args)) => config::set(&store, args).await,
        Command::Show(args) => show::run(ctx, &store, args).await,
        Command::Release(args) => release::run(&store, args).await,
        Command::Check(args) => check::run(ctx, &store, args).await,
        Command::Node(NodeCommand::List) => node_inventory::list(ctx, &store).await,
        Command::Node(NodeCommand::Retire(args)) => node_inventory::retire(ctx, &store, args).await,
        Command::Node(NodeCommand::Release(args)) => node::release(ctx, &store, args).await,
        Command::Node(NodeCommand::Label(args)) => node::label(&store, args).await,
        Command::Node(NodeCommand::Show(args)) => node::show(&store, args).await,
        Command::Blocks(crate::cli::BlocksCommand::ReleaseEmpty(args)) => {
            blocks::release_empty(&store, args).await
        }
        Command::Gc(args) => gc::run(ctx, &store, args).await,
        Command::Upgrade(crate::cli::UpgradeCommand::Status) => upgrade::status(&store).await,
        Command::Upgrade(crate::cli::UpgradeCommand::Finalize(args)) => {
            upgrade::finalize(&store, args).await
        }
        Command::Migrate(args) => {
            let etcd_request_timeout = settings::etcd_request_timeout(&cli.global, env)?;
            migrate::run(ctx, &store, args, env, etcd_request_timeout).await
        }
        Command::Import(crate::cli::ImportCommand::Calico(args)) => {
            let etcd_request_timeout = settings::etcd_request_timeout(&cli.global, env)?;
            import::calico(ctx, &store, args, env, etcd_request_timeout).await
        }
        Command::Demo(_) | Command::InstallCni(_) => Err(CtlError::failed(
            "internal error: a command that opens no store was dispatched to one",
        )),
    }
}

/// Opens the store and wraps it in an allocator.
pub(crate) async fn open_ipam(
    settings: &DatastoreSettings,
    mode: OpenMode,
) -> Result<Ipam, CtlError> {
    Ok(Ipam::new(settings::open(settings, mode).await?))
}

/// `ipv4` or `ipv6`.
pub(crate) fn family_name(family: Family) -> &'static str {
    match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

/// A pool as JSON: `{name, cidr, block_size, disabled, family, capacity}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolJson {
    /// The pool's name.
    pub name: String,
    /// Its network.
    pub cidr: String,
    /// Prefix length of its blocks.
    pub block_size: u8,
    /// Whether it is disabled.
    pub disabled: bool,
    /// `ipv4` or `ipv6`.
    pub family: &'static str,
    /// Addresses it spans.
    pub capacity: u128,
    /// The nodes that auto-assign from it (Calico selector syntax, canonical form).
    pub node_selector: String,
    /// `automatic` or `manual`.
    pub assignment_mode: String,
    /// What its addresses may be used for.
    pub allowed_uses: Vec<String>,
}

impl From<&Pool> for PoolJson {
    fn from(pool: &Pool) -> Self {
        PoolJson {
            name: pool.name.clone(),
            cidr: pool.cidr.to_string(),
            block_size: pool.block_size,
            disabled: pool.disabled,
            family: family_name(pool.family()),
            capacity: pool.capacity(),
            node_selector: pool.node_selector.to_string(),
            assignment_mode: pool.assignment_mode.to_string(),
            allowed_uses: pool.allowed_uses.iter().map(|u| u.to_string()).collect(),
        }
    }
}

/// `enabled` / `disabled`.
pub(crate) fn state(pool: &Pool) -> &'static str {
    if pool.disabled {
        "disabled"
    } else {
        "enabled"
    }
}

/// Addresses in one block of `pool`.
pub(crate) fn block_capacity(pool: &Pool) -> u128 {
    let bits = match pool.family() {
        Family::V4 => 32u32,
        Family::V6 => 128u32,
    } - u32::from(pool.block_size);
    1u128.checked_shl(bits).unwrap_or(u128::MAX)
}

/// The objects left out of what is shown above because they cannot be decoded, each with what
/// is wrong (empty when none).
pub(crate) fn undecodable_text(
    objects: &[ipam_core::UndecodableObject],
    left_out_of: &str,
) -> String {
    if objects.is_empty() {
        return String::new();
    }
    let mut text = format!(
        "\n{} object(s) cannot be decoded and are left out of {left_out_of} \
         (`blockipamctl check` names the way out of each):\n",
        objects.len()
    );
    for object in objects {
        text.push_str(&format!("  {}: {}\n", object.key, object.message));
    }
    text
}

/// Renders a JSON document for an [`Outcome`].
pub(crate) fn to_json<T: Serialize>(value: &T) -> Result<String, CtlError> {
    serde_json::to_string_pretty(value)
        .map_err(|e| CtlError::failed(format!("internal error: cannot render JSON: {e}")))
}
