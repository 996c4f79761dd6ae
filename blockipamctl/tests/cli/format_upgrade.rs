//! Format upgrade: stores written by formats 1 to 6 (`fixtures/format-v1` to `format-v6`,
//! each made by that release's own binaries) open, check clean and keep working through the real
//! binaries on sled, redb and etcd (etcd receives the redb fixture through `migrate`, a raw copy).
//! For formats 1 to 5, older than this build's, until `upgrade finalize` the objects that later calls write are rewritten in format 3 (what the
//! previous release reads), after it in the current format; the others stay as they were. Finalize
//! is refused while a node that holds blocks was never seen with this release. Their pools read with Calico's defaults (node selector `all()`, automatic, workload and
//! tunnel) and take the new settings through `pool set`; their config reads with no IP cooldown and
//! the default reclaim age; their blocks, which never recorded when they were claimed or emptied,
//! take IP cooldown and the release of empty blocks.

use std::path::{Path, PathBuf};

use ipam_core::model::{decode, decode_claim, keys, Handle};
use ipnet::IpNet;
use serde_json::Value;

use crate::common::{table_row, Backend, Lab};
use crate::on_every_backend;

fn fixture(version: u8, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../fixtures/format-v{version}"))
        .join(name)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy's directory");
    for entry in std::fs::read_dir(from).expect("read the fixture directory") {
        let entry = entry.expect("a fixture entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a fixture file");
        }
    }
}

/// Puts a copy of the format-`version` store into `lab` (never opening the committed fixture
/// itself).
fn load_fixture(lab: &Lab, version: u8) {
    match lab.backend {
        Backend::Sled => copy_dir(&fixture(version, "store.sled"), &lab.path()),
        Backend::Redb => {
            std::fs::copy(fixture(version, "store.redb"), lab.path())
                .expect("copy the redb fixture");
        }
        Backend::Etcd => {
            let source = Lab::new(Backend::Redb);
            std::fs::copy(fixture(version, "store.redb"), source.path())
                .expect("copy the redb fixture");
            let mut args = source.store_args();
            args.push("migrate".to_owned());
            args.extend(lab.target_args());
            crate::common::ctl(&args, &[]).ok();
        }
    }
}

/// Runs the real plugin once with the netconf the fixture's pods were added with; returns its
/// stdout, failing the test on any error.
fn plugin(lab: &Lab, command: &str, node: &str, container: &str) -> Value {
    let (status, stdout) = lab.plugin(command, node, container, fixture_pools());
    assert_eq!(status, 0, "{command} {container} failed: {stdout}");
    stdout
}

/// Deletes the fixture's pod ctr-a1 through the plugin and asserts its first address came free.
fn delete_ctr_a1(lab: &Lab) {
    plugin(lab, "DEL", "node-a", "ctr-a1");
    let gone = lab
        .ctl(&["-o", "json", "show", "--ip", "10.80.0.49"])
        .ok()
        .json();
    assert!(
        gone["handle"].is_null(),
        "ctr-a1's address is still held: {gone}"
    );
}

fn addresses(result: &Value) -> Vec<IpNet> {
    result["ips"]
        .as_array()
        .expect("an ips list")
        .iter()
        .map(|ip| {
            ip["address"]
                .as_str()
                .expect("an address")
                .parse()
                .expect("a CIDR")
        })
        .collect()
}

/// The format byte and free count of a block's claim entry, read raw.
fn claim_of(lab: &Lab, cidr: &str) -> (u8, Option<u32>) {
    let cidr: IpNet = cidr.parse().expect("cidr");
    lab.with_store(|store| async move {
        let kv = store
            .get(&keys::block_claim(&cidr))
            .await
            .expect("get")
            .expect("a claim entry");
        let entry = decode_claim(&kv.key, &kv.value).expect("the claim entry decodes");
        (kv.value[0], entry.free)
    })
}

/// The format byte of a raw stored value.
fn format_of(lab: &Lab, key: &str) -> u8 {
    let key = key.to_owned();
    lab.with_store(|store| async move {
        store
            .get(&key)
            .await
            .expect("get")
            .expect("the key exists")
            .value[0]
    })
}

/// node-b's block: no call below writes it, so its claim entry keeps the fixture's format.
const UNTOUCHED_BLOCK: &str = "10.80.0.96/28";

fn an_old_store_opens_checks_clean_and_keeps_working(backend: Backend, version: u8) {
    let lab = Lab::new(backend);
    load_fixture(&lab, version);
    // The fixture's objects carry its format, and the store reads as it did then.
    let untouched_claim = claim_of(&lab, UNTOUCHED_BLOCK);
    assert_eq!(untouched_claim.0, version);
    assert_eq!(
        untouched_claim.1.is_some(),
        version >= 2,
        "{untouched_claim:?}"
    );
    assert_eq!(format_of(&lab, &keys::pool("v4")), version);
    lab.ctl(&["check"]).ok();
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let then: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(version, "show-blocks.redb.json"))
            .expect("read the fixture"),
    )
    .expect("fixture JSON");
    assert_eq!(
        only_fields_of(&then, &shown),
        then,
        "format-{version} store shown differently"
    );
    // Its pools read with Calico's defaults for what that format did not store (format 3's own
    // manual pool keeps its policy).
    let pools = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
    for pool in pools.as_array().expect("a pool list") {
        if pool["name"] == "rack-r1" {
            assert!(version >= 3, "format {version} had no pool policy");
            assert_eq!(pool["node_selector"], "rack == \"r1\"", "{pool}");
            assert_eq!(pool["assignment_mode"], "manual", "{pool}");
            continue;
        }
        assert_eq!(pool["node_selector"], "all()", "{pool}");
        assert_eq!(pool["assignment_mode"], "automatic", "{pool}");
        assert_eq!(
            pool["allowed_uses"],
            serde_json::json!(["workload", "tunnel"]),
            "{pool}"
        );
    }

    // A new pod on node-a lands in node-a's block with room, duplicating nothing.
    let added = addresses(&plugin(&lab, "ADD", "node-a", "ctr-new"));
    let v4 = added
        .iter()
        .find(|a| a.addr().is_ipv4())
        .expect("an IPv4 address");
    let node_a_open: IpNet = "10.80.0.64/28".parse().expect("cidr");
    let node_a_first: IpNet = "10.80.0.48/28".parse().expect("cidr");
    assert!(
        node_a_open.contains(&v4.addr()) || node_a_first.contains(&v4.addr()),
        "{v4} is not in node-a's blocks"
    );
    let holder = lab
        .ctl(&["-o", "json", "show", "--ip", &v4.addr().to_string()])
        .ok()
        .json();
    assert_eq!(
        holder["handle"].as_str(),
        Some("fixture.ctr-new"),
        "{holder}"
    );
    // A pod the format-1 release added is deleted through the plugin: its addresses come free.
    delete_ctr_a1(&lab);
    lab.ctl(&["check"]).ok();

    // Written blocks carry current-format claim entries with their free count; node-b's,
    // untouched, keeps the fixture's format and is still accepted.
    let block_of_new = if node_a_open.contains(&v4.addr()) {
        "10.80.0.64/28"
    } else {
        "10.80.0.48/28"
    };
    // Until finalize, writers write the format the previous release's nodes read: 3 for a store
    // that predates the format record, else the one it records.
    let (written_format, free) = claim_of(&lab, block_of_new);
    assert_eq!(written_format, 3.max(version));
    assert!(free.is_some(), "a rewritten entry records the free count");
    assert_eq!(claim_of(&lab, UNTOUCHED_BLOCK), untouched_claim);

    // An old pool takes a node selector: it is rewritten (in format 3), and the netconf, which
    // names it, still allocates from it on a node it does not select.
    lab.ctl(&["pool", "set", "v4", "--node-selector", "rack == \"r9\""])
        .ok();
    assert_eq!(format_of(&lab, &keys::pool("v4")), 3.max(version));
    assert_eq!(format_of(&lab, &keys::pool("v6")), version);
    let named = addresses(&plugin(&lab, "ADD", "node-a", "ctr-named"));
    assert!(named.iter().any(|a| a.addr().is_ipv4()), "{named:?}");
    lab.ctl(&["check"]).ok();

    // Finalize waits for node-b, which holds a block and was never seen with this release; once
    // its plugin made a call, every node reads today's format and the finalize goes through.
    let refused = lab.ctl(&["upgrade", "finalize"]);
    refused.expect_code(1);
    let line = refused.error_line();
    assert!(
        line.contains("node-b") && !line.contains("node-a:"),
        "{line}"
    );
    // `upgrade status` says the same to an operator: the format writers keep, the node behind,
    // and, once it has caught up, that finalize will go ahead; then that it is done.
    let today = ipam_core::model::FORMAT_VERSION;
    let oldest = ipam_core::model::OLDEST_READABLE_FORMAT_VERSION;
    let head = format!(
        "writers write: format {}\nthis build reads formats {oldest} to {today} and writes {today}\n",
        3.max(version)
    );
    let behind = lab.ctl(&["upgrade", "status"]);
    behind
        .expect_code(1)
        .stdout_has(&head)
        .stdout_has(
            "\n1 node(s) may read only an older format: upgrade (or retire) them before `upgrade finalize`\n",
        );
    // node-b was last seen (by the fixture's release, from format 4 on) reading the fixture's format.
    let node_b = table_row(&behind.stdout, "node-b");
    assert_eq!(
        [&node_b[0], &node_b[1], &node_b[2], &node_b[4]],
        ["node-b", &format!("format {}", 3.max(version)), "-", "yes"]
    );
    if version < 4 {
        assert_eq!(node_b[3], "-");
    } else {
        assert!(
            node_b[3].ends_with(&format!(" (format {version})")),
            "{node_b:?}"
        );
    }
    assert_eq!(
        table_row(&behind.stdout, "node-a")[1],
        format!("format {today}")
    );
    plugin(&lab, "ADD", "node-b", "ctr-b-upgraded");
    let status = lab.ctl(&["-o", "json", "upgrade", "status"]).ok().json();
    assert_eq!(status["ready_to_finalize"], true, "{status}");
    assert_eq!(status["writes_format"], 3.max(version), "{status}");
    let ready = lab.ctl(&["upgrade", "status"]);
    ready.ok().stdout_has(&head).stdout_has(
        "\nevery node seen reads this build's format: `upgrade finalize` will go ahead\n",
    );
    assert_eq!(
        table_row(&ready.stdout, "node-b")[1],
        format!("format {today}")
    );
    lab.ctl(&["upgrade", "finalize"]).ok().stdout_has(&format!(
        "finalized: every writer now writes format {today} (was format {}); binaries that read \
         only older formats refuse this store\n",
        3.max(version)
    ));
    lab.ctl(&["upgrade", "status"])
        .ok()
        .stdout_has(&format!(
            "stored format: format {today} (recorded)\nwriters write: format {today}\n"
        ))
        .stdout_has("\nfinalized: writers use this build's format\n");
    lab.ctl(&["upgrade", "finalize"]).ok().stdout_has(&format!(
        "already finalized at format {today}: nothing written\n"
    ));
    // A node whose agent registered reading format 3 after the finalize: it refuses the store,
    // and `upgrade status` says so (exit 1) until it is upgraded or retired.
    lab.with_store(|store| async move {
        let late = ipam_core::dead_nodes::Registration {
            node: "node-c".into(),
            registered_at: 1,
            agent_version: "0.1.0".into(),
            reads_format: Some(3),
            missing_since: None,
            missing_mark: None,
            blocks_released: false,
        };
        store
            .put(
                &ipam_core::dead_nodes::agent_key("node-c"),
                serde_json::to_vec(&late).expect("JSON"),
            )
            .await
            .expect("register node-c");
        // Its plugin, of that release too, committed for it.
        let activity = ipam_core::dead_nodes::Activity {
            node: "node-c".into(),
            plugin_version: "0.1.0".into(),
            reads_format: Some(3),
        };
        store
            .put(
                &ipam_core::dead_nodes::activity_key("node-c"),
                serde_json::to_vec(&activity).expect("JSON"),
            )
            .await
            .expect("record node-c's plugin");
    });
    let finalized = lab.ctl(&["upgrade", "status"]);
    finalized.expect_code(1).stdout_has(
        "\nfinalized: writers use this build's format\n1 node(s) read only an older format \
             and refuse this store: upgrade their binaries, or retire a node gone for good with \
             `blockipamctl node retire <node> --apply`\n",
    );
    assert_eq!(table_row(&finalized.stdout, "node-c")[1], "format 3");
    // Retired as the line says, it no longer counts (its registration and its plugin's record
    // both go).
    lab.ctl(&["node", "retire", "node-c", "--apply"]).ok();
    let retired = lab.ctl(&["upgrade", "status"]);
    retired.ok();
    assert!(
        !retired.stdout.contains("refuse this store"),
        "{}",
        retired.stdout
    );
    lab.ctl(&["pool", "set", "v4", "--node-selector", "all()"])
        .ok();
    assert_eq!(
        format_of(&lab, &keys::pool("v4")),
        ipam_core::model::FORMAT_VERSION
    );
    lab.ctl(&["check"]).ok();

    // A newer release finalizes the store later: `upgrade status` says this build cannot write
    // to it (exit 1), and `upgrade finalize`, forced or not, refuses rather than take the record
    // back to this build's format; nothing is written.
    let newer = today + 1;
    lab.with_store(|store| async move {
        store
            .put(
                &keys::store_format(),
                format!(r#"{{"writes":{newer}}}"#).into_bytes(),
            )
            .await
            .expect("a newer release's record")
    });
    let before = lab.snapshot();
    lab.ctl(&["upgrade", "status"])
        .expect_code(1)
        .stdout_has(&format!(
            "stored format: format {newer} (recorded)\nwriters write: format {newer}\n"
        ))
        .stdout_has(&format!(
            "finalized by a newer release: writers write format {newer}, newer than this \
             build's {today}; this build refuses to write to this store (and to finalize it): \
             use that release's blockipamctl\n"
        ));
    for finalize in [
        &["upgrade", "finalize"][..],
        &["upgrade", "finalize", "--force"][..],
    ] {
        let refused = lab.ctl(finalize);
        refused.expect_code(1);
        assert!(
            refused.error_line().contains(&format!(
                "this store's writers use stored format {newer}, and this build writes formats \
                 up to {today}"
            )),
            "{}",
            refused.stderr
        );
    }
    assert_eq!(lab.snapshot(), before, "a refused finalize wrote");
}

fn a_format_1_store_opens_checks_clean_and_keeps_working(backend: Backend) {
    an_old_store_opens_checks_clean_and_keeps_working(backend, 1);
}

fn a_format_2_store_opens_checks_clean_and_keeps_working(backend: Backend) {
    an_old_store_opens_checks_clean_and_keeps_working(backend, 2);
}

fn a_format_3_store_opens_checks_clean_and_keeps_working(backend: Backend) {
    an_old_store_opens_checks_clean_and_keeps_working(backend, 3);
}

fn a_format_4_store_opens_checks_clean_and_keeps_working(backend: Backend) {
    an_old_store_opens_checks_clean_and_keeps_working(backend, 4);
}

fn a_format_5_store_opens_checks_clean_and_keeps_working(backend: Backend) {
    an_old_store_opens_checks_clean_and_keeps_working(backend, 5);
}

fn a_format_6_store_opens_checks_clean_and_keeps_working(backend: Backend) {
    an_old_store_opens_checks_clean_and_keeps_working(backend, 6);
}

/// A store written by format 7, this build's own format (`fixtures/format-v7`, made by
/// `scripts/make-format-fixture 7` before any later format): it opens, checks clean and shows
/// what it showed when it was written, its pods' attributes kept apart in owner keys; it is
/// already finalized, and it keeps working (a new pod's address named by its handle, a pod of the
/// fixture deleted through the plugin with its owner keys). The next format's upgrade cases start
/// from it, as the older formats' do from theirs.
fn a_format_7_store_opens_as_written_and_keeps_working(backend: Backend) {
    let lab = Lab::new(backend);
    load_fixture(&lab, 7);
    let untouched_claim = claim_of(&lab, UNTOUCHED_BLOCK);
    assert_eq!(untouched_claim.0, 7);
    assert!(untouched_claim.1.is_some(), "{untouched_claim:?}");
    assert_eq!(format_of(&lab, &keys::pool("v4")), 7);
    lab.ctl(&["check"])
        .ok()
        .stdout_has("20 handles and 39 allocated addresses: no problems");
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let then: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(7, "show-blocks.redb.json")).expect("read the fixture"),
    )
    .expect("fixture JSON");
    assert_eq!(
        only_fields_of(&then, &shown),
        then,
        "format-7 store shown differently"
    );
    // ctr-a1's addresses (one per family) hold their attributes in owner keys, and `show --ip`
    // reads them from there.
    let first = lab
        .ctl(&["-o", "json", "show", "--ip", "10.80.0.49"])
        .ok()
        .json();
    assert_eq!(first["handle"], "fixture.ctr-a1", "{first}");
    assert_eq!(first["attributes"]["pod"], "ctr-a1", "{first}");
    let first_block: IpNet = "10.80.0.48/28".parse().expect("cidr");
    let owners_before = owner_keys(&lab);
    assert!(
        owners_before.contains(&keys::owner_key(&first_block, 1)),
        "{owners_before:?}"
    );
    lab.ctl(&["upgrade", "status"])
        .ok()
        .stdout_has("stored format: format 7 (recorded)\nwriters write: format 7\n")
        .stdout_has("\nfinalized: writers use this build's format\n");
    lab.ctl(&["upgrade", "finalize"])
        .ok()
        .stdout_has("already finalized at format 7: nothing written\n");

    let added = addresses(&plugin(&lab, "ADD", "node-a", "ctr-new"));
    let v4 = added
        .iter()
        .find(|a| a.addr().is_ipv4())
        .expect("an IPv4 address");
    assert_eq!(
        holder_of(&lab, Path::new(crate::common::BIN), *v4),
        "fixture.ctr-new"
    );
    assert_eq!(format_of(&lab, &handle_key("ctr-new")), 7);
    delete_ctr_a1(&lab);
    let owners_after = owner_keys(&lab);
    assert!(
        !owners_after.contains(&keys::owner_key(&first_block, 1)),
        "ctr-a1's owner key outlived its DEL: {owners_after:?}"
    );
    lab.ctl(&["check"]).ok();
}

/// The netconf pools the fixture's pods were added with.
fn fixture_pools() -> Value {
    serde_json::json!({
        "assign_ipv4": "true",
        "assign_ipv6": "true",
        "ipv4_pools": ["v4"],
        "ipv6_pools": ["v6"],
    })
}

/// The earlier release's own plugin adds a pod on node-b and deletes it, both succeeding.
fn previous_plugin_adds_and_deletes(
    lab: &Lab,
    previous: &test_kit::previous::PreviousRelease,
    pools: &Value,
) {
    for command in ["ADD", "DEL"] {
        let (status, out) = lab.plugin_of(
            &previous.plugin(),
            command,
            "node-b",
            "ctr-old-b",
            pools.clone(),
        );
        assert_eq!(
            status,
            0,
            "the release of {} ({command} on node-b): {out}",
            previous.commit()
        );
    }
}

/// Every owner key in the store (format 6 keeps allocations' attributes there).
fn owner_keys(lab: &Lab) -> Vec<String> {
    lab.with_store(|store| async move {
        store
            .list(&keys::owners_dir())
            .await
            .expect("list the owner keys")
            .into_iter()
            .map(|kv| kv.key)
            .collect()
    })
}

/// The handle the plugin records for `container` of the fixture's network.
fn handle_key(container: &str) -> String {
    keys::handle(&format!("fixture.{container}"))
}

/// Who `show --ip` says holds `ip` (its handle), through `cli`.
fn holder_of(lab: &Lab, cli: &Path, ip: IpNet) -> Value {
    let shown = lab.ctl_of(cli, &["-o", "json", "show", "--ip", &ip.addr().to_string()]);
    assert_eq!(
        shown.code, 0,
        "show --ip {ip}: {} {}",
        shown.stdout, shown.stderr
    );
    serde_json::from_str::<Value>(&shown.stdout).expect("show's JSON")["handle"].clone()
}

/// Beside today's writes (`today_added`, an address today's plugin just added on node-a), the
/// release writing format `format` still works: its `check` finds the store clean, its `show`
/// names the holder of today's address, and its plugin adds and deletes a pod on node-b.
fn previous_release_works_beside_today(
    lab: &Lab,
    previous: &test_kit::previous::PreviousRelease,
    today_added: IpNet,
    format: u8,
) {
    let old_check = lab.ctl_of(&previous.cli(), &["check"]);
    assert_eq!(
        old_check.code, 0,
        "the format-{format} release's check after today's writes: {} {}",
        old_check.stdout, old_check.stderr
    );
    assert_eq!(
        holder_of(lab, &previous.cli(), today_added),
        "fixture.ctr-before",
        "the format-{format} release's show"
    );
    previous_plugin_adds_and_deletes(lab, previous, &fixture_pools());
}

/// Once the store is finalized, the plugin of the release writing format `format` refuses a new
/// container, naming today's format (CNI error 108), and writes nothing.
fn previous_plugin_refused_after_finalize(
    lab: &Lab,
    previous: &test_kit::previous::PreviousRelease,
    format: u8,
) {
    let snapshot = lab.snapshot();
    let (status, refused) = lab.plugin_of(
        &previous.plugin(),
        "ADD",
        "node-b",
        "ctr-old-late",
        fixture_pools(),
    );
    let today = format!("format version {}", ipam_core::model::FORMAT_VERSION);
    assert!(
        status != 0 && refused["code"] == 108 && refused.to_string().contains(&today),
        "the format-{format} release's ADD after finalize: exit {status}, {refused}"
    );
    assert!(
        snapshot == lab.snapshot(),
        "the refused ADD wrote to the store"
    );
}

/// A format-5 store in use beside the release that writes format 5 (its own plugin and CLI, built
/// by `scripts/build-previous 5`). Until finalize, today's plugin keeps every attribute in its
/// block and writes handles with their counts only, in format 5: the format-5 release's `check`
/// finds the store clean after today's writes, its `show` names the holders of today's
/// addresses, and its plugin keeps allocating and releasing. Once finalized, today's ADD keeps
/// the new pod's attribute apart, in an owner key, and its DEL deletes the key; the format-5
/// plugin refuses new containers naming today's format (CNI error 108) and writes nothing.
fn a_format_5_store_keeps_attributes_in_blocks_until_finalize(backend: Backend) {
    let previous = test_kit::previous::PreviousRelease::locate_format5();
    let today_cli = PathBuf::from(crate::common::BIN);
    let lab = Lab::new(backend);
    load_fixture(&lab, 5);
    let before = v4_of(&plugin(&lab, "ADD", "node-a", "ctr-before"));
    assert!(owner_keys(&lab).is_empty(), "{:?}", owner_keys(&lab));
    assert_eq!(format_of(&lab, &handle_key("ctr-before")), 5);
    lab.ctl(&["check"]).ok();
    previous_release_works_beside_today(&lab, &previous, before, 5);
    // Today's DEL of a pod whose attributes its block holds.
    plugin(&lab, "DEL", "node-a", "ctr-before");
    assert!(holder_of(&lab, &today_cli, before).is_null());

    // node-b last ran the format-5 plugin: finalize waits for it, unless forced.
    lab.ctl(&["upgrade", "finalize"]).expect_code(1);
    lab.ctl(&["upgrade", "finalize", "--force"]).ok();
    let after = v4_of(&plugin(&lab, "ADD", "node-a", "ctr-after"));
    // Its handle records the metadata of both its addresses (IPv4 and IPv6) kept apart, each in
    // its owner key.
    let handle: Handle = lab.with_store(|store| async move {
        let kv = store
            .get(&handle_key("ctr-after"))
            .await
            .expect("get")
            .expect("the handle exists");
        decode(&kv.key, &kv.value).expect("the handle decodes")
    });
    let held: Vec<(IpNet, u32)> = handle
        .apart
        .iter()
        .flat_map(|(cidr, held)| held.keys().map(move |ordinal| (*cidr, *ordinal)))
        .collect();
    assert_eq!(held.len(), 2, "{handle:?}");
    assert!(
        held.iter().any(|(cidr, _)| cidr.contains(&after.addr())),
        "{handle:?}"
    );
    let owners = owner_keys(&lab);
    for (cidr, ordinal) in &held {
        assert!(
            owners.contains(&keys::owner_key(cidr, *ordinal)),
            "{owners:?} lacks the owner key of {cidr} #{ordinal}"
        );
    }
    assert_eq!(
        format_of(&lab, &handle_key("ctr-after")),
        ipam_core::model::FORMAT_VERSION
    );
    assert_eq!(holder_of(&lab, &today_cli, after), "fixture.ctr-after");
    lab.ctl(&["check"]).ok();
    // The format-5 release's plugin now refuses new containers, naming the format, and writes
    // nothing.
    previous_plugin_refused_after_finalize(&lab, &previous, 5);
    // Today's DEL frees the address and its owner key; a DEL of a pod added before finalize
    // (its attribute in its block) still frees its address.
    plugin(&lab, "DEL", "node-a", "ctr-after");
    assert!(holder_of(&lab, &today_cli, after).is_null());
    let left = owner_keys(&lab);
    assert!(
        held.iter()
            .all(|(cidr, ordinal)| !left.contains(&keys::owner_key(cidr, *ordinal))),
        "the DEL left owner keys: {left:?}"
    );
    plugin(&lab, "DEL", "node-a", "ctr-a1");
    assert!(holder_of(&lab, &today_cli, "10.80.0.49/32".parse().expect("ip")).is_null());
    lab.ctl(&["check"]).ok();
}

/// A format-6 store in use beside the release that writes format 6 (its own plugin and CLI,
/// built by `scripts/build-previous 6`). Until finalize, today's plugin writes format 6 (the
/// layout is the same; only format 7's promise differs: every writer of what an ADD decides from
/// raises a generation, which the format-6 release's writers do not all do), the format-6
/// release's `check` finds the store clean after today's writes, its `show` names the holders of
/// today's addresses, and its plugin keeps allocating and releasing. Finalize waits for node-b,
/// which last ran the format-6 plugin, unless forced; once finalized, today's ADD writes format 7
/// and the format-6 plugin refuses new containers naming format 7 (CNI error 108), writing
/// nothing.
fn a_format_6_store_beside_the_format_6_release_until_finalize(backend: Backend) {
    let previous = test_kit::previous::PreviousRelease::locate_format6();
    let today_cli = PathBuf::from(crate::common::BIN);
    let lab = Lab::new(backend);
    load_fixture(&lab, 6);
    let before = v4_of(&plugin(&lab, "ADD", "node-a", "ctr-before"));
    assert_eq!(format_of(&lab, &handle_key("ctr-before")), 6);
    lab.ctl(&["check"]).ok();
    previous_release_works_beside_today(&lab, &previous, before, 6);
    plugin(&lab, "DEL", "node-a", "ctr-before");
    assert!(holder_of(&lab, &today_cli, before).is_null());

    // node-b last ran the format-6 plugin: finalize waits for it, unless forced.
    let refused = lab.ctl(&["upgrade", "finalize"]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains("node-b"),
        "{}",
        refused.stderr
    );
    lab.ctl(&["upgrade", "finalize", "--force"]).ok();
    let after = v4_of(&plugin(&lab, "ADD", "node-a", "ctr-after"));
    assert_eq!(
        format_of(&lab, &handle_key("ctr-after")),
        ipam_core::model::FORMAT_VERSION
    );
    assert_eq!(holder_of(&lab, &today_cli, after), "fixture.ctr-after");
    lab.ctl(&["check"]).ok();
    previous_plugin_refused_after_finalize(&lab, &previous, 6);
    plugin(&lab, "DEL", "node-a", "ctr-after");
    assert!(holder_of(&lab, &today_cli, after).is_null());
    lab.ctl(&["check"]).ok();
}

/// node-a's second block in the format-4 fixture: four pods (of its 14 host addresses) in it.
const NODE_A_SECOND: &str = "10.80.0.64/28";

/// Where node-a's second block is stored: "open", "full", or both or neither (a failure).
fn placement_of_node_a_second(lab: &Lab) -> Vec<&'static str> {
    let cidr: IpNet = NODE_A_SECOND.parse().expect("cidr");
    lab.with_store(|store| async move {
        let mut found = Vec::new();
        for (place, key) in [
            ("open", keys::block(Some("node-a"), &cidr)),
            ("full", keys::full_block("node-a", &cidr)),
        ] {
            if store.get(&key).await.expect("get").is_some() {
                found.push(place);
            }
        }
        found
    })
}

/// The IPv4 address of a plugin's ADD result.
fn v4_of(result: &Value) -> IpNet {
    *addresses(result)
        .iter()
        .find(|a| a.addr().is_ipv4())
        .expect("an IPv4 address")
}

/// A format-4 store in use beside the release that writes format 4 (its own plugin and CLI, built
/// by `scripts/build-previous 4`). Today's plugin, whose netconf has no gateway and so never hands
/// out a block's edges, fills node-a's blocks up to them: while the store is at format 4 such a
/// block stays under `open/`, where that release puts it, so the format-4 release's `check` finds
/// the store clean and its plugin keeps allocating and releasing. Once finalized, today's next ADD
/// on node-a moves the block under `full/` (its steady-state read no longer holds it); a DEL that
/// frees one of its addresses moves it back; `check` stays clean throughout.
fn a_format_4_store_keeps_edge_blocks_where_format_4_reads_them_until_finalize(backend: Backend) {
    let previous = test_kit::previous::PreviousRelease::locate_format4();
    let lab = Lab::new(backend);
    load_fixture(&lab, 4);
    let second: IpNet = NODE_A_SECOND.parse().expect("cidr");
    assert_eq!(placement_of_node_a_second(&lab), ["open"]);
    // node-a's first block takes one pod more (the rest of it is in use, its network address by
    // the node's tunnel); the next ten fill the second up to its edges.
    let first = v4_of(&plugin(&lab, "ADD", "node-a", "ctr-edge"));
    assert!(!second.contains(&first.addr()), "{first}");
    for n in 1..=10 {
        let got = v4_of(&plugin(&lab, "ADD", "node-a", &format!("ctr-fill-{n}")));
        assert!(second.contains(&got.addr()), "{got} is not in {second}");
    }
    // Only its edges are free now; format 4 keeps such a block under open/.
    assert_eq!(placement_of_node_a_second(&lab), ["open"]);
    lab.ctl(&["check"]).ok();
    let old_check = lab.ctl_of(&previous.cli(), &["check"]);
    assert_eq!(
        old_check.code, 0,
        "the format-4 release's check after today's writes: {} {}",
        old_check.stdout, old_check.stderr
    );
    previous_plugin_adds_and_deletes(&lab, &previous, &fixture_pools());

    // node-b last ran the format-4 plugin: finalize waits for it, unless forced.
    lab.ctl(&["upgrade", "finalize"]).expect_code(1);
    lab.ctl(&["upgrade", "finalize", "--force"]).ok();
    // The format-4 release's plugin now refuses new containers, naming the format, and writes
    // nothing.
    previous_plugin_refused_after_finalize(&lab, &previous, 4);
    let after = v4_of(&plugin(&lab, "ADD", "node-a", "ctr-after-finalize"));
    assert!(!second.contains(&after.addr()), "{after}");
    assert_eq!(placement_of_node_a_second(&lab), ["full"]);
    lab.ctl(&["check"]).ok();
    // A DEL frees a host address in it: the block has room again, back under open/, and the next
    // ADD (blocks in address order) takes that address.
    plugin(&lab, "DEL", "node-a", "ctr-fill-1");
    assert_eq!(placement_of_node_a_second(&lab), ["open"]);
    let again = v4_of(&plugin(&lab, "ADD", "node-a", "ctr-fill-again"));
    assert!(second.contains(&again.addr()), "{again}");
    assert_eq!(placement_of_node_a_second(&lab), ["full"]);
    lab.ctl(&["check"]).ok();
}

/// `value` keeping only the object fields `shape` has (recursively): what a fixture printed then,
/// compared without the fields later releases added to the output.
fn only_fields_of(shape: &Value, value: &Value) -> Value {
    match (shape, value) {
        (Value::Object(wanted), Value::Object(got)) => Value::Object(
            got.iter()
                .filter(|(k, _)| wanted.contains_key(*k))
                .map(|(k, v)| (k.clone(), only_fields_of(&wanted[k], v)))
                .collect(),
        ),
        (Value::Array(wanted), Value::Array(got)) if wanted.len() == got.len() => Value::Array(
            wanted
                .iter()
                .zip(got)
                .map(|(w, g)| only_fields_of(w, g))
                .collect(),
        ),
        _ => value.clone(),
    }
}

/// A format-3 store (the last before block timestamps and cooldown) upgraded in use: its config
/// reads with Calico's defaults for the new settings and takes them; an address released after
/// `config set --ip-cooldown-seconds` cools (shown as cooling, not handed out again), and its
/// old blocks, which never recorded when they were emptied, are released by `blocks release-empty`.
fn a_format_3_store_takes_cooldown_and_releases_its_old_empty_blocks(backend: Backend) {
    let lab = Lab::new(backend);
    load_fixture(&lab, 3);
    assert_eq!(format_of(&lab, &keys::config()), 3);
    let config = lab.ctl(&["-o", "json", "config", "show"]).ok().json();
    assert_eq!(config["max_blocks_per_host"], 0, "{config}");
    assert_eq!(config["ip_cooldown_seconds"], 0, "{config}");
    assert_eq!(config["empty_block_reclaim_seconds"], 60, "{config}");
    // Format 3, which the previous release's nodes read, has no cooldown: refused, nothing
    // written, until the upgrade is finalized (forced here: the fixture's nodes run no binary).
    let refused = lab.ctl(&["config", "set", "--ip-cooldown-seconds", "1200"]);
    refused.expect_code(1);
    assert!(
        refused
            .error_line()
            .contains("blockipamctl upgrade finalize"),
        "{}",
        refused.stderr
    );
    assert_eq!(format_of(&lab, &keys::config()), 3);
    lab.ctl(&["upgrade", "finalize", "--force"]).ok();
    lab.ctl(&["config", "set", "--ip-cooldown-seconds", "1200"])
        .ok();
    assert_eq!(
        format_of(&lab, &keys::config()),
        ipam_core::model::FORMAT_VERSION
    );
    // node-b's two pods go: its old-format block now holds cooling addresses only.
    plugin(&lab, "DEL", "node-b", "ctr-b1");
    plugin(&lab, "DEL", "node-b", "ctr-b2");
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let block = shown["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .find(|b| b["cidr"] == UNTOUCHED_BLOCK)
        .expect("node-b's block")
        .clone();
    assert_eq!(block["in_use"], 0, "{block}");
    assert_eq!(block["cooling"], 2, "{block}");
    assert_eq!(block["free"], 14, "{block}");
    // A new pod on node-b does not get them back.
    let added = addresses(&plugin(&lab, "ADD", "node-b", "ctr-b3"));
    for gone in ["10.80.0.97", "10.80.0.98"] {
        assert!(
            added.iter().all(|a| a.addr().to_string() != gone),
            "{gone} handed out while cooling: {added:?}"
        );
    }
    lab.ctl(&["check"]).ok();
    // node-a's pods all go: its two old /28 blocks are empty (no cooldown now), since a time the
    // old format never recorded; the newer one stays, the other is released.
    lab.ctl(&["config", "set", "--ip-cooldown-seconds", "0"])
        .ok();
    let held: Vec<String> = (1..=18)
        .filter(|n| *n != 5)
        .map(|n| format!("ctr-a{n}"))
        .collect();
    for container in &held {
        plugin(&lab, "DEL", "node-a", container);
    }
    lab.ctl(&["tunnel-address", "release", "node-a", "--type", "vxlan"])
        .ok();
    let (preview, listed) = lab.release_empty_preview("node-a");
    assert_eq!(listed.len(), 2, "{preview}");
    assert_eq!(preview["applied"], false);
    lab.ctl(&["blocks", "release-empty", "--older-than", "0", "--apply"])
        .ok()
        .stdout_has("Released");
    let after = lab
        .ctl(&["-o", "json", "blocks", "release-empty", "--older-than", "0"])
        .ok()
        .json();
    assert!(
        after["blocks"]
            .as_array()
            .expect("blocks")
            .iter()
            .all(|b| b["host"] != "node-a"),
        "{after}"
    );
    lab.ctl(&["check"]).ok();
}

on_every_backend!(
    a_format_1_store_opens_checks_clean_and_keeps_working,
    a_format_2_store_opens_checks_clean_and_keeps_working,
    a_format_3_store_opens_checks_clean_and_keeps_working,
    a_format_4_store_opens_checks_clean_and_keeps_working,
    a_format_5_store_opens_checks_clean_and_keeps_working,
    a_format_6_store_opens_checks_clean_and_keeps_working,
    a_format_7_store_opens_as_written_and_keeps_working,
    a_format_4_store_keeps_edge_blocks_where_format_4_reads_them_until_finalize,
    a_format_5_store_keeps_attributes_in_blocks_until_finalize,
    a_format_6_store_beside_the_format_6_release_until_finalize,
    a_format_3_store_takes_cooldown_and_releases_its_old_empty_blocks,
);
