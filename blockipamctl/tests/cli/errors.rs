//! Error paths: every bad input exits with the right status, says why in one line (and as JSON
//! under `-o json`), and never changes the store; unreachable etcd, a locked store, a missing
//! store and bad store selections fail cleanly; environment variables select the store.

use std::process::Stdio;
use std::time::Duration;

use crate::common::{closed_port, ctl, Backend, Lab};

crate::on_every_backend!(bad_input_fails_with_the_right_status_and_never_changes_the_store);

fn bad_input_fails_with_the_right_status_and_never_changes_the_store(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.70.0.0/16", "--name", "main"])
        .ok();
    lab.assign("net.keep", "host-a");
    let before = lab.snapshot();

    let cases: &[(&[&str], i32, &str)] = &[
        (&["pool", "add", "10.0.0.0/33"], 2, "invalid value"),
        (&["pool", "add", "not-a-cidr"], 2, "invalid value"),
        (&["pool", "add", "10.71.0.1/16"], 2, "not a network address"),
        (
            &["pool", "add", "10.71.0.0/16", "--block-size", "19"],
            2,
            "out of range",
        ),
        (
            &["pool", "add", "10.71.0.0/28", "--block-size", "26"],
            2,
            "smaller than one",
        ),
        (
            &["pool", "add", "10.71.0.0/16", "--block-size", "abc"],
            2,
            "--block-size",
        ),
        (
            &["pool", "add", "10.71.0.0/16", "--block-size", "300"],
            2,
            "--block-size",
        ),
        (&["pool", "add", "169.254.0.0/16"], 2, "link-local range"),
        (&["pool", "add", "0.0.0.0/0"], 2, "link-local range"),
        (
            &["pool", "add", "fe80::/64", "--block-size", "122"],
            2,
            "IPv6 link-local range fe80::/10",
        ),
        (
            &["pool", "add", "10.71.0.0/16", "--name", "bad name!"],
            2,
            "pool name",
        ),
        (&["pool", "add", "10.71.0.0/16", "--bogus"], 2, "--bogus"),
        (
            &["pool", "add", "10.70.8.0/24"],
            1,
            "overlaps existing pool \"main\"",
        ),
        (
            &["pool", "add", "10.72.0.0/16", "--name", "main"],
            1,
            "already exists",
        ),
        (&["pool", "enable", "nope"], 1, "no IP pool"),
        (&["pool", "disable", "10.99.0.0/16"], 1, "no IP pool"),
        (&["pool", "delete", "nope"], 1, "no IP pool"),
        (&["pool", "delete", "main"], 1, "--force"),
        (&["pool"], 2, "subcommand"),
        (&["config", "set"], 2, "required"),
        (&["config", "set", "--max-blocks-per-host", "-1"], 2, "-1"),
        (
            &["config", "set", "--max-blocks-per-host", "many"],
            2,
            "--max-blocks-per-host",
        ),
        (
            &["config", "set", "--strict-affinity", "maybe"],
            2,
            "--strict-affinity",
        ),
        (&["release"], 2, "required"),
        (&["release", "--ip", "1.2.3"], 2, "--ip"),
        (
            &["release", "--ip", "10.70.0.1", "--handle", "h"],
            2,
            "cannot be used with",
        ),
        (&["release", "--handle", "bad\u{7}handle"], 2, "handle id"),
        (&["show", "--ip", "x"], 2, "--ip"),
        (
            &["show", "--ip", "10.70.0.1", "--blocks"],
            2,
            "cannot be used with",
        ),
        (&["node", "release"], 2, "required"),
        (&["node", "release", "bad/host"], 2, "host name"),
        // The network reservations' pseudo-node: `node release - --addresses` released every
        // network's gateway, network and broadcast reservations.
        (&["node", "release", "-", "--addresses"], 2, "pseudo-node"),
        (&["node", "label", "-", "a=b"], 2, "pseudo-node"),
        (&["node", "show", "-"], 2, "pseudo-node"),
        (
            &["tunnel-address", "assign", "--type", "ipip", "-"],
            2,
            "pseudo-node",
        ),
        (
            &["migrate", "--to-datastore-type", "mysql"],
            2,
            "unknown datastore type",
        ),
        (
            &["migrate", "--to-datastore-type", "etcdv3"],
            2,
            "--to-etcd-endpoints",
        ),
        (&["demo", "--nodes", "0"], 2, "--nodes"),
        (&["frobnicate"], 2, "frobnicate"),
        (&["--output", "yaml", "show"], 2, "yaml"),
        (
            &["--lock-wait-seconds", "soon", "show"],
            2,
            "--lock-wait-seconds",
        ),
    ];
    for (args, code, needle) in cases {
        let table = lab.ctl(args);
        table.expect_code(*code);
        let line = table.error_line();
        assert!(line.contains(needle), "{args:?}: {line:?} lacks {needle:?}");
        assert!(
            table.stdout.is_empty(),
            "{args:?}: table mode prints errors on stderr only"
        );

        if args.contains(&"--output") {
            continue; // the case is about -o itself
        }
        let mut json_args = vec!["-o", "json"];
        json_args.extend_from_slice(args);
        let json = lab.ctl(&json_args);
        json.expect_code(*code);
        json.error_line();
        let doc = json.json();
        assert!(
            doc["error"].as_str().is_some_and(|m| m.contains(needle)),
            "{args:?}: {doc}"
        );
        assert_eq!(lab.snapshot(), before, "{args:?} changed the store");
    }
}

#[test]
fn usage_errors_are_exactly_one_line_on_stderr() {
    for args in [
        &["pool", "add", "10.0.0.0/33"][..],
        &["config", "set", "--max-blocks-per-host", "-1"][..],
        &["frobnicate"][..],
        &["--datastore-type", "mysql", "show"][..],
    ] {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let run = ctl(&args, &[]);
        run.expect_code(2);
        assert_eq!(run.stderr.lines().count(), 1, "{run:?}");
        assert!(run.stderr.starts_with("error: "), "{run:?}");
    }
}

#[test]
fn usage_errors_name_what_is_missing_the_usage_and_the_help_to_read() {
    for (args, expected) in [
        (
            &["pool", "add"][..],
            "error: the following required arguments were not provided: <CIDR> (usage: \
             blockipamctl pool add <CIDR>); try 'blockipamctl pool add --help'",
        ),
        (
            &["tunnel-address", "assign"][..],
            "error: the following required arguments were not provided: --type <TYPE>, <NODE> \
             (usage: blockipamctl tunnel-address assign --type <TYPE> <NODE>); try \
             'blockipamctl tunnel-address assign --help'",
        ),
        (
            &["pool"][..],
            "error: a subcommand is required (usage: blockipamctl pool [OPTIONS] <COMMAND>); try \
             'blockipamctl pool --help'",
        ),
        (
            &["shw"][..],
            "error: unrecognized subcommand 'shw'; a similar subcommand exists: 'show' (usage: \
             blockipamctl [OPTIONS] <COMMAND>); try 'blockipamctl --help'",
        ),
        // The usage clap prints names the command, even where a flag's value is a subcommand's
        // name.
        (
            &["--datastore-path", "show", "frobnicate"][..],
            "error: unrecognized subcommand 'frobnicate' (usage: blockipamctl [OPTIONS] \
             <COMMAND>); try 'blockipamctl --help'",
        ),
        // A bad value has no usage line: the subcommands given name the help to read.
        (
            &["pool", "add", "10.0.0.0/33"][..],
            "error: invalid value '10.0.0.0/33' for '<CIDR>': invalid IP address syntax; try \
             'blockipamctl pool add --help'",
        ),
        (
            &[
                "--lock-wait-seconds",
                "1",
                "config",
                "set",
                "--max-blocks-per-host",
                "x",
            ][..],
            "error: invalid value 'x' for '--max-blocks-per-host <N>': invalid digit found in \
             string; try 'blockipamctl config set --help'",
        ),
        // A negative number is a value refused for what it is, naming its flag (not an unknown
        // argument '-1').
        (
            &["config", "set", "--max-blocks-per-host", "-1"][..],
            "error: invalid value '-1' for '--max-blocks-per-host <N>': -1 is not in \
             0..=4294967295; try 'blockipamctl config set --help'",
        ),
        (
            &["--lock-wait-seconds", "-5", "show"][..],
            "error: invalid value \"-5\" for --lock-wait-seconds: expected 0 or more seconds up \
             to one day",
        ),
        (
            &["--lock-wait-seconds"][..],
            "error: a value is required for '--lock-wait-seconds <SECONDS>' but none was \
             supplied; try 'blockipamctl --help'",
        ),
    ] {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let run = ctl(&args, &[]);
        run.expect_code(2);
        assert_eq!(run.stderr.trim_end(), expected, "{args:?}");
    }
}

#[test]
fn a_reader_that_stops_early_leaves_the_status_alone_and_a_failed_write_is_an_error() {
    let lab = Lab::new(Backend::Sled);
    lab.ctl(&["pool", "add", "10.70.0.0/16", "--name", "main"])
        .ok();
    let listing = ["-o", "json", "pool", "list"];

    // `blockipamctl ... | grep -q ...`: the reader is gone before the output is written (its end
    // of the pipe closed), so every write gets a broken pipe.
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let run = lab.ctl_into(&listing, Stdio::from(writer));
    run.ok();
    assert!(run.stderr.is_empty(), "{run:?}");

    // Any other failed write (here a full disk) is an error, said on stderr.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let run = lab.ctl_into(&listing, Stdio::from(full));
    run.expect_code(1);
    assert_eq!(
        run.error_line(),
        "error: cannot write the output: No space left on device (os error 28)",
        "{run:?}"
    );
}

#[test]
fn help_and_version_exit_0() {
    let run = ctl(&["--help".to_owned()], &[]);
    run.ok()
        .stdout_has("Usage: blockipamctl")
        .stdout_has("ETCD_ENDPOINTS");
    for command in [
        "pool", "config", "show", "release", "check", "node", "migrate", "import", "demo",
    ] {
        ctl(&[command.to_owned(), "--help".to_owned()], &[])
            .ok()
            .stdout_has("Usage: blockipamctl");
    }
    ctl(&["--version".to_owned()], &[])
        .ok()
        .stdout_has(concat!("blockipamctl ", env!("CARGO_PKG_VERSION")));
}

#[test]
fn unreachable_etcd_is_an_error_within_the_timeout() {
    let endpoint = format!("http://127.0.0.1:{}", closed_port());
    for args in [
        &["show"][..],
        &["pool", "add", "10.0.0.0/16"][..],
        &["check"][..],
    ] {
        let mut full: Vec<String> = [
            "-o",
            "json",
            "--datastore-type",
            "etcdv3",
            "--etcd-endpoints",
            &endpoint,
            "--etcd-timeout-seconds",
            "2",
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let run = ctl(&full, &[]);
        run.expect_code(1);
        let line = run.error_line();
        assert!(line.contains("cannot open the store (etcdv3 at"), "{line}");
        assert!(run.json()["error"].as_str().is_some());
    }
}

#[test]
fn an_embedded_store_held_by_another_process_fails_after_the_lock_wait() {
    for backend in [Backend::Sled, Backend::Redb] {
        let lab = Lab::new(backend);
        lab.ctl(&["pool", "add", "10.80.0.0/16"]).ok();
        let before = lab.snapshot();
        let settings = blockipam_store::DatastoreSettings {
            lock_wait: Duration::from_secs(5),
            ..lab.settings()
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let held = runtime.block_on(settings.open()).expect("hold the store");

        let run = lab.ctl(&["--lock-wait-seconds", "0.5", "pool", "add", "10.81.0.0/16"]);
        run.expect_code(1);
        assert!(run.error_line().contains("held by another"), "{run:?}");
        let run = lab.ctl_env(
            &["-o", "json", "show"],
            &[("BLOCKIPAM_LOCK_WAIT_SECONDS", "0.2")],
        );
        run.expect_code(1);
        assert!(run.json()["error"]
            .as_str()
            .is_some_and(|m| m.contains("held by another")));

        drop(held);
        drop(runtime);
        assert_eq!(
            lab.snapshot(),
            before,
            "nothing was written while the store was held"
        );
        lab.ctl(&["pool", "list"]).ok();
    }
}

#[test]
fn read_commands_on_a_missing_embedded_store_fail_without_creating_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nothing-here");
    let path_text = path.display().to_string();
    for args in [
        &["show"][..],
        &["pool", "list"][..],
        &["config", "show"][..],
        &["check"][..],
        &["release", "--ip", "10.0.0.1"][..],
        &["node", "release", "host-a"][..],
    ] {
        let mut full = vec!["--datastore-path".to_owned(), path_text.clone()];
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let run = ctl(&full, &[]);
        run.expect_code(1);
        assert!(run.error_line().contains("no sled store at"), "{run:?}");
        assert!(!path.exists(), "{args:?} created the store");
    }
}

#[test]
fn bad_store_selections_are_usage_errors() {
    let run = ctl(&["show".to_owned()], &[("DATASTORE_TYPE", "mysql")]);
    run.expect_code(2);
    assert!(run.error_line().contains("DATASTORE_TYPE"));
    let run = ctl(
        &[
            "--datastore-type".to_owned(),
            "etcdv3".to_owned(),
            "show".to_owned(),
        ],
        &[],
    );
    run.expect_code(2);
    assert!(run.error_line().contains("ETCD_ENDPOINTS"));
    let run = ctl(
        &["show".to_owned()],
        &[
            ("DATASTORE_TYPE", "etcdv3"),
            ("ETCD_ENDPOINTS", "127.0.0.1:1"),
            ("ETCD_PREFIX", "no-trailing-slash"),
        ],
    );
    run.expect_code(2);
    assert!(run.error_line().contains("must end with '/'"), "{run:?}");
    let run = ctl(
        &["show".to_owned()],
        &[
            ("DATASTORE_TYPE", "etcdv3"),
            ("ETCD_ENDPOINTS", "https://127.0.0.1:1"),
            ("ETCD_CA_CERT_FILE", "/nonexistent/ca.pem"),
        ],
    );
    run.expect_code(2);
    assert!(run.error_line().contains("/nonexistent/ca.pem"), "{run:?}");
}

#[test]
fn environment_variables_select_the_store_and_flags_override_them() {
    for backend in [Backend::Sled, Backend::Redb, Backend::Etcd] {
        let lab = Lab::new(backend);
        let path = lab.path().display().to_string();
        let mut env = vec![("DATASTORE_TYPE", lab.type_name())];
        let etcd = lab.etcd();
        match &etcd {
            Some((endpoint, prefix)) => {
                env.push(("ETCD_ENDPOINTS", endpoint.as_str()));
                env.push(("ETCD_PREFIX", prefix.as_str()));
            }
            None => env.push(("DATASTORE_PATH", path.as_str())),
        }
        env.push(("BLOCKIPAMCTL_OUTPUT", "json"));
        let args =
            |list: &[&str]| -> Vec<String> { list.iter().map(|a| (*a).to_owned()).collect() };
        ctl(
            &args(&["pool", "add", "10.90.0.0/16", "--name", "from-env"]),
            &env,
        )
        .ok();
        let listed = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
        assert_eq!(listed[0]["name"], "from-env", "{backend:?}");
        let listed = ctl(&args(&["pool", "list"]), &env).ok().json();
        assert_eq!(listed[0]["name"], "from-env", "BLOCKIPAMCTL_OUTPUT=json");

        // Flags win over the environment.
        let wrong = [
            ("DATASTORE_TYPE", "redb"),
            ("DATASTORE_PATH", "/nonexistent/store"),
            ("ETCD_ENDPOINTS", "127.0.0.1:1"),
        ];
        let listed = lab
            .ctl_env(&["-o", "json", "pool", "list"], &wrong)
            .ok()
            .json();
        assert_eq!(listed[0]["name"], "from-env", "{backend:?}");
        lab.ctl_env(
            &["-o", "table", "pool", "list"],
            &[("BLOCKIPAMCTL_OUTPUT", "json")],
        )
        .ok()
        .stdout_has("NAME");
    }
}
