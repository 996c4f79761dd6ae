//! The mapper: one Calico snapshot → the blockipam pools, config, blocks, handles and sequence
//! floor that hold the same allocations, plus what could not be mapped (reported, never guessed)
//! and what makes the import impossible (refusals: then nothing is written).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;

use ipam_core::allocator::ATTR_NODE;
use ipam_core::model::nodes::{validate_label_key, validate_label_value, MAX_NODE_LABELS};
use ipam_core::model::{
    encode, validate_handle, validate_host, Allocation, Attribute, Block, CoolingAddress, Handle,
    DEFAULT_V4_BLOCK_SIZE, DEFAULT_V6_BLOCK_SIZE, MAX_ATTRIBUTE_BYTES, MAX_IP_COOLDOWN_SECONDS,
    V4_BLOCK_SIZES, V6_BLOCK_SIZES,
};
use ipam_core::reservations::{validate_reservation, validate_reservation_name, Reservation};
use ipam_core::selector::Selector;
use ipam_core::{AllowedUses, Ipam, IpamConfig, IpamError, Pool, PoolPolicy, PoolSpec};
use ipnet::IpNet;
use serde::Serialize;
use serde_json::Value;

use crate::calico::{
    parse_calico_time, CalicoAffinity, CalicoAttribute, CalicoBlock, CalicoPool, CalicoSnapshot,
};

/// Calico's `maxBlocksPerHost` when it is 0 or unset.
pub const CALICO_DEFAULT_MAX_BLOCKS_PER_HOST: u32 = 20;

/// The handle Calico's Windows nodes reserve each of their blocks' first three and last address
/// under (no `node` attribute; Calico counts a block holding only these as empty).
pub const WINDOWS_RESERVED_HANDLE: &str = "windows-reserved-ipam-handle";

/// The handle the Windows-reserved addresses of a block affine to `host` are imported under: one
/// per host, with `host` as their `node` attribute, so that releasing the host's addresses
/// (`blockipamctl node remove`, dead-node reclaim) releases them with its pods and its blocks can
/// be freed. Those of a block affine to nobody keep Calico's handle.
pub fn windows_reserved_handle(host: &str) -> String {
    format!("{WINDOWS_RESERVED_HANDLE}.{host}")
}

/// Whether `handle` is Calico's Windows-reserved handle (compared as Calico compares it).
fn is_windows_reserved(handle: &str) -> bool {
    handle.eq_ignore_ascii_case(WINDOWS_RESERVED_HANDLE)
}

/// Attribute keys Calico itself writes; any other key is carried over and reported.
pub const KNOWN_ATTRIBUTE_KEYS: &[&str] =
    &["node", "pod", "namespace", "timestamp", "type", "service"];

/// Something the Calico datastore holds that blockipam does not represent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotMapped {
    /// The Calico object (`ippool default-ipv4-ippool`, `affinity node-1 10.0.0.0/26`, ...).
    pub object: String,
    /// The field (`spec.ipipMode`), empty when the whole object is meant.
    pub field: String,
    /// The value, as JSON text.
    pub value: String,
    /// What the import did about it.
    pub note: String,
}

/// One Calico allocation as the written store must hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedAllocation {
    /// The address.
    pub ip: IpAddr,
    /// Its handle (Calico's handle id, unchanged).
    pub handle: String,
    /// Calico's secondary attributes.
    pub metadata: BTreeMap<String, String>,
    /// The block sequence number it was allocated at.
    pub sequence: u64,
}

/// The blockipam objects that hold what the Calico datastore held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportPlan {
    /// The etcd revision the Calico objects were read at.
    pub calico_revision: i64,
    /// Pools, sorted by name.
    pub pools: Vec<Pool>,
    /// The IPAM configuration.
    pub config: IpamConfig,
    /// Whether Calico stored a configuration object (else its defaults were used).
    pub config_stored: bool,
    /// Blocks, sorted by CIDR.
    pub blocks: Vec<Block>,
    /// Handles derived from the blocks (the authority), by id.
    pub handles: BTreeMap<String, Handle>,
    /// Above every imported sequence number.
    pub sequence_floor: u64,
    /// Every allocation, for verification.
    pub expected: Vec<ExpectedAllocation>,
    /// What was not mapped, and what was done about it.
    pub not_mapped: Vec<NotMapped>,
    /// IP reservations (Calico's `IPReservation`s), sorted by name.
    pub reservations: Vec<Reservation>,
    /// The labels of each Calico Node that has any, by node name: what pools' node selectors
    /// are evaluated against.
    pub node_labels: BTreeMap<String, BTreeMap<String, String>>,
}

/// The plan, and the reasons (if any) it must not be written.
#[derive(Debug, Clone)]
pub struct Mapping {
    /// What would be written.
    pub plan: ImportPlan,
    /// Why the import must refuse; empty when it may go ahead.
    pub refusals: Vec<String>,
}

/// Counts of a not-mapped field seen on many objects of one kind (block fields, attribute keys),
/// reported once with an example.
#[derive(Default)]
struct Tally(BTreeMap<(String, String, String), (usize, String)>);

impl Tally {
    fn add(&mut self, kind: &str, field: &str, note: &str, value: &Value) {
        let entry = self
            .0
            .entry((kind.to_owned(), field.to_owned(), note.to_owned()))
            .or_insert((0, value.to_string()));
        entry.0 += 1;
    }

    fn report(self, out: &mut Vec<NotMapped>) {
        for ((kind, field, note), (count, example)) in self.0 {
            out.push(NotMapped {
                object: format!("{kind} ({count})"),
                field,
                value: example,
                note,
            });
        }
    }
}

fn is_unset(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Number(n) => n.as_f64() == Some(0.0),
    }
}

/// True when a pool spec field holds Calico's default (nothing is lost by not mapping it).
fn pool_field_is_default(field: &str, value: &Value) -> bool {
    if is_unset(value) {
        return true;
    }
    match field {
        "ipipMode" | "vxlanMode" => value == "Never",
        _ => false,
    }
}

fn pool_field_note(field: &str) -> &'static str {
    match field {
        "namespaceSelector" => "not mapped: blockipam pools serve every namespace",
        "ipipMode" | "vxlanMode" | "natOutgoing" | "disableBGPExport" | "ipip" | "nat-outgoing" => {
            "not mapped: routing and encapsulation are not blockipam's (configure the network plugin)"
        }
        _ => "not mapped: a pool field this import does not know",
    }
}

fn allowed_block_sizes(cidr: &IpNet) -> std::ops::RangeInclusive<u8> {
    match cidr {
        IpNet::V4(_) => V4_BLOCK_SIZES,
        IpNet::V6(_) => V6_BLOCK_SIZES,
    }
}

/// Maps a snapshot. Refusals name every reason the import must not be written.
pub fn map(snapshot: &CalicoSnapshot) -> Mapping {
    let mut refusals: Vec<String> = snapshot.unreadable.clone();
    let mut not_mapped = Vec::new();
    let mut tally = Tally::default();

    let pools = map_pools(snapshot, &mut refusals, &mut not_mapped);
    let (config, config_stored) = map_config(snapshot, &mut refusals, &mut not_mapped);

    // Affinity index: which hosts claim each block, and in which state.
    let mut affinities: BTreeMap<IpNet, Vec<(&str, &CalicoAffinity)>> = BTreeMap::new();
    for (host, cidr, affinity) in &snapshot.affinities {
        if let Err(e) = validate_host(host) {
            refusals.push(format!("affinity of block {cidr}: {e}"));
            continue;
        }
        affinities
            .entry(*cidr)
            .or_default()
            .push((host.as_str(), affinity));
        if !affinity.is_confirmed() {
            let state = if affinity.deleted {
                "deleted".to_owned()
            } else {
                affinity.state_name().to_owned()
            };
            not_mapped.push(NotMapped {
                object: format!("affinity {host} {cidr}"),
                field: "state".into(),
                value: Value::String(state).to_string(),
                note: "not confirmed, so not ownership: the block (if any) is imported without \
                       affinity"
                    .into(),
            });
        }
    }
    let block_cidrs: BTreeSet<IpNet> = snapshot
        .blocks
        .iter()
        .filter(|(_, b)| !b.deleted)
        .map(|(c, _)| *c)
        .collect();
    for (host, cidr, affinity) in &snapshot.affinities {
        if affinity.is_confirmed() && !block_cidrs.contains(cidr) {
            not_mapped.push(NotMapped {
                object: format!("affinity {host} {cidr}"),
                field: String::new(),
                value: String::new(),
                note: "the block does not exist: nothing imported (the host claims a new block \
                       when it needs one)"
                    .into(),
            });
        }
    }

    let mut blocks = Vec::new();
    let mut expected = Vec::new();
    let mut sorted: Vec<&(IpNet, CalicoBlock)> = snapshot.blocks.iter().collect();
    sorted.sort_by_key(|(cidr, _)| *cidr);
    for (key_cidr, calico) in sorted {
        if calico.deleted {
            not_mapped.push(NotMapped {
                object: format!("block {key_cidr}"),
                field: "deleted".into(),
                value: "true".into(),
                note: "marked deleted in Calico: skipped".into(),
            });
            continue;
        }
        let claims = affinities.get(key_cidr).map(Vec::as_slice).unwrap_or(&[]);
        let mut context = BlockContext {
            pools: &pools,
            claims,
            refusals: &mut refusals,
            not_mapped: &mut not_mapped,
            tally: &mut tally,
            expected: &mut expected,
        };
        if let Some(block) = context.map_block(*key_cidr, calico) {
            blocks.push(block);
        }
    }

    let handles = derive_handles(&blocks);
    compare_handles(snapshot, &handles, &mut not_mapped);

    let reservations = map_reservations(snapshot, &mut not_mapped);
    let node_labels = map_node_labels(snapshot, &mut refusals);
    for key in &snapshot.unrecognised {
        not_mapped.push(NotMapped {
            object: key.clone(),
            field: String::new(),
            value: String::new(),
            note: "not an IPAM object this import knows: ignored".into(),
        });
    }
    tally.report(&mut not_mapped);

    let sequence_floor = blocks
        .iter()
        .map(|b| b.sequence)
        .max()
        .map_or(0, |max| max.saturating_add(1));
    Mapping {
        plan: ImportPlan {
            calico_revision: snapshot.revision,
            pools,
            config,
            config_stored,
            blocks,
            handles,
            sequence_floor,
            expected,
            not_mapped,
            reservations,
            node_labels,
        },
        refusals,
    }
}

/// The labels of every Calico Node that has any. A node name or a label blockipam cannot hold is
/// a refusal, not a label dropped: pools select nodes by their labels, and a partial set could
/// send a node's pods to another pool.
fn map_node_labels(
    snapshot: &CalicoSnapshot,
    refusals: &mut Vec<String>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (name, node) in &snapshot.nodes {
        let labels = node.metadata.labels.clone().unwrap_or_default();
        if labels.is_empty() {
            continue;
        }
        let object = format!("node {name:?}");
        let mut problems = Vec::new();
        if let Err(e) = validate_host(name) {
            problems.push(e.to_string());
        }
        if labels.len() > MAX_NODE_LABELS {
            problems.push(format!(
                "it has {} labels, more than the {MAX_NODE_LABELS} blockipam keeps per node",
                labels.len()
            ));
        }
        for (key, value) in &labels {
            if let Err(e) = validate_label_key(key).and_then(|()| validate_label_value(key, value))
            {
                problems.push(e.to_string());
            }
        }
        if problems.is_empty() {
            out.insert(name.clone(), labels);
        } else {
            refusals.extend(problems.into_iter().map(|why| {
                format!(
                    "{object}: {why} (pools' node selectors read every label; fix it in Calico)"
                )
            }));
        }
    }
    out
}

/// Calico's IP reservations as blockipam reservations: a single address becomes a /32 or /128,
/// host bits are cleared as Calico's own filter does (reported), repeats are dropped; a name or
/// an entry blockipam cannot hold is reported and left out.
fn map_reservations(
    snapshot: &CalicoSnapshot,
    not_mapped: &mut Vec<NotMapped>,
) -> Vec<Reservation> {
    let mut reservations = Vec::new();
    for (name, calico) in &snapshot.reservations {
        let object = format!("ipreservation {name}");
        let listed = calico.spec.reserved_cidrs.clone().unwrap_or_default();
        let mut report = |value: String, note: &str| {
            not_mapped.push(NotMapped {
                object: object.clone(),
                field: "spec.reservedCIDRs".into(),
                value,
                note: note.to_owned(),
            });
        };
        if validate_reservation_name(name).is_err() {
            report(
                Value::from(listed).to_string(),
                "not mapped: the name is not a valid blockipam reservation name; free addresses \
                 in these ranges may be handed out",
            );
            continue;
        }
        let mut cidrs: Vec<IpNet> = Vec::new();
        for text in &listed {
            let parsed = text
                .parse::<IpAddr>()
                .map(IpNet::from)
                .or_else(|_| text.parse::<IpNet>());
            match parsed {
                Ok(cidr) => {
                    if cidr.trunc() != cidr {
                        report(
                            Value::from(text.as_str()).to_string(),
                            &format!("host bits cleared: imported as {}", cidr.trunc()),
                        );
                    }
                    if !cidrs.contains(&cidr.trunc()) {
                        cidrs.push(cidr.trunc());
                    }
                }
                Err(_) => report(
                    Value::from(text.as_str()).to_string(),
                    "not mapped: neither an address nor a CIDR; left out of the reservation",
                ),
            }
        }
        let reservation = Reservation {
            name: name.clone(),
            cidrs,
        };
        if let Err(e) = validate_reservation(&reservation) {
            report(
                Value::from(listed).to_string(),
                &format!("not mapped ({e}); free addresses in these ranges may be handed out"),
            );
            continue;
        }
        reservations.push(reservation);
    }
    reservations.sort_by(|a, b| a.name.cmp(&b.name));
    reservations
}

fn map_pools(
    snapshot: &CalicoSnapshot,
    refusals: &mut Vec<String>,
    not_mapped: &mut Vec<NotMapped>,
) -> Vec<Pool> {
    let mut pools: Vec<Pool> = Vec::new();
    for (name, calico) in &snapshot.pools {
        if let Some(pool) = map_pool(name, calico, refusals, not_mapped) {
            pools.push(pool);
        }
    }
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    for (i, a) in pools.iter().enumerate() {
        for b in &pools[i + 1..] {
            if a.cidr.contains(&b.cidr.network()) || b.cidr.contains(&a.cidr.network()) {
                refusals.push(format!(
                    "pools {} ({}) and {} ({}) overlap",
                    a.name, a.cidr, b.name, b.cidr
                ));
            }
        }
    }
    pools
}

fn map_pool(
    name: &str,
    calico: &CalicoPool,
    refusals: &mut Vec<String>,
    not_mapped: &mut Vec<NotMapped>,
) -> Option<Pool> {
    let object = format!("ippool {name}");
    let cidr: IpNet = match calico.spec.cidr.parse() {
        Ok(cidr) => cidr,
        Err(e) => {
            refusals.push(format!(
                "{object}: spec.cidr {:?} is not a CIDR: {e}",
                calico.spec.cidr
            ));
            return None;
        }
    };
    let block_size = match (calico.spec.block_size, cidr) {
        (0, IpNet::V4(_)) => DEFAULT_V4_BLOCK_SIZE,
        (0, IpNet::V6(_)) => DEFAULT_V6_BLOCK_SIZE,
        (size, _) => u8::try_from(size).unwrap_or(u8::MAX),
    };
    let allowed = allowed_block_sizes(&cidr);
    if !allowed.contains(&block_size) {
        refusals.push(format!(
            "{object} ({cidr}) uses /{} blocks: blockipam supports /{} to /{} for this family (at \
             most 512 addresses per block); the pool is unmappable (in Calico, move its addresses to \
             a pool with smaller blocks first)",
            calico.spec.block_size,
            allowed.start(),
            allowed.end()
        ));
        return None;
    }
    // Mapped as they are: the node selector, the assignment mode and the allowed uses.
    let mut policy = PoolPolicy::default();
    for (field, value) in &calico.spec.other {
        if is_unset(value) {
            continue;
        }
        let mapped = match field.as_str() {
            "nodeSelector" => value
                .as_str()
                .ok_or_else(|| "not a string".to_owned())
                .and_then(|text| Selector::parse(text).map_err(|e| e.to_string()))
                .map(|selector| policy.node_selector = selector),
            "assignmentMode" => value
                .as_str()
                .ok_or_else(|| "not a string".to_owned())
                .and_then(|text| text.parse().map_err(|e: IpamError| e.to_string()))
                .map(|mode| policy.assignment_mode = mode),
            "allowedUses" => value
                .as_array()
                .ok_or_else(|| "not a list".to_owned())
                .and_then(|uses| {
                    let names: Vec<&str> = uses.iter().filter_map(Value::as_str).collect();
                    AllowedUses::parse(&names.join(",")).map_err(|e| e.to_string())
                })
                .map(|uses| policy.allowed_uses = uses),
            _ => {
                if !pool_field_is_default(field, value) {
                    not_mapped.push(NotMapped {
                        object: object.clone(),
                        field: format!("spec.{field}"),
                        value: value.to_string(),
                        note: pool_field_note(field).into(),
                    });
                }
                continue;
            }
        };
        if let Err(e) = mapped {
            refusals.push(format!("{object}: spec.{field} {value}: {e}"));
        }
    }
    // The same rules as `blockipamctl pool add`.
    let spec = PoolSpec {
        cidr,
        name: Some(name.to_owned()),
        block_size: Some(block_size),
        disabled: calico.spec.disabled,
    };
    match Ipam::new_pool_from_spec(&spec) {
        Ok(mut pool) => {
            pool.node_selector = policy.node_selector;
            pool.assignment_mode = policy.assignment_mode;
            pool.allowed_uses = policy.allowed_uses;
            Some(pool)
        }
        Err(e) => {
            refusals.push(format!("{object}: {e}"));
            None
        }
    }
}

// Settings blockipam gains later (and Calico lacks) keep their defaults.
#[allow(clippy::needless_update)]
fn map_config(
    snapshot: &CalicoSnapshot,
    refusals: &mut Vec<String>,
    not_mapped: &mut Vec<NotMapped>,
) -> (IpamConfig, bool) {
    let Some(calico) = &snapshot.config else {
        // Calico's defaults when the object is missing.
        return (
            IpamConfig {
                strict_affinity: false,
                auto_allocate_blocks: true,
                max_blocks_per_host: CALICO_DEFAULT_MAX_BLOCKS_PER_HOST,
                ..IpamConfig::default()
            },
            false,
        );
    };
    let max_blocks_per_host = match calico.max_blocks_per_host {
        0 => CALICO_DEFAULT_MAX_BLOCKS_PER_HOST,
        n => u32::try_from(n).unwrap_or_else(|_| {
            refusals.push(format!("IPAM config: maxBlocksPerHost {n} is out of range"));
            CALICO_DEFAULT_MAX_BLOCKS_PER_HOST
        }),
    };
    for (field, value) in &calico.other {
        if !is_unset(value) {
            not_mapped.push(NotMapped {
                object: "ipam config".into(),
                field: field.clone(),
                value: value.to_string(),
                note: "not mapped: blockipam has no such setting".into(),
            });
        }
    }
    let ip_cooldown_seconds = map_ip_cooldown(calico.ip_cooldown_seconds, not_mapped);
    (
        IpamConfig {
            strict_affinity: calico.strict_affinity,
            auto_allocate_blocks: calico.auto_allocate_blocks,
            max_blocks_per_host,
            ip_cooldown_seconds,
            ..IpamConfig::default()
        },
        true,
    )
}

/// Calico's `ipCooldownSeconds` as blockipam's `ip_cooldown_seconds`. Negative means no cooldown
/// in Calico (its check is `ipCooldownSeconds >= 0`): 0, reported. Over 1200 (Calico's API
/// refuses it, only a raw write stores it, but libcalico-go would honour it): clamped to
/// blockipam's 1200 s limit, reported, so such addresses may be reused sooner than Calico would.
fn map_ip_cooldown(seconds: i64, not_mapped: &mut Vec<NotMapped>) -> u32 {
    let mut report = |note: &str| {
        not_mapped.push(NotMapped {
            object: "ipam config".into(),
            field: "ipCooldownSeconds".into(),
            value: seconds.to_string(),
            note: note.to_owned(),
        });
    };
    if seconds < 0 {
        report("negative: Calico applies no cooldown then; imported as 0");
        return 0;
    }
    match u32::try_from(seconds) {
        Ok(seconds) if seconds <= MAX_IP_COOLDOWN_SECONDS => seconds,
        _ => {
            report(&format!(
                "over the {MAX_IP_COOLDOWN_SECONDS} s limit (blockipam's and Calico's API's): \
                 clamped to {MAX_IP_COOLDOWN_SECONDS} s, so a released address may be reused \
                 sooner than Calico would have"
            ));
            MAX_IP_COOLDOWN_SECONDS
        }
    }
}

struct BlockContext<'a> {
    pools: &'a [Pool],
    claims: &'a [(&'a str, &'a CalicoAffinity)],
    refusals: &'a mut Vec<String>,
    not_mapped: &'a mut Vec<NotMapped>,
    tally: &'a mut Tally,
    expected: &'a mut Vec<ExpectedAllocation>,
}

impl BlockContext<'_> {
    fn refuse(&mut self, cidr: &IpNet, why: String) -> Option<Block> {
        self.refusals.push(format!("block {cidr}: {why}"));
        None
    }

    fn map_block(&mut self, key_cidr: IpNet, calico: &CalicoBlock) -> Option<Block> {
        let cidr: IpNet = match calico.cidr.parse::<IpNet>() {
            Ok(cidr) if cidr == key_cidr => cidr,
            Ok(other) => {
                return self.refuse(&key_cidr, format!("its value names CIDR {other}"));
            }
            Err(e) => {
                return self.refuse(&key_cidr, format!("cidr {:?}: {e}", calico.cidr));
            }
        };
        let allocations = calico.allocations.clone().unwrap_or_default();
        let used = allocations.iter().filter(|a| a.is_some()).count();
        let pool = self
            .pools
            .iter()
            .find(|p| p.cidr.contains(&cidr.network()) && p.cidr.prefix_len() <= cidr.prefix_len());
        let Some(pool) = pool else {
            if used == 0 {
                self.not_mapped.push(NotMapped {
                    object: format!("block {cidr}"),
                    field: String::new(),
                    value: String::new(),
                    note: "empty and in no IP pool: skipped".into(),
                });
                return None;
            }
            return self.refuse(
                &cidr,
                format!(
                    "{used} addresses in use or cooling, but the block lies in no IP pool: \
                     recreate its pool or release those addresses in Calico first"
                ),
            );
        };
        if !allowed_block_sizes(&cidr).contains(&cidr.prefix_len()) {
            return self.refuse(
                &cidr,
                format!(
                    "blockipam blocks hold at most 512 addresses (IPv4 /23, IPv6 /119); this one is \
                     /{}",
                    cidr.prefix_len()
                ),
            );
        }
        if pool.block_size != cidr.prefix_len() {
            return self.refuse(
                &cidr,
                format!(
                    "it is /{} but its pool {} uses /{} blocks (the block size changed after it \
                     was claimed); blockipam needs every block of a pool at the pool's size",
                    cidr.prefix_len(),
                    pool.name,
                    pool.block_size
                ),
            );
        }
        let mut block = Block::new(cidr, None, 0);
        let capacity = block.capacity();
        if allocations.len() != capacity as usize {
            return self.refuse(
                &cidr,
                format!(
                    "allocations has {} entries for {capacity} addresses",
                    allocations.len()
                ),
            );
        }
        block.affinity = self.affinity(&cidr, calico);

        for (field, value) in &calico.other {
            if !is_unset(value) {
                self.tally.add(
                    "blocks",
                    field,
                    "not mapped: a block field blockipam does not keep",
                    value,
                );
            }
        }

        let calico_attributes = calico.attributes.clone().unwrap_or_default();
        let sequences = calico
            .sequence_number_for_allocation
            .clone()
            .unwrap_or_default();
        let mut attribute_index: BTreeMap<usize, u32> = BTreeMap::new();
        let mut max_sequence = calico.sequence_number;
        let mut cooling: Vec<CoolingAddress> = Vec::new();
        for (ordinal, slot) in allocations.iter().enumerate() {
            let Some(index) = slot else { continue };
            let ordinal = ordinal as u32;
            let ip = block.ip_of(ordinal);
            let Some(attribute) = usize::try_from(*index)
                .ok()
                .and_then(|i| calico_attributes.get(i).map(|a| (i, a)))
            else {
                return self.refuse(
                    &cidr,
                    format!("{ip} refers to attribute {index}, which does not exist"),
                );
            };
            let (calico_index, calico_attribute) = attribute;
            if let Some(released_at) = &calico_attribute.released_at {
                // Released into IP cooldown: neither free nor in use; Calico frees it once
                // `releasedAt` is `ipCooldownSeconds` old, and so does blockipam's next write.
                match parse_calico_time(released_at) {
                    Ok(released_at) => cooling.push(CoolingAddress {
                        ordinal,
                        released_at,
                    }),
                    Err(e) => {
                        return self.refuse(
                            &cidr,
                            format!("{ip}: releasedAt {e} (Calico cannot read this block either)"),
                        );
                    }
                }
                self.tally_released_owner(calico_attribute);
                continue;
            }
            let new_index = match attribute_index.get(&calico_index) {
                Some(new_index) => *new_index,
                None => {
                    let windows_host = calico_attribute
                        .handle_id
                        .as_deref()
                        .filter(|h| is_windows_reserved(h))
                        .and(block.affinity.clone());
                    let imported = match &windows_host {
                        Some(host) => Some(windows_reserved_handle(host)),
                        None => calico_attribute.handle_id.clone(),
                    };
                    let handle = match imported {
                        Some(handle) if validate_handle(&handle).is_ok() => handle,
                        _ => {
                            let other = &calico_attribute.handle_id;
                            return self.refuse(
                                &cidr,
                                format!(
                                    "{ip} has handle_id {other:?}: blockipam needs a handle of 1 to \
                                     512 printable characters per allocation; release it in Calico \
                                     (calicoctl ipam release --ip {ip}) and import again"
                                ),
                            );
                        }
                    };
                    let mut metadata = calico_attribute.secondary.clone().unwrap_or_default();
                    if let Some(host) = &windows_host {
                        metadata.insert(ATTR_NODE.to_owned(), host.clone());
                    }
                    for (key, value) in &metadata {
                        if !KNOWN_ATTRIBUTE_KEYS.contains(&key.as_str()) {
                            self.tally.add(
                                "allocations",
                                &format!("secondary.{key}"),
                                "unknown attribute key: kept as blockipam metadata",
                                &Value::String(value.clone()),
                            );
                        }
                    }
                    for (field, value) in &calico_attribute.other {
                        if !is_unset(value) {
                            self.tally.add(
                                "allocations",
                                field,
                                "not mapped: an attribute field blockipam does not keep",
                                value,
                            );
                        }
                    }
                    let attribute = Attribute { handle, metadata };
                    let size = encode(&attribute).map(|b| b.len()).unwrap_or(usize::MAX);
                    if size > MAX_ATTRIBUTE_BYTES {
                        return self.refuse(
                            &cidr,
                            format!(
                                "the attributes of {ip} take {size} bytes, more than blockipam's \
                                 {MAX_ATTRIBUTE_BYTES}"
                            ),
                        );
                    }
                    block.attributes.push(attribute);
                    let new_index = (block.attributes.len() - 1) as u32;
                    attribute_index.insert(calico_index, new_index);
                    new_index
                }
            };
            let sequence = sequences.get(&ordinal.to_string()).copied().unwrap_or(0);
            max_sequence = max_sequence.max(sequence);
            block.allocations.insert(
                ordinal,
                Allocation {
                    attribute: new_index,
                    sequence,
                },
            );
            if let Some(attribute) = block.attributes.get(new_index as usize) {
                self.expected.push(ExpectedAllocation {
                    ip,
                    handle: attribute.handle.clone(),
                    metadata: attribute.metadata.clone(),
                    sequence,
                });
            }
        }
        block.sequence = max_sequence;
        block.released = self.free_list(&cidr, calico, &allocations);
        block.next_fresh = capacity;
        // Oldest release first, as blockipam frees them (ties in ordinal order, as Calico's
        // garbage collection queues them).
        cooling.sort_by_key(|c| (c.released_at, c.ordinal));
        block.cooling = cooling.into();
        block.claimed_at = match calico.affinity_claim_time.as_deref().map(parse_calico_time) {
            None => None,
            Some(Ok(claimed_at)) => Some(claimed_at),
            Some(Err(e)) => {
                return self.refuse(
                    &cidr,
                    format!("affinity_claim_time {e} (Calico cannot read this block either)"),
                );
            }
        };
        // Calico does not record when a block became empty. With no allocation left it cannot
        // have been before its claim or its newest cooling release: the latest of those known.
        if block.allocations.is_empty() {
            block.emptied_at = block
                .claimed_at
                .into_iter()
                .chain(block.cooling.iter().map(|c| c.released_at))
                .max();
        }

        if block.is_empty() && block.affinity.is_none() {
            self.not_mapped.push(NotMapped {
                object: format!("block {cidr}"),
                field: String::new(),
                value: String::new(),
                note: "empty and affine to no host: skipped (Calico deletes such blocks too)"
                    .into(),
            });
            return None;
        }
        let problems = block.self_check();
        if !problems.is_empty() {
            return self.refuse(&cidr, problems.join("; "));
        }
        Some(block)
    }

    /// A cooling address's former owner (Calico keeps none, but an attribute may carry one): not
    /// kept, counted in the report.
    fn tally_released_owner(&mut self, attribute: &CalicoAttribute) {
        let owner = [
            ("handle_id", attribute.handle_id.clone().map(Value::String)),
            (
                "secondary",
                attribute.secondary.clone().map(|s| {
                    Value::from(serde_json::Map::from_iter(
                        s.into_iter().map(|(k, v)| (k, Value::String(v))),
                    ))
                }),
            ),
        ];
        for (field, value) in owner {
            if let Some(value) = value.filter(|v| !is_unset(v)) {
                self.tally.add(
                    "cooling addresses",
                    field,
                    "not mapped: the address is in IP cooldown (released); its former owner is \
                     not kept",
                    &value,
                );
            }
        }
        for (field, value) in &attribute.other {
            if !is_unset(value) {
                self.tally.add(
                    "cooling addresses",
                    field,
                    "not mapped: an attribute field blockipam does not keep",
                    value,
                );
            }
        }
    }

    /// The block's host: Calico's `host:<name>` affinity when a confirmed affinity object backs it.
    fn affinity(&mut self, cidr: &IpNet, calico: &CalicoBlock) -> Option<String> {
        let host = match (calico.affinity.as_deref(), calico.host_affinity.as_deref()) {
            (Some(affinity), _) => match affinity.strip_prefix("host:") {
                Some(host) => host.to_owned(),
                None => {
                    self.not_mapped.push(NotMapped {
                        object: format!("block {cidr}"),
                        field: "affinity".into(),
                        value: Value::String(affinity.to_owned()).to_string(),
                        note: "not mapped: blockipam blocks are affine to hosts only; imported \
                               without affinity"
                            .into(),
                    });
                    return None;
                }
            },
            (None, Some(host)) if !host.is_empty() => host.to_owned(),
            _ => return None,
        };
        if validate_host(&host).is_err() {
            self.refusals
                .push(format!("block {cidr}: host name {host:?} cannot be stored"));
            return None;
        }
        match self.claims.iter().find(|(claimant, _)| *claimant == host) {
            Some((_, affinity)) if affinity.is_confirmed() => Some(host),
            // Reported with the affinity object.
            Some(_) => None,
            None => {
                self.not_mapped.push(NotMapped {
                    object: format!("block {cidr}"),
                    field: "affinity".into(),
                    value: Value::String(format!("host:{host}")).to_string(),
                    note: "no affinity object confirms it (Calico's host never finds this block): \
                           imported without affinity"
                        .into(),
                });
                None
            }
        }
    }

    /// Calico's free list in its order; ordinals it lists wrongly are dropped and free ordinals it
    /// misses are appended, both reported.
    fn free_list(
        &mut self,
        cidr: &IpNet,
        calico: &CalicoBlock,
        allocations: &[Option<i64>],
    ) -> VecDeque<u32> {
        let is_free = |o: i64| {
            usize::try_from(o)
                .ok()
                .and_then(|o| allocations.get(o))
                .is_some_and(Option::is_none)
        };
        let mut seen = BTreeSet::new();
        let mut released = VecDeque::new();
        let mut dropped = Vec::new();
        for ordinal in calico.unallocated.iter().flatten() {
            if is_free(*ordinal) && seen.insert(*ordinal) {
                released.push_back(*ordinal as u32);
            } else {
                dropped.push(*ordinal);
            }
        }
        let missing: Vec<u32> = (0..allocations.len())
            .filter(|o| allocations[*o].is_none() && !seen.contains(&(*o as i64)))
            .map(|o| o as u32)
            .collect();
        if !dropped.is_empty() || !missing.is_empty() {
            self.not_mapped.push(NotMapped {
                object: format!("block {cidr}"),
                field: "unallocated".into(),
                value: format!("dropped {dropped:?}, appended {missing:?}"),
                note: "Calico's free list disagreed with its allocations: the allocations were \
                       kept as the authority"
                    .into(),
            });
        }
        released.extend(missing);
        released
    }
}

/// Handles as the blocks say: per handle, addresses held per block.
pub fn derive_handles(blocks: &[Block]) -> BTreeMap<String, Handle> {
    let mut handles: BTreeMap<String, Handle> = BTreeMap::new();
    for block in blocks {
        for allocation in block.allocations.values() {
            if let Some(attribute) = block.attributes.get(allocation.attribute as usize) {
                handles
                    .entry(attribute.handle.clone())
                    .or_default()
                    .add(block.cidr, 1);
            }
        }
    }
    handles
}

fn compare_handles(
    snapshot: &CalicoSnapshot,
    derived: &BTreeMap<String, Handle>,
    not_mapped: &mut Vec<NotMapped>,
) {
    let objects: BTreeSet<&str> = snapshot
        .handles
        .iter()
        .filter(|(_, h)| !h.deleted)
        .map(|(id, _)| id.as_str())
        .collect();
    // The Windows-reserved addresses of affine blocks move to one handle per host (see
    // `windows_reserved_handle`), reported once per host instead of as missing handle objects.
    let windows_prefix = format!("{WINDOWS_RESERVED_HANDLE}.");
    for (id, handle) in derived
        .iter()
        .filter(|(id, _)| id.starts_with(&windows_prefix))
    {
        not_mapped.push(NotMapped {
            object: format!("handle {WINDOWS_RESERVED_HANDLE}"),
            field: "block".into(),
            value: serde_json::to_string(
                &handle
                    .blocks
                    .iter()
                    .map(|(cidr, n)| (cidr.to_string(), *n))
                    .collect::<BTreeMap<String, u32>>(),
            )
            .unwrap_or_default(),
            note: format!(
                "Windows-reserved addresses of blocks affine to {}: imported under handle {id} \
                 with that node, so they are released with the node and its blocks can be freed",
                &id[windows_prefix.len()..]
            ),
        });
    }
    for id in derived
        .keys()
        .filter(|id| !objects.contains(id.as_str()) && !id.starts_with(&windows_prefix))
    {
        not_mapped.push(NotMapped {
            object: format!("handle {id}"),
            field: String::new(),
            value: String::new(),
            note: "Calico has no handle object for addresses the blocks hold: created from the \
                   blocks"
                .into(),
        });
    }
    for (id, calico) in &snapshot.handles {
        if calico.deleted || is_windows_reserved(id) {
            continue;
        }
        let counts: BTreeMap<String, i64> = calico.block.clone().unwrap_or_default();
        let stored: BTreeMap<String, i64> = derived
            .get(id)
            .map(|h| {
                h.blocks
                    .iter()
                    .map(|(cidr, n)| (cidr.to_string(), i64::from(*n)))
                    .collect()
            })
            .unwrap_or_default();
        let calico_nonzero: BTreeMap<String, i64> =
            counts.into_iter().filter(|(_, n)| *n != 0).collect();
        if calico_nonzero != stored {
            let note = if stored.is_empty() {
                "the blocks hold no address for this handle (a leak in Calico): not imported"
            } else {
                "Calico's handle object disagrees with the blocks: imported as the blocks say"
            };
            not_mapped.push(NotMapped {
                object: format!("handle {id}"),
                field: "block".into(),
                value: serde_json::to_string(&calico_nonzero).unwrap_or_default(),
                note: note.into(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn calico_pool(spec: Value) -> CalicoPool {
        serde_json::from_value(json!({"metadata": {"name": "rack-1"}, "spec": spec}))
            .expect("a Calico pool")
    }

    #[test]
    fn node_selector_assignment_mode_and_allowed_uses_are_mapped_as_they_are() {
        let (mut refusals, mut not_mapped) = (Vec::new(), Vec::new());
        let pool = map_pool(
            "rack-1",
            &calico_pool(json!({
                "cidr": "10.70.0.0/24",
                "blockSize": 26,
                "nodeSelector": "rack == \"r1\" && !has(drain)",
                "assignmentMode": "Manual",
                "allowedUses": ["Workload"],
                "ipipMode": "Always"
            })),
            &mut refusals,
            &mut not_mapped,
        )
        .expect("mapped");
        assert!(refusals.is_empty(), "{refusals:?}");
        assert_eq!(
            pool.node_selector,
            Selector::parse("rack == \"r1\" && !has(drain)").expect("selector")
        );
        assert_eq!(pool.assignment_mode, ipam_core::AssignmentMode::Manual);
        assert_eq!(pool.allowed_uses.to_string(), "workload");
        let fields: Vec<&str> = not_mapped.iter().map(|n| n.field.as_str()).collect();
        assert_eq!(fields, ["spec.ipipMode"], "only routing stays unmapped");
    }

    #[test]
    fn a_pool_overlapping_link_local_addresses_refuses_the_import() {
        for cidr in ["169.254.0.0/16", "fe80::/64"] {
            let (mut refusals, mut not_mapped) = (Vec::new(), Vec::new());
            let pool = map_pool(
                "p",
                &calico_pool(json!({"cidr": cidr})),
                &mut refusals,
                &mut not_mapped,
            );
            assert!(pool.is_none(), "{cidr}");
            assert_eq!(refusals.len(), 1, "{cidr}: {refusals:?}");
            assert!(refusals[0].contains("link-local range"), "{}", refusals[0]);
        }
    }

    #[test]
    fn a_pool_setting_blockipam_cannot_read_refuses_the_import() {
        for (field, value) in [
            ("nodeSelector", json!("rack == ")),
            ("assignmentMode", json!("Sometimes")),
            ("allowedUses", json!(["LoadBalancer", "Workload"])),
        ] {
            let mut spec = json!({"cidr": "10.71.0.0/24"});
            spec[field] = value.clone();
            let (mut refusals, mut not_mapped) = (Vec::new(), Vec::new());
            map_pool("p", &calico_pool(spec), &mut refusals, &mut not_mapped);
            assert_eq!(refusals.len(), 1, "{field}: {refusals:?}");
            assert!(
                refusals[0].contains(&format!("spec.{field}")),
                "{}",
                refusals[0]
            );
        }
    }
}
