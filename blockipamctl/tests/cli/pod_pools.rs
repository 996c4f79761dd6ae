//! Which pools a pod's address comes from, in Calico's order, through the real plugin on every
//! backend: the pod's `cni.projectcalico.org/ipv4pools` annotation (from the pod-annotations
//! capability in `runtimeConfig`), then its namespace's pools (`blockipamctl namespace pools`),
//! then the netconf's `ipv4_pools`; `ipAddrs` for specific addresses; malformed annotations
//! refused with code 7, changing nothing.

use serde_json::{json, Value};

use crate::common::{Backend, Lab};
use crate::on_every_backend;

/// `runtimeConfig` carrying these pod annotations.
fn annotated(annotations: Value) -> Value {
    json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": annotations}})
}

/// The IPv4 address an ADD of `container` in `namespace` got, or the error it answered.
fn add(lab: &Lab, namespace: &str, container: &str, top: Value) -> Result<String, Value> {
    let (status, result) = lab.plugin_in(
        namespace,
        "1.0.0",
        "ADD",
        "n1",
        container,
        json!({"ipv4_pools": ["from-netconf"]}),
        top,
    );
    if status != 0 {
        return Err(result);
    }
    Ok(result["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .split('/')
        .next()
        .expect("address")
        .to_owned())
}

fn pods_get_pools_in_calicos_order(backend: Backend) {
    let lab = Lab::new(backend);
    for (cidr, name) in [
        ("10.40.0.0/24", "from-netconf"),
        ("10.41.0.0/24", "from-namespace"),
        ("10.42.0.0/24", "from-annotation"),
    ] {
        lab.ctl(&["pool", "add", cidr, "--name", name, "--block-size", "28"])
            .ok();
    }
    // No annotation, no namespace setting: the netconf's pool.
    let plain = add(&lab, "team-a", "p1", Value::Null).expect("plain ADD");
    assert!(plain.starts_with("10.40.0."), "{plain}");

    // The namespace's pools win over the netconf's.
    lab.ctl(&["namespace", "pools", "team-a", "--ipv4", "from-namespace"])
        .ok();
    let shown = lab
        .ctl(&["-o", "json", "namespace", "pools", "team-a"])
        .ok()
        .json();
    assert_eq!(shown["ipv4_pools"], json!(["from-namespace"]));
    let in_namespace = add(&lab, "team-a", "p2", Value::Null).expect("namespace ADD");
    assert!(in_namespace.starts_with("10.41.0."), "{in_namespace}");
    // Another namespace is not affected.
    let elsewhere = add(&lab, "team-b", "p3", Value::Null).expect("other namespace ADD");
    assert!(elsewhere.starts_with("10.40.0."), "{elsewhere}");

    // The pod's annotation wins over both (a CIDR works as a name).
    let pod = add(
        &lab,
        "team-a",
        "p4",
        annotated(json!({"cni.projectcalico.org/ipv4pools": "[\"10.42.0.0/24\"]"})),
    )
    .expect("annotated ADD");
    assert!(pod.starts_with("10.42.0."), "{pod}");
    // ipAddrs: exactly that address.
    let exact = add(
        &lab,
        "team-a",
        "p5",
        annotated(json!({"cni.projectcalico.org/ipAddrs": "[\"10.42.0.77\"]"})),
    )
    .expect("ipAddrs ADD");
    assert_eq!(exact, "10.42.0.77");

    // Bad annotations: code 7 (or 105 for an unknown pool), and nothing written.
    let before = lab.snapshot();
    for (annotations, code) in [
        (
            json!({"cni.projectcalico.org/ipv4pools": "[from-annotation"}),
            7,
        ),
        (json!({"cni.projectcalico.org/ipv4pools": "{\"a\": 1}"}), 7),
        (
            json!({"cni.projectcalico.org/ipAddrs": "[\"10.42.0.300\"]"}),
            7,
        ),
        (
            json!({"cni.projectcalico.org/ipAddrs": "[\"10.42.0.78\"]",
                   "cni.projectcalico.org/ipv4pools": "[\"from-annotation\"]"}),
            7,
        ),
        (
            json!({"cni.projectcalico.org/ipv4pools": "[\"no-such-pool\"]"}),
            105,
        ),
    ] {
        let error = add(&lab, "team-a", "bad", annotated(annotations.clone()))
            .expect_err("a bad annotation must fail");
        assert_eq!(error["code"], code, "{annotations}: {error}");
    }
    assert_eq!(lab.snapshot(), before, "a refused ADD wrote something");

    // A namespace's pool that cannot be used (disabled since): code 105 naming the namespace and
    // where its setting is, and nothing written.
    let disabled = lab
        .ctl(&["-o", "json", "pool", "disable", "from-namespace"])
        .ok()
        .json();
    assert_eq!(
        disabled["named_by_namespaces"],
        json!(["team-a"]),
        "{disabled}"
    );
    assert_eq!(disabled["disabled"], json!(true), "{disabled}");
    let shown = lab
        .ctl(&["-o", "json", "namespace", "pools", "team-a"])
        .ok()
        .json();
    assert_eq!(
        shown["unusable_pools"],
        json!([{"family": "ipv4", "pool": "from-namespace",
                "reason": "IP pool \"from-namespace\" is disabled"}]),
        "{shown}"
    );
    let before = lab.snapshot();
    let error = add(&lab, "team-a", "p-disabled", Value::Null).expect_err("disabled pool");
    assert_eq!(error["code"], 105, "{error}");
    let msg = error["msg"].as_str().expect("msg");
    assert!(
        msg.contains("namespace \"team-a\"")
            && msg.contains("blockipamctl namespace pools team-a")
            && msg.contains("\"from-namespace\" is disabled"),
        "{msg}"
    );
    assert_eq!(lab.snapshot(), before, "a refused ADD wrote something");
    lab.ctl(&["pool", "enable", "from-namespace"]).ok();
    let shown = lab
        .ctl(&["-o", "json", "namespace", "pools", "team-a"])
        .ok()
        .json();
    assert_eq!(shown["unusable_pools"], json!([]), "{shown}");

    // Deleting a pool a namespace names (here by its CIDR) says which namespaces are left naming
    // it, and the namespace's setting says that pool is gone.
    lab.ctl(&["pool", "add", "10.43.0.0/24", "--name", "doomed"])
        .ok();
    lab.ctl(&["namespace", "pools", "team-c", "--ipv4", "10.43.0.0/24"])
        .ok();
    let deleted = lab.ctl(&["pool", "delete", "doomed"]);
    deleted.ok();
    assert!(
        deleted
            .stdout
            .contains("Namespaces whose pools setting names it: team-c."),
        "{}",
        deleted.stdout
    );
    let shown = lab.ctl(&["namespace", "pools", "team-c"]);
    shown
        .ok()
        .stdout_has("Namespace team-c: IPv4 pools 10.43.0.0/24; IPv6 pools the netconf's.\n")
        .stdout_has("Its pods' ADDs fail (error 105) while it names pools they cannot use:\n");
    assert!(
        shown
            .stdout
            .contains("IPv4 10.43.0.0/24: no IP pool named or with CIDR \"10.43.0.0/24\""),
        "{}",
        shown.stdout
    );
    lab.ctl(&["namespace", "pools", "team-c", "--clear"]).ok();

    // Namespace settings are validated, and removable.
    lab.ctl(&["namespace", "pools", "team-a", "--ipv4", "no-such-pool"])
        .expect_code(1);
    lab.ctl(&["namespace", "pools", "Team_A", "--ipv4", "from-namespace"])
        .expect_code(2);
    lab.ctl(&["namespace", "pools", "team-a", "--clear"]).ok();
    let cleared = add(&lab, "team-a", "p6", Value::Null).expect("ADD after clear");
    assert!(cleared.starts_with("10.40.0."), "{cleared}");
    lab.ctl(&["check"]).ok();
}

on_every_backend!(pods_get_pools_in_calicos_order);
