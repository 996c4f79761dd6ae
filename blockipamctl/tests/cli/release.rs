//! `release --ip ... | --handle ...` on every backend.

use serde_json::json;

use crate::common::{Backend, Lab};

crate::on_every_backend!(release_frees_addresses_by_ip_and_by_handle_and_reports_the_rest);

fn release_frees_addresses_by_ip_and_by_handle_and_reports_the_rest(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.30.0.0/24"]).ok();
    let a = lab.assign("net.a", "host-a").to_string();
    let b = lab.assign("net.b", "host-a").to_string();
    let c = lab.assign("net.c", "host-b").to_string();

    let released = lab.ctl(&[
        "-o",
        "json",
        "release",
        "--ip",
        &a,
        "10.30.0.250",
        "--ip",
        &a,
    ]);
    assert_eq!(
        released.ok().json(),
        json!({"released": [a], "not_allocated": ["10.30.0.250"]}),
        "a repeated address counts once"
    );
    assert_eq!(
        lab.ctl(&["-o", "json", "show", "--ip", &a]).ok().json()["allocated"],
        false
    );

    lab.ctl(&["release", "--ip", &b])
        .ok()
        .stdout_has(&format!("Released 1 address: {b}"));
    lab.ctl(&["release", "--ip", &b])
        .ok()
        .stdout_has(&format!("Not allocated (nothing to do): {b}"));

    let by_handle = lab.ctl(&["-o", "json", "release", "--handle", "net.c"]);
    assert_eq!(
        by_handle.ok().json(),
        json!({"handle": "net.c", "released": [c], "not_allocated": []})
    );
    lab.ctl(&["release", "--handle", "net.unknown"])
        .ok()
        .stdout_has("held no addresses");

    let shown = lab.ctl(&["-o", "json", "show"]).ok().json();
    assert_eq!(shown["pools"][0]["in_use"], 0);
    lab.ctl(&["check"]).ok();
}
