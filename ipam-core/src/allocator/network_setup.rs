//! What a caller's network needs to exist before its addresses are handed out (pools, and the
//! gateway reservations held by a handle), checked inside auto-assign's one batched read.
//!
//! The CNI plugin describes its network once per call: the pools its netconf lists, and the
//! gateways whose addresses (with their pool's network and broadcast addresses) must never go to
//! a container. Checking that on every call used to cost a pool listing and a read of the
//! reservation handle and its blocks. Now auto-assign reads, in the same batch as everything
//! else, the pools, the reservation handle and a small *confirmation* record, and compares them in
//! memory: when all is in place (the steady state) nothing more is read. When something is missing
//! nothing is written, and auto-assign sets the network up ([`Ipam::prepare_network`]: creating
//! pools, reserving addresses, then [`Ipam::confirm_reservations`]) and tries again: the caller
//! makes one call either way.
//!
//! The confirmation record (`ipam/v1/reservations-held/<handle>`) says "at the handle's revision
//! R, the handle held exactly these addresses". It was verified against the blocks when written,
//! and every change to what a handle holds rewrites the handle (a new revision), so a record
//! whose R is the handle's current revision is still exact; any other record is stale and simply
//! sends the call down the set-up path again.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::allocator::dead_nodes::RESERVATION_NODE;
use crate::allocator::{
    raising_pool_generation, AssignIpsRequest, Ipam, PoolSpec, Stored, ATTR_NETWORK, ATTR_PURPOSE,
};
use crate::kv::{Condition, KeyValue, Op, Read, ReadResult, Revision, Txn};
use crate::model::error::IpamError;
use crate::model::{keys, Family, Pool};

/// What a caller's network needs in place; given to auto-assign in
/// [`AutoAssignRequest::setup`](crate::allocator::AutoAssignRequest::setup).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworkSetup {
    /// The network's name, recorded on its reservations (`network` attribute).
    pub network: String,
    /// Pools that must exist: one with the same CIDR and block size (whatever its name).
    pub pools: Vec<PoolSpec>,
    /// Gateways of the network: each one inside an enabled pool is reserved, with that pool's
    /// network and (IPv4) broadcast address ([`reserved_addresses`]); and an auto-assigned
    /// address skips block edges exactly when [`block_prefix_reportable`] says so.
    pub gateways: Vec<IpAddr>,
    /// The handle the reservations are held by.
    pub reservation_handle: String,
}

/// The addresses a network with these `gateways` reserves among `pools`: each gateway that lies in
/// an enabled pool and, because the result then reports that pool's prefix, the pool's network
/// address and (IPv4, shorter than /31) broadcast address. In order, without repeats. Gateways in
/// no enabled pool reserve nothing (see [`gateways_outside_pools`]).
pub fn reserved_addresses(pools: &[Pool], gateways: &[IpAddr]) -> Vec<IpAddr> {
    let mut reserved = Vec::new();
    for gateway in gateways {
        let Some(pool) = pools
            .iter()
            .find(|p| !p.disabled && p.cidr.contains(gateway))
        else {
            continue;
        };
        reserved.push(*gateway);
        reserved.push(pool.cidr.network());
        if let IpNet::V4(net) = pool.cidr {
            if net.prefix_len() < 31 {
                reserved.push(IpAddr::V4(net.broadcast()));
            }
        }
    }
    let mut seen = BTreeSet::new();
    reserved.retain(|ip| seen.insert(*ip));
    reserved
}

/// The gateways that lie in no enabled pool (neither reserved nor reported).
pub fn gateways_outside_pools(pools: &[Pool], gateways: &[IpAddr]) -> Vec<IpAddr> {
    gateways
        .iter()
        .filter(|g| !pools.iter().any(|p| !p.disabled && p.cidr.contains(*g)))
        .copied()
        .collect()
}

/// True when an automatically assigned address may be reported with its block's prefix: a
/// candidate pool (enabled, of a wanted family, among `named` when that is not empty) holds no
/// gateway. The allocator must then never hand out a block's network or last address.
pub fn block_prefix_reportable(
    pools: &[Pool],
    wanted: &[(Family, bool, &[String])],
    gateways: &[IpAddr],
) -> bool {
    wanted
        .iter()
        .filter(|(_, wanted, _)| *wanted)
        .any(|(family, _, named)| {
            pools
                .iter()
                .filter(|p| p.family() == *family && !p.disabled)
                .filter(|p| {
                    named.is_empty()
                        || named
                            .iter()
                            .any(|n| *n == p.name || n.parse::<IpNet>().ok() == Some(p.cidr))
                })
                .any(|p| !gateways.iter().any(|g| p.cidr.contains(g)))
        })
}

/// The confirmation record: at `handle_revision`, the handle held exactly `held`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ReservationsHeld {
    handle_revision: u64,
    held: Vec<IpAddr>,
}

/// True when `setup`'s pools exist among `pools`, and every address it reserves is held by its
/// reservation handle according to a confirmation record (`confirmation`) that is current for the
/// handle as read in the same snapshot (`handle_revision`).
pub(crate) fn setup_in_place(
    setup: &NetworkSetup,
    pools: &[Stored<Pool>],
    handle_revision: Option<Revision>,
    confirmation: Option<&KeyValue>,
) -> Result<bool, IpamError> {
    for spec in &setup.pools {
        let wanted = Ipam::pool_from_spec(spec)?;
        if !pools
            .iter()
            .any(|p| p.value.cidr == wanted.cidr && p.value.block_size == wanted.block_size)
        {
            return Ok(false);
        }
    }
    let listed: Vec<Pool> = pools.iter().map(|p| p.value.clone()).collect();
    let wanted = reserved_addresses(&listed, &setup.gateways);
    if wanted.is_empty() {
        return Ok(true);
    }
    let (Some(revision), Some(kv)) = (handle_revision, confirmation) else {
        return Ok(false);
    };
    // The record only saves reads: one that does not decode (damaged, or written by a newer
    // build) counts as stale, and the set-up path writes it again.
    let Ok(record) = serde_json::from_slice::<ReservationsHeld>(&kv.value) else {
        return Ok(false);
    };
    if record.handle_revision != revision.get() {
        return Ok(false);
    }
    let held: BTreeSet<IpAddr> = record.held.into_iter().collect();
    Ok(wanted.iter().all(|ip| held.contains(ip)))
}

impl Ipam {
    /// Sets up what `setup` needs before its addresses are handed out, for a network's first call
    /// and whenever something went missing: creates the pools that do not exist yet (a pool with
    /// the same CIDR and block size counts, whatever its name), reserves the network's addresses
    /// ([`reserved_addresses`]) for the reservations' pseudo-node, held by
    /// `setup.reservation_handle`, and confirms them, so that the next calls find it all in place
    /// in auto-assign's one read. Returns the store's pools. A reservation that cannot be made or
    /// confirmed is logged and tried again at the next call (it never fails the call); an
    /// address a container holds is left to it, and one in IP cooldown is left to cool, each with
    /// a warning, the network's other addresses reserved all the same.
    ///
    /// # Errors
    /// A pool that clashes with a different existing one; store failures.
    pub async fn prepare_network(&self, setup: &NetworkSetup) -> Result<Vec<Pool>, IpamError> {
        Ok(self.prepare_network_reporting(setup).await?.0)
    }

    /// [`Ipam::prepare_network`], also saying whether the network's reservations were made (the
    /// addresses a container or the IP cooldown holds left aside, as there): `false` when they
    /// could not be, and the caller should pass over [`reserved_addresses`] itself.
    ///
    /// # Errors
    /// As [`Ipam::prepare_network`].
    pub async fn prepare_network_reporting(
        &self,
        setup: &NetworkSetup,
    ) -> Result<(Vec<Pool>, bool), IpamError> {
        let pools = self.ensure_network_pools(&setup.pools).await?;
        if let Err(e) = self.reserve_network_addresses(setup, &pools).await {
            tracing::warn!(network = %setup.network, "the network's reservations could not be made ({e}); going on without handing them out, they are tried again at the next ADD");
            return Ok((pools, false));
        }
        if !setup.gateways.is_empty() {
            if let Err(e) = self.confirm_reservations(&setup.reservation_handle).await {
                tracing::warn!(network = %setup.network, "the network's reservations could not be confirmed ({e}); the next ADD checks them again");
            }
        }
        Ok((pools, true))
    }

    /// The store's pools, after creating those of `specs` that do not exist yet: one read when
    /// they all exist.
    async fn ensure_network_pools(&self, specs: &[PoolSpec]) -> Result<Vec<Pool>, IpamError> {
        let pools = self.list_pools().await?;
        let mut created = false;
        for spec in specs {
            let present = pools.iter().any(|p| {
                p.cidr == spec.cidr
                    && Some(p.block_size) == Ipam::pool_from_spec(spec).ok().map(|s| s.block_size)
            });
            if !present {
                let pool = self.ensure_pool(spec).await?;
                tracing::info!(pool = %pool.name, cidr = %pool.cidr, "pool present");
                created = true;
            }
        }
        if created {
            return self.list_pools().await;
        }
        Ok(pools)
    }

    /// Reserves the network's addresses among `pools` that its handle does not hold yet; when it
    /// holds them all this is one read.
    async fn reserve_network_addresses(
        &self,
        setup: &NetworkSetup,
        pools: &[Pool],
    ) -> Result<(), IpamError> {
        for gateway in gateways_outside_pools(pools, &setup.gateways) {
            tracing::warn!(%gateway, "the gateway lies in no enabled pool: it is neither reserved nor reported");
        }
        let wanted = reserved_addresses(pools, &setup.gateways);
        if wanted.is_empty() {
            return Ok(());
        }
        let handle = &setup.reservation_handle;
        let held: BTreeSet<IpAddr> = self
            .ips_by_handle(handle)
            .await?
            .into_iter()
            .map(|a| a.ip)
            .collect();
        for ip in wanted.into_iter().filter(|ip| !held.contains(ip)) {
            let request = AssignIpsRequest {
                ips: vec![ip],
                handle: handle.clone(),
                host: RESERVATION_NODE.to_owned(),
                attributes: BTreeMap::from([
                    (ATTR_NETWORK.to_owned(), setup.network.clone()),
                    (ATTR_PURPOSE.to_owned(), "gateway".to_owned()),
                ]),
                ignore_strict_affinity: true,
                purpose: None,
            };
            match self.assign_ips(&request).await {
                Ok(_) => tracing::info!(%ip, %handle, "reserved"),
                Err(IpamError::AlreadyAssigned { ip, handle }) => {
                    tracing::warn!(%ip, %handle, "an address the network reserves is held by a container; it is reserved once that container releases it");
                }
                // Released lately: no one may take it before its cooldown ends, the network's
                // reservation neither. The addresses after it are reserved all the same; this
                // one is reserved by the first call after `cools_at`.
                Err(IpamError::AddressCooling { ip, cools_at, .. }) => {
                    tracing::warn!(%ip, cools_at, "an address the network reserves is in IP cooldown; it is reserved once it has cooled");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Records which addresses `handle_id` holds now (see the module documentation), so that
    /// auto-assign can tell in memory that a network's reservations are in place. Reads the handle
    /// and its blocks, then writes the record on the condition that the handle has not changed
    /// since; when it has, nothing is written (the next call confirms again). A record already
    /// current is left as it is; an unknown handle deletes any record (on the condition that the
    /// handle is still unknown and the record as read). Either write raises the pool generation
    /// (an ADD decides from the record), conditioned on it as read: a write it loses to is not
    /// an error, the next call confirms again.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn confirm_reservations(&self, handle_id: &str) -> Result<(), IpamError> {
        let key = keys::handle(handle_id);
        let record_key = keys::reservations_held(handle_id);
        let mut results = self
            .store()
            .read_many(&[
                Read::Get(keys::pool_generation()),
                Read::Get(key.clone()),
                Read::Get(record_key.clone()),
            ])
            .await?
            .into_iter();
        let generation = results
            .next()
            .map(ReadResult::into_got)
            .transpose()?
            .flatten();
        let handle_kv = results
            .next()
            .map(ReadResult::into_got)
            .transpose()?
            .flatten();
        let record_kv = results
            .next()
            .map(ReadResult::into_got)
            .transpose()?
            .flatten();
        let (_, revision) = Self::decode_handle(handle_kv)?;
        let Some(revision) = revision else {
            if let Some(record) = record_kv {
                let txn = Txn::new()
                    .when(Condition::absent(&key))
                    .when(Condition::at_revision(&record_key, record.revision))
                    .then(Op::delete(&record_key));
                self.commit_confirmation(raising_pool_generation(txn, generation)?)
                    .await?;
            }
            return Ok(());
        };
        let current = record_kv
            .and_then(|kv| serde_json::from_slice::<ReservationsHeld>(&kv.value).ok())
            .is_some_and(|r| r.handle_revision == revision.get());
        if current {
            // Confirmed at this very revision already: nothing to write.
            return Ok(());
        }
        let held: Vec<IpAddr> = self
            .allocations_by_handle(handle_id)
            .await?
            .into_iter()
            .map(|info| info.ip)
            .collect();
        let record = ReservationsHeld {
            handle_revision: revision.get(),
            held,
        };
        let value = serde_json::to_vec(&record)
            .map_err(|e| IpamError::Internal(format!("cannot encode a confirmation: {e}")))?;
        let txn = Txn::new()
            .when(Condition::at_revision(&key, revision))
            .then(Op::put(&record_key, value));
        self.commit_confirmation(raising_pool_generation(txn, generation)?)
            .await
    }

    /// Commits a write of a confirmation record; one refused on its conditions is left to the
    /// next call.
    async fn commit_confirmation(&self, txn: Txn) -> Result<(), IpamError> {
        match self.store().commit(txn).await {
            Ok(_) | Err(crate::kv::KvError::Conflict { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str, cidr: &str, disabled: bool) -> Pool {
        Pool {
            name: name.into(),
            cidr: cidr.parse().expect("cidr"),
            block_size: 26,
            disabled,
            ..Pool::default()
        }
    }

    /// A family, whether it is wanted, and the pools named for it (none: any).
    type WantedFamily<'a> = (Family, bool, &'a [String]);

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|ip| ip.parse().expect("address")).collect()
    }

    /// An IPv4 pool, an IPv6 pool, a disabled pool and a /31.
    fn pools() -> Vec<Pool> {
        vec![
            pool("v4", "10.1.0.0/24", false),
            pool("v6", "fd00::/120", false),
            pool("off", "10.2.0.0/24", true),
            pool("pair", "10.3.0.0/31", false),
        ]
    }

    #[test]
    fn each_gateway_in_an_enabled_pool_reserves_itself_its_network_and_ipv4_broadcast_once() {
        let gateways = ips(&[
            "10.1.0.1",
            "fd00::1",
            "10.2.0.1",
            "192.168.0.1",
            "10.1.0.254",
            "10.3.0.0",
        ]);
        assert_eq!(
            reserved_addresses(&pools(), &gateways),
            ips(&[
                "10.1.0.1",
                "10.1.0.0",
                "10.1.0.255",
                "fd00::1",
                "fd00::",
                "10.1.0.254",
                // A /31 has no broadcast address: its other address stays usable.
                "10.3.0.0",
            ])
        );
        assert_eq!(reserved_addresses(&pools(), &[]), Vec::<IpAddr>::new());
    }

    #[test]
    fn gateways_outside_pools_are_those_in_no_enabled_pool() {
        let gateways = ips(&["10.1.0.1", "10.2.0.1", "192.168.0.1", "fd00::1"]);
        assert_eq!(
            gateways_outside_pools(&pools(), &gateways),
            ips(&["10.2.0.1", "192.168.0.1"])
        );
    }

    #[test]
    fn the_block_prefix_is_reportable_when_a_candidate_pool_of_a_wanted_family_holds_no_gateway() {
        let pools = vec![
            pool("gw", "10.1.0.0/24", false),
            pool("plain", "10.4.0.0/24", false),
            pool("off", "10.5.0.0/24", true),
            pool("v6", "fd00::/120", false),
        ];
        let gateways = ips(&["10.1.0.1"]);
        let names = |list: &[&str]| list.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let (none, gw, plain_by_cidr, gw_and_off, gw_by_cidr) = (
            names(&[]),
            names(&["gw"]),
            names(&["10.4.0.0/24"]),
            names(&["gw", "off"]),
            names(&["10.1.0.0/24"]),
        );
        let cases: Vec<(Vec<WantedFamily>, bool)> = vec![
            // Any IPv4 pool may serve, and one holds no gateway.
            (vec![(Family::V4, true, &none)], true),
            // Only the pool holding the gateway, by name or by CIDR.
            (vec![(Family::V4, true, &gw)], false),
            (vec![(Family::V4, true, &gw_by_cidr)], false),
            // The pool without a gateway, named by its CIDR.
            (vec![(Family::V4, true, &plain_by_cidr)], true),
            // A disabled pool without a gateway is no candidate.
            (vec![(Family::V4, true, &gw_and_off)], false),
            // A family not wanted counts for nothing; a wanted one without gateways decides.
            (vec![(Family::V4, false, &none)], false),
            (
                vec![(Family::V4, true, &gw), (Family::V6, false, &none)],
                false,
            ),
            (
                vec![(Family::V4, true, &gw), (Family::V6, true, &none)],
                true,
            ),
            // IPv6 asked for, the gateway-free IPv4 pool does not count.
            (vec![(Family::V6, true, &gw)], false),
        ];
        for (wanted, reportable) in cases {
            assert_eq!(
                block_prefix_reportable(&pools, &wanted, &gateways),
                reportable,
                "{wanted:?}"
            );
        }
    }
}
