//! `demo`: the README quickstart's main job. Runs the real `blockipam` plugin through the CNI
//! protocol (environment plus netconf on stdin, result JSON on stdout) for a few containers on
//! simulated nodes against a sled store in a local directory, shows the blocks, deletes the
//! containers, and checks that the pool is empty again.
//!
//! blockipamctl never holds the store open while the plugin runs: the plugin takes the store's
//! lock for each call, exactly as it would under a container runtime.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use blockipam_store::plugin_call::{self, PluginCall, PluginCallError};
use blockipam_store::{Backend, DatastoreSettings};
use ipam_core::{Ipam, Pool, PoolSpec, Utilization};
use ipnet::IpNet;
use serde::Serialize;
use serde_json::{json, Value};

use crate::cli::{DemoArgs, ENV_PLUGIN};
use crate::commands::show::{
    blocks_json, blocks_table, pools_json, pools_table, BlockJson, PoolUsageJson,
};
use crate::commands::{to_json, PoolJson};
use crate::error::{one_line, CtlError};
use crate::output::{counted, Ctx, Outcome};
use crate::settings::{self, Env, OpenMode};

/// The network name in the demo's netconf (handles are `demo-net.<container id>`).
pub const NETWORK_NAME: &str = "demo-net";
/// The pool the demo creates when the store has none.
pub const DEMO_POOL_CIDR: &str = "10.77.0.0/16";
/// Its name.
pub const DEMO_POOL_NAME: &str = "demo";
/// Its block size.
pub const DEMO_BLOCK_SIZE: u8 = 26;
/// Longest one plugin call may take (the CNI timeout calico-ipam uses is 90 s).
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(120);

/// One simulated container.
#[derive(Debug, Clone, Serialize)]
struct ContainerJson {
    container_id: String,
    node: String,
    address: Option<String>,
    result: Option<Value>,
    deleted: bool,
}

#[derive(Debug, Serialize)]
struct DemoJson {
    dir: String,
    store: String,
    plugin: String,
    created_pool: bool,
    released_leftovers: usize,
    pools: Vec<PoolJson>,
    containers: Vec<ContainerJson>,
    blocks_after_add: Vec<BlockJson>,
    pools_after_del: Vec<PoolUsageJson>,
    ok: bool,
}

/// What one plugin run returned.
#[derive(Debug)]
struct PluginRun {
    success: bool,
    status: String,
    stdout: String,
    stderr: String,
}

impl PluginRun {
    /// The plugin's own explanation: a CNI error's `msg` and `details`, else its output.
    fn explanation(&self) -> String {
        if let Ok(error) = serde_json::from_str::<Value>(&self.stdout) {
            if let Some(msg) = error.get("msg").and_then(Value::as_str) {
                let details = error
                    .get("details")
                    .and_then(Value::as_str)
                    .filter(|d| !d.is_empty())
                    .map(|d| format!(": {d}"))
                    .unwrap_or_default();
                let code = error
                    .get("code")
                    .map(|c| format!(" (CNI error code {c})"))
                    .unwrap_or_default();
                return format!("{msg}{details}{code}");
            }
        }
        let text = if self.stderr.trim().is_empty() {
            &self.stdout
        } else {
            &self.stderr
        };
        let text = one_line(text);
        if text.is_empty() {
            "no output".to_owned()
        } else if text.chars().count() > 400 {
            format!("{}...", text.chars().take(400).collect::<String>())
        } else {
            text
        }
    }
}

/// Where the plugin binary is: `--plugin`, else `BLOCKIPAM_PLUGIN`, else `blockipam` next to the
/// running executable; it must be a regular file. `hint` ends the error when it is not there.
/// Shared by `demo` and `install-cni`.
///
/// # Errors
/// [`CtlError::Failed`] when the running executable cannot be located or no file is there.
pub(crate) fn locate_plugin(
    flag: Option<&Path>,
    env: &Env,
    hint: &str,
) -> Result<PathBuf, CtlError> {
    let (candidate, source) = match (flag, env.get(ENV_PLUGIN)) {
        (Some(path), _) => (path.to_path_buf(), "--plugin".to_owned()),
        (None, Some(path)) => (PathBuf::from(path), ENV_PLUGIN.to_owned()),
        (None, None) => {
            let exe = std::env::current_exe().map_err(|e| {
                CtlError::failed(format!(
                    "cannot tell where blockipamctl runs from ({e}); pass --plugin PATH"
                ))
            })?;
            let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
            (
                dir.join("blockipam"),
                "the directory of blockipamctl".to_owned(),
            )
        }
    };
    if !candidate.is_file() {
        return Err(CtlError::failed(format!(
            "the blockipam plugin binary was not found at {} (from {source}), or it is not a \
             regular file: {hint}",
            candidate.display()
        )));
    }
    Ok(candidate)
}

/// The plugin `demo` runs, resolved to its real path.
fn find_plugin(args: &DemoArgs, env: &Env) -> Result<PathBuf, CtlError> {
    let candidate = locate_plugin(
        args.plugin.as_deref(),
        env,
        "build it with `cargo build -p blockipam` so that it sits next to blockipamctl, or pass \
         --plugin PATH",
    )?;
    std::fs::canonicalize(&candidate)
        .map_err(|e| CtlError::failed(format!("cannot resolve {}: {e}", candidate.display())))
}

/// The netconf a runtime would pass for `node`.
fn netconf(pools: &[Pool], node: &str, store: &Path, lock: &Path) -> Value {
    let pools: Vec<Value> = pools
        .iter()
        .map(|p| json!({"cidr": p.cidr.to_string(), "block_size": p.block_size, "name": p.name}))
        .collect();
    json!({
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "type": "ptp",
        "ipam": {
            "type": "blockipam",
            "datastore_type": "sled",
            "datastore_path": store.display().to_string(),
            "ipam_lock_file": lock.display().to_string(),
            "nodename": node,
            "pools": pools,
        }
    })
}

/// Runs the plugin once, as a runtime would: CNI environment, netconf on stdin.
async fn run_plugin(
    plugin: &Path,
    command: &str,
    container_id: &str,
    netconf: &Value,
    env: &Env,
) -> Result<PluginRun, CtlError> {
    let input = serde_json::to_vec(netconf)
        .map_err(|e| CtlError::failed(format!("internal error: cannot encode netconf: {e}")))?;
    let path = env
        .get("PATH")
        .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    let cni_args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME={container_id}");
    let call = PluginCall {
        plugin,
        command,
        container_id,
        extra_env: &[("PATH", path), ("CNI_ARGS", &cni_args)],
    };
    let output = plugin_call::run_plugin(&call, &input, Some(PLUGIN_TIMEOUT))
        .await
        .map_err(|e| match e {
            PluginCallError::TimedOut(_) => CtlError::failed(format!(
                "the plugin did not finish {command} for {container_id} within {} s",
                PLUGIN_TIMEOUT.as_secs()
            )),
            PluginCallError::Spawn(e) => {
                CtlError::failed(format!("cannot run the plugin {}: {e}", plugin.display()))
            }
            PluginCallError::Wait(e) => CtlError::failed(format!("cannot run the plugin: {e}")),
        })?;
    Ok(PluginRun {
        success: output.status.success(),
        status: match output.status.code() {
            Some(code) => format!("status {code}"),
            None => output.status.to_string(),
        },
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// The addresses of a CNI result.
fn result_addresses(result: &Value) -> Result<Vec<IpNet>, String> {
    let ips = result
        .get("ips")
        .and_then(Value::as_array)
        .ok_or("the result has no \"ips\" list")?;
    if ips.is_empty() {
        return Err("the result's \"ips\" list is empty".to_owned());
    }
    ips.iter()
        .map(|ip| {
            let text = ip
                .get("address")
                .and_then(Value::as_str)
                .ok_or("an \"ips\" entry has no \"address\"")?;
            text.parse::<IpNet>()
                .map_err(|e| format!("address {text:?} is not an address with a prefix: {e}"))
        })
        .collect()
}

/// `demo`.
///
/// # Errors
/// [`CtlError::Failed`] when the plugin is missing, a step fails, or the end state is wrong.
pub async fn run(
    ctx: &mut Ctx<'_>,
    args: &DemoArgs,
    env: &Env,
    lock_wait: Duration,
) -> Result<Outcome, CtlError> {
    let plugin = find_plugin(args, env)?;
    std::fs::create_dir_all(&args.dir).map_err(|e| {
        CtlError::failed(format!(
            "cannot create the demo directory {}: {e}",
            args.dir.display()
        ))
    })?;
    let dir = std::fs::canonicalize(&args.dir)
        .map_err(|e| CtlError::failed(format!("cannot resolve {}: {e}", args.dir.display())))?;
    let store_path = dir.join("store.sled");
    let lock_path = dir.join("ipam.lock");
    let store = DatastoreSettings {
        backend: Backend::Sled {
            path: Some(store_path.clone()),
        },
        lock_wait,
        ..DatastoreSettings::default()
    };
    ctx.say(&format!(
        "blockipam demo\n  store:  {}\n  plugin: {}\n",
        store.describe(),
        plugin.display()
    ));

    // Prepare: a pool, and no leftovers from an earlier run that stopped half-way.
    let (pools, created_pool, released_leftovers) = prepare(&store).await?;
    let pool_names: Vec<String> = pools
        .iter()
        .map(|p| format!("{} ({}, /{} blocks)", p.name, p.cidr, p.block_size))
        .collect();
    if created_pool {
        ctx.say(&format!("Created pool {}.", pool_names.join(", ")));
    } else {
        ctx.say(&format!(
            "Using the store's pools: {}.",
            pool_names.join(", ")
        ));
    }
    if released_leftovers > 0 {
        ctx.say(&format!(
            "Released {released_leftovers} addresses left by an earlier run that stopped half-way."
        ));
    }

    let nodes: Vec<String> = (1..=args.nodes).map(|n| format!("node-{n}")).collect();
    let mut containers: Vec<ContainerJson> = Vec::new();
    for c in 1..=args.containers_per_node {
        for node in &nodes {
            containers.push(ContainerJson {
                container_id: format!("demo-{node}-{c}"),
                node: node.clone(),
                address: None,
                result: None,
                deleted: false,
            });
        }
    }

    let mut failures: Vec<String> = Vec::new();
    ctx.say(&format!(
        "\n1. CNI ADD for {} containers on {} nodes (one plugin process per call, as a runtime runs it):",
        containers.len(),
        nodes.len()
    ));
    let mut seen: BTreeMap<IpAddr, String> = BTreeMap::new();
    let mut attempted = 0;
    for container in containers.iter_mut() {
        attempted += 1;
        let conf = netconf(&pools, &container.node, &store_path, &lock_path);
        let checked = match run_plugin(&plugin, "ADD", &container.container_id, &conf, env).await {
            Ok(run) => check_add(&run, &pools, &mut seen, &container.container_id),
            Err(e) => Err(e.to_string()),
        };
        match checked {
            Ok((addresses, result)) => {
                let shown: Vec<String> = addresses.iter().map(ToString::to_string).collect();
                ctx.say(&format!(
                    "   ADD {} on {} -> {}\n       {}",
                    container.container_id,
                    container.node,
                    shown.join(", "),
                    serde_json::to_string(&result).unwrap_or_default()
                ));
                container.address = Some(shown.join(","));
                container.result = Some(result);
            }
            Err(message) => {
                let message = format!(
                    "ADD {} on {} failed: {message}",
                    container.container_id, container.node
                );
                ctx.say(&format!("   {message}"));
                failures.push(message);
                break;
            }
        }
    }

    // The blocks while the containers exist.
    let mut blocks_after_add = Vec::new();
    if failures.is_empty() {
        ctx.say("\n2. blockipamctl show --blocks");
        let usage = read_usage(&store).await?;
        ctx.say(&indent(&format!(
            "{}\n{}",
            pools_table(&usage),
            blocks_table(&usage)
        )));
        blocks_after_add = blocks_json(&usage);
        failures.extend(check_blocks(&usage, &containers));
    }

    // Delete every container that was attempted, even after a failure.
    ctx.say(&format!("\n3. CNI DEL for {} containers:", attempted));
    for container in containers.iter_mut().take(attempted) {
        let conf = netconf(&pools, &container.node, &store_path, &lock_path);
        let outcome = match run_plugin(&plugin, "DEL", &container.container_id, &conf, env).await {
            Ok(run) if run.success => Ok(()),
            Ok(run) => Err(format!(
                "the plugin exited with {}: {}",
                run.status,
                run.explanation()
            )),
            Err(e) => Err(e.to_string()),
        };
        match outcome {
            Ok(()) => {
                container.deleted = true;
                ctx.say(&format!(
                    "   DEL {} on {} -> released",
                    container.container_id, container.node
                ));
            }
            Err(reason) => {
                let message = format!(
                    "DEL {} on {} failed: {reason}",
                    container.container_id, container.node
                );
                ctx.say(&format!("   {message}"));
                failures.push(message);
            }
        }
    }

    // The end state: every pool empty, the store consistent.
    ctx.say("\n4. blockipamctl show --blocks");
    let (usage, problems) = {
        let ipam = Ipam::new(settings::open(&store, OpenMode::Existing).await?);
        (ipam.utilization().await?, ipam.check(false).await?.problems)
    };
    ctx.say(&indent(&format!(
        "{}\n{}",
        pools_table(&usage),
        blocks_table(&usage)
    )));
    if !blocks_json(&usage).is_empty() {
        ctx.say(
            "   (Empty blocks stay affine to their node, as in Calico, ready for its next pods; \
             `blockipamctl node release NODE` returns a retired node's blocks.)",
        );
    }
    let in_use: u64 = usage.pools.iter().map(|p| p.in_use).sum();
    if in_use > 0 {
        failures.push(format!(
            "{in_use} addresses are still allocated after every DEL"
        ));
    }
    if let Some(first) = problems.first() {
        failures.push(format!(
            "the store's check found {} after the demo (first: {}: {})",
            counted(problems.len() as u64, "problem", "problems"),
            first.kind,
            first.detail
        ));
    }

    if let Some(first) = failures.first() {
        return Err(CtlError::failed(format!(
            "demo failed: {first}{}",
            if failures.len() > 1 {
                format!(" (and {} more problems, listed above)", failures.len() - 1)
            } else {
                String::new()
            }
        )));
    }
    ctx.say(&format!(
        "\nDemo OK: {} containers on {} nodes got {} distinct addresses, each from a block affine to \
         its node, and gave them back; the pool is empty again and the store's check is clean.",
        containers.len(),
        nodes.len(),
        seen.len()
    ));
    let json = DemoJson {
        dir: dir.display().to_string(),
        store: store.describe(),
        plugin: plugin.display().to_string(),
        created_pool,
        released_leftovers,
        pools: pools.iter().map(PoolJson::from).collect(),
        containers,
        blocks_after_add,
        pools_after_del: pools_json(&usage),
        ok: true,
    };
    Ok(Outcome::ok(to_json(&json)?, String::new()))
}

/// Opens the demo store, makes sure a pool exists, releases leftovers, and closes the store again.
async fn prepare(store: &DatastoreSettings) -> Result<(Vec<Pool>, bool, usize), CtlError> {
    let ipam = Ipam::new(settings::open(store, OpenMode::Create).await?);
    let mut created = false;
    if ipam.list_pools().await?.is_empty() {
        let cidr = DEMO_POOL_CIDR
            .parse::<IpNet>()
            .map_err(|e| CtlError::failed(format!("internal error: demo pool CIDR: {e}")))?;
        ipam.create_pool(&PoolSpec {
            cidr,
            name: Some(DEMO_POOL_NAME.to_owned()),
            block_size: Some(DEMO_BLOCK_SIZE),
            disabled: false,
        })
        .await?;
        created = true;
    }
    let pools: Vec<Pool> = ipam
        .list_pools()
        .await?
        .into_iter()
        .filter(|p| !p.disabled)
        .collect();
    if pools.is_empty() {
        return Err(CtlError::failed(format!(
            "every pool in the demo store ({}) is disabled: enable one with `blockipamctl \
             --datastore-path {} pool enable NAME`",
            store.describe(),
            store.resolved_path().unwrap_or_default().display()
        )));
    }
    let mut handles: Vec<String> = ipam
        .list_allocations()
        .await?
        .into_iter()
        .map(|a| a.handle)
        .collect();
    handles.sort();
    handles.dedup();
    let mut released = 0;
    for handle in handles {
        released += ipam.release_handle(&handle).await?.len();
    }
    Ok((pools, created, released))
}

async fn read_usage(store: &DatastoreSettings) -> Result<Utilization, CtlError> {
    let ipam = Ipam::new(settings::open(store, OpenMode::Existing).await?);
    Ok(ipam.utilization().await?)
}

/// Judges one ADD: success, a parseable result, addresses inside a pool and not handed out before.
fn check_add(
    run: &PluginRun,
    pools: &[Pool],
    seen: &mut BTreeMap<IpAddr, String>,
    container_id: &str,
) -> Result<(Vec<IpNet>, Value), String> {
    if !run.success {
        return Err(format!(
            "the plugin exited with {}: {}",
            run.status,
            run.explanation()
        ));
    }
    let result: Value = serde_json::from_str(run.stdout.trim()).map_err(|e| {
        format!(
            "the plugin's output is not a CNI result ({e}): {}",
            one_line(&run.stdout)
        )
    })?;
    let addresses = result_addresses(&result)?;
    for address in &addresses {
        let ip = address.addr();
        if !pools.iter().any(|p| p.cidr.contains(&ip)) {
            return Err(format!("address {address} lies in none of the demo pools"));
        }
        if let Some(holder) = seen.get(&ip) {
            return Err(format!(
                "address {address} was already handed to container {holder}"
            ));
        }
        seen.insert(ip, container_id.to_owned());
    }
    Ok((addresses, result))
}

/// While the containers exist: one allocated address per address handed out, each in a block
/// affine to its container's node.
fn check_blocks(usage: &Utilization, containers: &[ContainerJson]) -> Vec<String> {
    let mut failures = Vec::new();
    let blocks: Vec<&ipam_core::BlockUsage> = usage
        .pools
        .iter()
        .flat_map(|p| p.blocks.iter())
        .chain(usage.orphan_blocks.iter())
        .collect();
    let in_use: u64 = blocks.iter().map(|b| b.in_use).sum();
    let mut handed_out = 0u64;
    for container in containers {
        let Some(addresses) = &container.address else {
            continue;
        };
        for address in addresses.split(',') {
            handed_out += 1;
            let Ok(net) = address.parse::<IpNet>() else {
                continue;
            };
            let ip = net.addr();
            match blocks.iter().find(|b| b.cidr.contains(&ip)) {
                None => failures.push(format!("no block holds {ip}")),
                Some(b) if b.host.as_deref() != Some(container.node.as_str()) => {
                    failures.push(format!(
                        "{ip} of {} on {} lies in block {} affine to {:?}",
                        container.container_id, container.node, b.cidr, b.host
                    ))
                }
                Some(_) => {}
            }
        }
    }
    if in_use != handed_out {
        failures.push(format!(
            "the store holds {in_use} allocated addresses, the plugin handed out {handed_out}"
        ));
    }
    failures
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| {
            if l.is_empty() {
                String::new()
            } else {
                format!("   {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> Pool {
        Pool {
            name: "demo".into(),
            cidr: "10.77.0.0/16".parse().expect("cidr"),
            block_size: 26,
            disabled: false,
            ..Pool::default()
        }
    }

    fn ok_run(stdout: &str) -> PluginRun {
        PluginRun {
            success: true,
            status: "status 0".into(),
            stdout: stdout.into(),
            stderr: String::new(),
        }
    }

    #[test]
    fn netconf_names_the_store_lock_node_and_pools() {
        let conf = netconf(
            &[pool()],
            "node-2",
            Path::new("/d/store.sled"),
            Path::new("/d/ipam.lock"),
        );
        assert_eq!(conf["cniVersion"], "1.0.0");
        assert_eq!(conf["name"], NETWORK_NAME);
        assert_eq!(conf["ipam"]["type"], "blockipam");
        assert_eq!(conf["ipam"]["datastore_type"], "sled");
        assert_eq!(conf["ipam"]["datastore_path"], "/d/store.sled");
        assert_eq!(conf["ipam"]["ipam_lock_file"], "/d/ipam.lock");
        assert_eq!(conf["ipam"]["nodename"], "node-2");
        assert_eq!(conf["ipam"]["pools"][0]["cidr"], "10.77.0.0/16");
        assert_eq!(conf["ipam"]["pools"][0]["block_size"], 26);
    }

    #[test]
    fn an_add_result_with_a_fresh_address_in_the_pool_is_accepted() {
        let mut seen = BTreeMap::new();
        let run = ok_run(r#"{"cniVersion":"1.0.0","ips":[{"address":"10.77.3.4/26"}]}"#);
        let (addresses, _) = check_add(&run, &[pool()], &mut seen, "c1").expect("accepted");
        assert_eq!(
            addresses,
            vec!["10.77.3.4/26".parse::<IpNet>().expect("net")]
        );
    }

    #[test]
    fn an_address_handed_out_twice_is_a_failure() {
        let mut seen = BTreeMap::new();
        let run = ok_run(r#"{"cniVersion":"1.0.0","ips":[{"address":"10.77.3.4/26"}]}"#);
        check_add(&run, &[pool()], &mut seen, "c1").expect("first");
        let err = check_add(&run, &[pool()], &mut seen, "c2").expect_err("duplicate");
        assert!(err.contains("already handed to container c1"), "{err}");
    }

    #[test]
    fn results_outside_the_pool_or_without_addresses_are_failures() {
        let mut seen = BTreeMap::new();
        let outside = ok_run(r#"{"ips":[{"address":"192.168.0.1/24"}]}"#);
        assert!(check_add(&outside, &[pool()], &mut seen, "c").is_err());
        let empty = ok_run(r#"{"ips":[]}"#);
        assert!(check_add(&empty, &[pool()], &mut seen, "c").is_err());
        let garbage = ok_run("not json");
        assert!(check_add(&garbage, &[pool()], &mut seen, "c").is_err());
    }

    #[test]
    fn a_cni_error_is_explained_with_its_message_and_code() {
        let run = PluginRun {
            success: false,
            status: "status 1".into(),
            stdout: r#"{"cniVersion":"1.0.0","code":11,"msg":"no free address","details":"pool demo is full"}"#.into(),
            stderr: String::new(),
        };
        assert_eq!(
            run.explanation(),
            "no free address: pool demo is full (CNI error code 11)"
        );
    }

    fn failed_run(stdout: &str, stderr: &str) -> PluginRun {
        PluginRun {
            success: false,
            status: "status 2".into(),
            stdout: stdout.into(),
            stderr: stderr.into(),
        }
    }

    #[test]
    fn output_that_is_no_cni_error_is_explained_by_stderr_else_stdout_on_one_line() {
        assert_eq!(failed_run("", "").explanation(), "no output");
        assert_eq!(
            failed_run("printed", "went\nwrong").explanation(),
            "went wrong"
        );
        assert_eq!(failed_run("printed", " \n").explanation(), "printed");
        assert_eq!(
            failed_run(r#"{"code":1}"#, "").explanation(),
            r#"{"code":1}"#
        );
    }

    #[test]
    fn an_explanation_is_cut_after_400_characters() {
        let exactly = "é".repeat(400);
        assert_eq!(failed_run("", &exactly).explanation(), exactly);
        let longer = "é".repeat(401);
        assert_eq!(
            failed_run("", &longer).explanation(),
            format!("{exactly}...")
        );
    }

    #[test]
    fn indent_shifts_every_text_line_and_leaves_blank_lines_empty() {
        assert_eq!(indent("POOL  CIDR\n\nBLOCK"), "   POOL  CIDR\n\n   BLOCK");
        assert_eq!(indent(""), "");
    }
}
