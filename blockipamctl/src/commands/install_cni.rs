//! `install-cni`: installs the plugin binary and a conflist into a node's CNI directories, as the
//! container image's init container does: everything is read and checked first, then each file is
//! replaced atomically (temporary file, fsync, rename) and only when its contents or mode differ.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use blockipam_store::Backend;
use ipam_core::dead_nodes::validate_node;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::cli::{self, GlobalArgs, InstallCniArgs};
use crate::commands::pool::invalid_text;
use crate::commands::to_json;
use crate::error::CtlError;
use crate::output::Outcome;
use crate::settings::{self, Env};

/// The plugin's file name in the CNI binary directory: runtimes find it by `ipam.type`.
pub const PLUGIN_FILE_NAME: &str = "blockipam";
/// Default CNI binary directory: the host's `/opt/cni/bin` mounted at `/host`.
pub const DEFAULT_BIN_DIR: &str = "/host/opt/cni/bin";
/// Default CNI network config directory: the host's `/etc/cni/net.d` mounted at `/host`.
pub const DEFAULT_CONF_DIR: &str = "/host/etc/cni/net.d";
/// Default conflist file name.
pub const DEFAULT_CONF_NAME: &str = "10-blockipam.conflist";
/// Default network name of the generated conflist.
pub const DEFAULT_NETWORK_NAME: &str = "pods";
/// Default main plugin of the generated conflist.
pub const DEFAULT_MAIN_PLUGIN: &str = "ptp";
/// Default `cniVersion` of the generated conflist.
pub const DEFAULT_CNI_VERSION: &str = "1.0.0";
/// Mode of the installed plugin.
const PLUGIN_MODE: u32 = 0o755;
/// Mode of the conflist: it may hold an etcd password, so only root reads it.
const CONFLIST_MODE: u32 = 0o600;
/// Spec versions a conflist may declare (conflists exist from 0.3.0 on).
const CONFLIST_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The ipam keys that select the store; replaced as a whole when a flag or variable selects one.
const STORE_KEYS: [&str; 9] = [
    "datastore_type",
    "datastore_path",
    "etcd_endpoints",
    "etcd_ca_cert_file",
    "etcd_cert_file",
    "etcd_key_file",
    "etcd_prefix",
    "etcd_username",
    "etcd_password",
];
/// Calico's placeholder for the node name in a template.
const NODE_NAME_PLACEHOLDER: &str = "__KUBERNETES_NODE_NAME__";

/// What happened to one installed file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct InstalledFile {
    /// Where it is.
    path: String,
    /// Whether it was written (false: it already held these bytes with this mode).
    changed: bool,
}

/// The `install-cni` JSON document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct InstallJson {
    /// The plugin binary, and where it was copied from.
    plugin: InstalledFile,
    /// The binary that was copied.
    plugin_source: String,
    /// The conflist.
    conflist: InstalledFile,
}

/// Everything `install-cni` will write, read and checked before anything is written.
#[derive(Debug)]
struct Plan {
    plugin_source: PathBuf,
    plugin_bytes: Vec<u8>,
    plugin_target: PathBuf,
    conflist_bytes: Vec<u8>,
    conflist_target: PathBuf,
}

/// A flag's value, else the first of these environment variables that is set, with its source.
fn pick(flag: Option<&str>, flag_name: &str, env: &Env, vars: &[&str]) -> Option<(String, String)> {
    if let Some(value) = flag {
        return Some((value.to_owned(), flag_name.to_owned()));
    }
    vars.iter().find_map(|var| {
        env.get(var)
            .map(|value| (value.to_owned(), (*var).to_owned()))
    })
}

fn pick_path(flag: Option<&Path>, env: &Env, var: &str, default: &str) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| env.get(var).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(default))
}

/// `install-cni`.
///
/// # Errors
/// [`CtlError::Usage`] for a bad flag, variable or template (nothing written);
/// [`CtlError::Failed`] when the plugin cannot be read, a directory is missing, or a write fails
/// (a file is either the old one or the new one, never a part).
pub fn run(global: &GlobalArgs, args: &InstallCniArgs, env: &Env) -> Result<Outcome, CtlError> {
    let plan = prepare(global, args, env)?;
    for (dir, what, flag, var) in [
        (
            plan.plugin_target.parent(),
            "CNI binary directory",
            "--bin-dir",
            cli::ENV_CNI_BIN_DIR,
        ),
        (
            plan.conflist_target.parent(),
            "CNI network config directory",
            "--conf-dir",
            cli::ENV_CNI_NET_DIR,
        ),
    ] {
        let dir = dir.unwrap_or(Path::new("."));
        if !dir.is_dir() {
            return Err(CtlError::failed(format!(
                "the {what} {} does not exist or is not a directory: mount the host's directory \
                 there, or give {flag} / {var}",
                dir.display()
            )));
        }
    }
    // The plugin first: a runtime that sees the conflist must find the plugin it names.
    let plugin_changed = install_file(&plan.plugin_target, &plan.plugin_bytes, PLUGIN_MODE)?;
    let conflist_changed =
        install_file(&plan.conflist_target, &plan.conflist_bytes, CONFLIST_MODE)?;
    let doc = InstallJson {
        plugin: InstalledFile {
            path: plan.plugin_target.display().to_string(),
            changed: plugin_changed,
        },
        plugin_source: plan.plugin_source.display().to_string(),
        conflist: InstalledFile {
            path: plan.conflist_target.display().to_string(),
            changed: conflist_changed,
        },
    };
    let plugin_line = if plugin_changed {
        format!(
            "installed the plugin {} (copied from {})",
            plan.plugin_target.display(),
            plan.plugin_source.display()
        )
    } else {
        format!("the plugin {} is up to date", plan.plugin_target.display())
    };
    let conflist_line = if conflist_changed {
        format!("installed the conflist {}", plan.conflist_target.display())
    } else {
        format!(
            "the conflist {} is up to date",
            plan.conflist_target.display()
        )
    };
    let table = format!("{plugin_line}\n{conflist_line}\n");
    Ok(Outcome::ok(to_json(&doc)?, table))
}

/// Reads and checks every input, and renders the conflist; writes nothing.
fn prepare(global: &GlobalArgs, args: &InstallCniArgs, env: &Env) -> Result<Plan, CtlError> {
    let bin_dir = pick_path(
        args.bin_dir.as_deref(),
        env,
        cli::ENV_CNI_BIN_DIR,
        DEFAULT_BIN_DIR,
    );
    let conf_dir = pick_path(
        args.conf_dir.as_deref(),
        env,
        cli::ENV_CNI_NET_DIR,
        DEFAULT_CONF_DIR,
    );
    let conf_name = match pick(
        args.conf_name.as_deref(),
        "--conf-name",
        env,
        &[cli::ENV_CNI_CONF_NAME],
    ) {
        Some((name, source)) => {
            check_conf_name(&name, &source)?;
            name
        }
        None => DEFAULT_CONF_NAME.to_owned(),
    };
    let conflist = conflist(global, args, env)?;
    let conflist_bytes = format!("{}\n", super::to_json(&conflist)?).into_bytes();
    let plugin_source = plugin_source(args, env)?;
    let plugin_bytes = fs::read(&plugin_source).map_err(|e| {
        CtlError::failed(format!(
            "cannot read the plugin {}: {e}",
            plugin_source.display()
        ))
    })?;
    if plugin_bytes.is_empty() {
        return Err(CtlError::failed(format!(
            "the plugin {} is empty: refusing to install it",
            plugin_source.display()
        )));
    }
    Ok(Plan {
        plugin_source,
        plugin_bytes,
        plugin_target: bin_dir.join(PLUGIN_FILE_NAME),
        conflist_bytes,
        conflist_target: conf_dir.join(conf_name),
    })
}

/// A conflist file name: one path component ending with `.conflist`, not hidden.
fn check_conf_name(name: &str, source: &str) -> Result<(), CtlError> {
    let stem = name.strip_suffix(".conflist").unwrap_or_default();
    if stem.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(CtlError::usage(format!(
            "invalid value {name:?} for {source}: expected a file name ending with .conflist \
             (no '/', not starting with '.'), e.g. {DEFAULT_CONF_NAME}"
        )));
    }
    Ok(())
}

/// Where the plugin binary is: `--plugin`, else `BLOCKIPAM_PLUGIN`, else `blockipam` next to the
/// running executable (as `demo` finds it); it must be a regular file.
fn plugin_source(args: &InstallCniArgs, env: &Env) -> Result<PathBuf, CtlError> {
    crate::demo::locate_plugin(args.plugin.as_deref(), env, "pass --plugin PATH")
}

/// The conflist: the template's (flag, file variable or text variable), else a generated one, with
/// the node and store settings written into every `ipam` section of type `blockipam`.
fn conflist(global: &GlobalArgs, args: &InstallCniArgs, env: &Env) -> Result<Value, CtlError> {
    let node = match pick(args.node.as_deref(), "--node", env, &cli::ENV_NODE_NAMES) {
        Some((node, source)) => {
            let node = node.trim().to_owned();
            if node.chars().any(char::is_whitespace) {
                return Err(CtlError::usage(format!(
                    "invalid value {node:?} for {source}: a node name has no whitespace"
                )));
            }
            // The name the plugin will allocate under (empty, too long, a '/' or a control
            // character, the reservations' pseudo-node): refused here, as the plugin would refuse
            // every ADD with it.
            validate_node(&node).map_err(|e| {
                CtlError::usage(format!("invalid value for {source}: {}", invalid_text(&e)))
            })?;
            Some(node)
        }
        None => None,
    };
    let ipam_keys = ipam_keys(global, args, env, node.as_deref())?;
    let (mut conflist, source) = match template(args, env)? {
        Some((text, source)) => {
            for (flag, var, value) in [
                ("--network-name", cli::ENV_NETWORK_NAME, &args.network_name),
                ("--main-plugin", cli::ENV_MAIN_PLUGIN, &args.main_plugin),
                ("--cni-version", cli::ENV_CNI_VERSION, &args.cni_version),
            ] {
                if let Some((_, given)) = pick(value.as_deref(), flag, env, &[var]) {
                    return Err(CtlError::usage(format!(
                        "{given} and {source} both set the network: give \
                         either (the template's own name, plugins and cniVersion are used)"
                    )));
                }
            }
            (parse_template(&text, &source, node.as_deref())?, source)
        }
        None => (generated(args, env)?, "the generated conflist".to_owned()),
    };
    let plugins = conflist
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| CtlError::usage(format!("{source} has no \"plugins\" list")))?;
    let mut any_blockipam = false;
    for plugin in plugins.iter_mut() {
        let Some(ipam) = plugin.get_mut("ipam").and_then(Value::as_object_mut) else {
            continue;
        };
        if ipam.get("type").and_then(Value::as_str) != Some(PLUGIN_FILE_NAME) {
            continue;
        }
        ipam_keys.apply(ipam);
        any_blockipam = true;
    }
    if !any_blockipam {
        return Err(CtlError::usage(format!(
            "{source} has no plugin whose \"ipam\" has \"type\": \"blockipam\": nothing would use \
             the plugin"
        )));
    }
    Ok(conflist)
}

/// The template's text and where it came from: `--network-config-file`, else
/// `CNI_NETWORK_CONFIG_FILE`, else `CNI_NETWORK_CONFIG`.
fn template(args: &InstallCniArgs, env: &Env) -> Result<Option<(String, String)>, CtlError> {
    let file = args
        .network_config_file
        .clone()
        .map(|path| (path, "--network-config-file"))
        .or_else(|| {
            env.get(cli::ENV_CNI_NETWORK_CONFIG_FILE)
                .map(|path| (PathBuf::from(path), cli::ENV_CNI_NETWORK_CONFIG_FILE))
        });
    if let Some((path, source)) = file {
        if env.get(cli::ENV_CNI_NETWORK_CONFIG).is_some() {
            return Err(CtlError::usage(format!(
                "both {source} and {} give a template: give one",
                cli::ENV_CNI_NETWORK_CONFIG
            )));
        }
        let text = fs::read_to_string(&path).map_err(|e| {
            CtlError::failed(format!(
                "cannot read the template {} (from {source}): {e}",
                path.display()
            ))
        })?;
        return Ok(Some((text, format!("the template {}", path.display()))));
    }
    Ok(env
        .get(cli::ENV_CNI_NETWORK_CONFIG)
        .map(|text| (text.to_owned(), cli::ENV_CNI_NETWORK_CONFIG.to_owned())))
}

/// Parses and checks a template, after putting the node name in place of Calico's placeholder.
fn parse_template(text: &str, source: &str, node: Option<&str>) -> Result<Value, CtlError> {
    let text = if text.contains(NODE_NAME_PLACEHOLDER) {
        let node = node.ok_or_else(|| {
            CtlError::usage(format!(
                "{source} uses {NODE_NAME_PLACEHOLDER} but no node name is given: give --node, \
                 NODENAME or KUBERNETES_NODE_NAME"
            ))
        })?;
        let escaped = serde_json::to_string(node)
            .map_err(|e| CtlError::failed(format!("internal error: {e}")))?;
        let escaped = &escaped[1..escaped.len() - 1];
        text.replace(NODE_NAME_PLACEHOLDER, escaped)
    } else {
        text.to_owned()
    };
    let bad = |why: String| CtlError::usage(format!("{source} is not a valid conflist: {why}"));
    let value: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let object = value
        .as_object()
        .ok_or_else(|| bad("not a JSON object".to_owned()))?;
    let name = object
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("no \"name\" string".to_owned()))?;
    check_network_name(name).map_err(bad)?;
    let version = object
        .get("cniVersion")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("no \"cniVersion\" string".to_owned()))?;
    check_cni_version(version).map_err(bad)?;
    let plugins = object
        .get("plugins")
        .and_then(Value::as_array)
        .filter(|plugins| !plugins.is_empty())
        .ok_or_else(|| bad("no \"plugins\" list, or an empty one".to_owned()))?;
    for (index, plugin) in plugins.iter().enumerate() {
        let plugin_type = plugin.get("type").and_then(Value::as_str).unwrap_or("");
        if plugin_type.is_empty() {
            return Err(bad(format!("plugins[{index}] has no \"type\" string")));
        }
        if plugin.get("ipam").is_some_and(|ipam| !ipam.is_object()) {
            return Err(bad(format!("plugins[{index}].ipam is not an object")));
        }
    }
    Ok(value)
}

/// A CNI network name: `[a-zA-Z0-9][a-zA-Z0-9_.-]*`.
fn check_network_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) {
        Ok(())
    } else {
        Err(format!(
            "network name {name:?} is not [a-zA-Z0-9][a-zA-Z0-9_.-]*"
        ))
    }
}

fn check_cni_version(version: &str) -> Result<(), String> {
    if CONFLIST_VERSIONS.contains(&version) {
        Ok(())
    } else {
        Err(format!(
            "cniVersion {version:?} is not one of {}",
            CONFLIST_VERSIONS.join(", ")
        ))
    }
}

/// The conflist made from the flags: one main plugin with a blockipam `ipam` section.
fn generated(args: &InstallCniArgs, env: &Env) -> Result<Value, CtlError> {
    let name = pick(
        args.network_name.as_deref(),
        "--network-name",
        env,
        &[cli::ENV_NETWORK_NAME],
    );
    let name = match name {
        Some((name, source)) => {
            check_network_name(&name)
                .map_err(|e| CtlError::usage(format!("invalid value for {source}: {e}")))?;
            name
        }
        None => DEFAULT_NETWORK_NAME.to_owned(),
    };
    let main_plugin = match pick(
        args.main_plugin.as_deref(),
        "--main-plugin",
        env,
        &[cli::ENV_MAIN_PLUGIN],
    ) {
        Some((plugin, source)) => {
            if plugin.is_empty()
                || !plugin
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            {
                return Err(CtlError::usage(format!(
                    "invalid value {plugin:?} for {source}: expected a plugin type such as ptp or \
                     bridge"
                )));
            }
            plugin
        }
        None => DEFAULT_MAIN_PLUGIN.to_owned(),
    };
    let version = match pick(
        args.cni_version.as_deref(),
        "--cni-version",
        env,
        &[cli::ENV_CNI_VERSION],
    ) {
        Some((version, source)) => {
            check_cni_version(&version)
                .map_err(|e| CtlError::usage(format!("invalid value for {source}: {e}")))?;
            version
        }
        None => DEFAULT_CNI_VERSION.to_owned(),
    };
    Ok(serde_json::json!({
        "cniVersion": version,
        "name": name,
        "plugins": [{"type": main_plugin, "ipam": {"type": PLUGIN_FILE_NAME}}],
    }))
}

/// What is written into each blockipam `ipam` section.
#[derive(Debug, Default)]
struct IpamKeys {
    /// `--ipam-config`: set first, over the template's keys.
    extra: Map<String, Value>,
    /// The store the flags and variables select (all store keys replaced), if any store setting
    /// is given.
    store: Option<Map<String, Value>>,
    /// `agent_socket`, `ipam_lock_timeout_seconds`, `nodename`, when given.
    others: Map<String, Value>,
}

impl IpamKeys {
    fn apply(&self, ipam: &mut Map<String, Value>) {
        for (key, value) in &self.extra {
            ipam.insert(key.clone(), value.clone());
        }
        if let Some(store) = &self.store {
            for key in STORE_KEYS {
                ipam.remove(key);
            }
            for (key, value) in store {
                ipam.insert(key.clone(), value.clone());
            }
        }
        for (key, value) in &self.others {
            ipam.insert(key.clone(), value.clone());
        }
    }
}

/// The ipam keys from `--ipam-config`, the store flags and variables blockipamctl reads, and the
/// node name; checked as blockipamctl checks them for its own use.
fn ipam_keys(
    global: &GlobalArgs,
    args: &InstallCniArgs,
    env: &Env,
    node: Option<&str>,
) -> Result<IpamKeys, CtlError> {
    let mut keys = IpamKeys::default();
    if let Some((text, source)) = pick(
        args.ipam_config.as_deref(),
        "--ipam-config",
        env,
        &[cli::ENV_IPAM_CONFIG],
    ) {
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| CtlError::usage(format!("invalid JSON for {source}: {e}")))?;
        let Value::Object(extra) = value else {
            return Err(CtlError::usage(format!(
                "invalid value for {source}: expected a JSON object of ipam keys"
            )));
        };
        if extra.contains_key("type") {
            return Err(CtlError::usage(format!(
                "{source} sets \"type\": the ipam type is always blockipam"
            )));
        }
        keys.extra = extra;
    }
    // Validated exactly as every other command validates them (usage errors name the source).
    let settings = settings::resolve(global, env)?;
    let store_given = [
        (global.datastore_type.is_some(), cli::ENV_DATASTORE_TYPE),
        (global.datastore_path.is_some(), cli::ENV_DATASTORE_PATH),
        (global.etcd_endpoints.is_some(), cli::ENV_ETCD_ENDPOINTS),
        (
            global.etcd_ca_cert_file.is_some(),
            cli::ENV_ETCD_CA_CERT_FILE,
        ),
        (global.etcd_cert_file.is_some(), cli::ENV_ETCD_CERT_FILE),
        (global.etcd_key_file.is_some(), cli::ENV_ETCD_KEY_FILE),
        (global.etcd_prefix.is_some(), cli::ENV_ETCD_PREFIX),
        (global.etcd_username.is_some(), cli::ENV_ETCD_USERNAME),
        (global.etcd_password.is_some(), cli::ENV_ETCD_PASSWORD),
    ]
    .iter()
    .any(|(flag, var)| *flag || env.get(var).is_some());
    if store_given {
        let mut store = Map::new();
        store.insert(
            "datastore_type".to_owned(),
            Value::from(settings.datastore_type().to_string()),
        );
        let path_text = |path: &Path| Value::from(path.display().to_string());
        match &settings.backend {
            Backend::Sled { path } | Backend::Redb { path } => {
                if let Some(path) = path {
                    store.insert("datastore_path".to_owned(), path_text(path));
                }
            }
            Backend::Etcd(etcd) => {
                // What opening the store checks, but the TLS files: they are the node's paths,
                // which this (init) container may not see.
                etcd.config()
                    .and_then(|config| config.validate_without_reading_files())
                    .map_err(|e| CtlError::usage(format!("invalid etcd settings: {e}")))?;
                store.insert(
                    "etcd_endpoints".to_owned(),
                    Value::from(etcd.endpoints.join(",")),
                );
                let files = [
                    ("etcd_ca_cert_file", &etcd.ca_cert_file),
                    ("etcd_cert_file", &etcd.cert_file),
                    ("etcd_key_file", &etcd.key_file),
                ];
                for (key, file) in files {
                    if let Some(file) = file {
                        store.insert(key.to_owned(), path_text(file));
                    }
                }
                if let Some(prefix) = &etcd.prefix {
                    store.insert("etcd_prefix".to_owned(), Value::from(prefix.clone()));
                }
                if let Some(username) = &etcd.username {
                    store.insert("etcd_username".to_owned(), Value::from(username.clone()));
                }
                if let Some(password) = &etcd.password {
                    // The conflist is written 0600 (root only), as docs/cni.md asks of a
                    // netconf holding a password.
                    store.insert(
                        "etcd_password".to_owned(),
                        Value::from(password.expose().to_owned()),
                    );
                }
            }
        }
        keys.store = Some(store);
    }
    if let Some((text, _)) = pick(
        global.agent_socket.as_deref(),
        "--agent-socket",
        env,
        &[cli::ENV_AGENT_SOCKET],
    ) {
        keys.others
            .insert("agent_socket".to_owned(), Value::from(text));
    }
    if global.lock_wait_seconds.is_some() || env.get(cli::ENV_LOCK_WAIT_SECONDS).is_some() {
        let seconds = settings.lock_wait.as_secs_f64();
        let value = if settings.lock_wait.subsec_nanos() == 0 {
            Value::from(settings.lock_wait.as_secs())
        } else {
            Value::from(seconds)
        };
        keys.others
            .insert("ipam_lock_timeout_seconds".to_owned(), value);
    }
    if let Some(node) = node {
        keys.others
            .insert("nodename".to_owned(), Value::from(node.to_owned()));
    }
    Ok(keys)
}

/// Makes `target` hold exactly `contents` with `mode`: nothing is written when it already does
/// (its mtime stays); else a temporary file beside it is written, synced, given `mode` and renamed
/// over it, and the directory is synced, so that a reader sees the old file or the new one, never
/// a part. Returns whether it wrote.
fn install_file(target: &Path, contents: &[u8], mode: u32) -> Result<bool, CtlError> {
    if already_installed(target, contents, mode) {
        return Ok(false);
    }
    let dir = target.parent().unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temporary = dir.join(format!(".{name}.install-{}", std::process::id()));
    let written = write_and_rename(&temporary, target, contents, mode);
    if let Err(e) = written {
        let _ = fs::remove_file(&temporary);
        return Err(CtlError::failed(format!(
            "cannot install {}: {e} (the previous file, if any, is unchanged)",
            target.display()
        )));
    }
    // The rename is durable once the directory entry is: a crash now leaves the new file.
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| {
            CtlError::failed(format!(
                "installed {} but cannot sync its directory: {e}",
                target.display()
            ))
        })?;
    Ok(true)
}

fn write_and_rename(
    temporary: &Path,
    target: &Path,
    contents: &[u8],
    mode: u32,
) -> std::io::Result<()> {
    // A temporary file of a crashed run with the same process id is ours to replace.
    let _ = fs::remove_file(temporary);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(temporary)?;
    file.write_all(contents)?;
    file.sync_all()?;
    file.set_permissions(fs::Permissions::from_mode(mode))?;
    drop(file);
    fs::rename(temporary, target)
}

/// Whether `target` is a regular file with exactly these bytes and this mode.
fn already_installed(target: &Path, contents: &[u8], mode: u32) -> bool {
    let Ok(meta) = fs::symlink_metadata(target) else {
        return false;
    };
    meta.is_file()
        && meta.permissions().mode() & 0o7777 == mode
        && meta.len() == contents.len() as u64
        && fs::read(target).is_ok_and(|existing| existing == contents)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflist_names_must_be_plain_conflist_file_names() {
        for good in ["10-blockipam.conflist", "pods.conflist"] {
            assert!(check_conf_name(good, "--conf-name").is_ok(), "{good}");
        }
        for bad in ["", ".conflist", "a/b.conflist", ".x.conflist", "pods.conf"] {
            assert!(
                matches!(check_conf_name(bad, "--conf-name"), Err(CtlError::Usage(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_node_placeholder_is_replaced_as_json_text() {
        let template = r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"ptp","ipam":{"type":"blockipam","nodename":"__KUBERNETES_NODE_NAME__"}}]}"#;
        let value = parse_template(template, "t", Some("node-\"1\"")).expect("template");
        assert_eq!(value["plugins"][0]["ipam"]["nodename"], "node-\"1\"");
        assert!(matches!(
            parse_template(template, "t", None),
            Err(CtlError::Usage(m)) if m.contains("NODENAME")
        ));
    }
}
