//! `config show|set` on every backend.

use serde_json::json;

use crate::common::{assert_columns_line_up, Backend, Lab};

crate::on_every_backend!(config_show_prints_defaults_and_set_changes_only_the_given_settings);

fn config_show_prints_defaults_and_set_changes_only_the_given_settings(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.12.0.0/16"]).ok();

    let shown = lab.ctl(&["-o", "json", "config", "show"]).ok().json();
    assert_eq!(
        shown,
        json!({"strict_affinity": false, "auto_allocate_blocks": true, "max_blocks_per_host": 20,
               "ip_cooldown_seconds": 0, "empty_block_reclaim_seconds": 60})
    );
    let table = lab.ctl(&["config", "show"]);
    table.ok().stdout_has("max_blocks_per_host          20");
    assert_columns_line_up(&table.stdout);

    let set = lab.ctl(&["-o", "json", "config", "set", "--max-blocks-per-host", "0"]);
    assert_eq!(
        set.ok().json(),
        json!({"strict_affinity": false, "auto_allocate_blocks": true, "max_blocks_per_host": 0,
               "ip_cooldown_seconds": 0, "empty_block_reclaim_seconds": 60})
    );
    lab.ctl(&["config", "show"])
        .ok()
        .stdout_has("0 (unlimited)");

    let set = lab.ctl(&[
        "config",
        "set",
        "--strict-affinity",
        "true",
        "--auto-allocate-blocks",
        "no",
    ]);
    set.ok().stdout_has("IPAM configuration updated:");
    let shown = lab.ctl(&["-o", "json", "config", "show"]).ok().json();
    assert_eq!(
        shown,
        json!({"strict_affinity": true, "auto_allocate_blocks": false, "max_blocks_per_host": 0,
               "ip_cooldown_seconds": 0, "empty_block_reclaim_seconds": 60}),
        "settings not named keep their value"
    );
    let config = lab.with_ipam(|ipam| async move { ipam.get_config().await.expect("config") });
    assert!(config.strict_affinity && !config.auto_allocate_blocks);
    assert_eq!(config.max_blocks_per_host, 0);

    // The lifecycle settings: set, shown, kept by later changes; Calico's 1200 s cap enforced.
    lab.ctl(&[
        "config",
        "set",
        "--ip-cooldown-seconds",
        "300",
        "--empty-block-reclaim-seconds",
        "90",
    ])
    .ok();
    lab.ctl(&["config", "set", "--max-blocks-per-host", "5"])
        .ok();
    let shown = lab.ctl(&["-o", "json", "config", "show"]).ok().json();
    assert_eq!(shown["ip_cooldown_seconds"], 300, "{shown}");
    assert_eq!(shown["empty_block_reclaim_seconds"], 90, "{shown}");
    // A value out of range is a usage error (status 2), whatever the store holds.
    let refused = lab.ctl(&["config", "set", "--ip-cooldown-seconds", "1201"]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(
        refused.error_line().contains("--ip-cooldown-seconds")
            && refused.error_line().contains("1200"),
        "{refused:?}"
    );
    let shown = lab.ctl(&["-o", "json", "config", "show"]).ok().json();
    assert_eq!(
        shown["ip_cooldown_seconds"], 300,
        "a refused change wrote: {shown}"
    );
}
