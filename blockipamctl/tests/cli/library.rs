//! The library entry point, driven in-process with its own arguments, environment and streams.

use blockipamctl::{run, Env, EXIT_OK, EXIT_USAGE};

fn run_in_process(args: &[&str], env: &Env) -> (i32, String, String) {
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut full = vec!["blockipamctl"];
    full.extend_from_slice(args);
    let code = run(full, env, &mut out, &mut err, false);
    (
        code,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

#[test]
fn library_entry_point_takes_args_env_and_streams() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store.redb").display().to_string();
    let env = Env::new([
        ("DATASTORE_TYPE", "redb"),
        ("DATASTORE_PATH", path.as_str()),
    ]);

    let (code, out, err) = run_in_process(&["pool", "add", "10.95.0.0/16", "--name", "lib"], &env);
    assert_eq!(code, EXIT_OK, "{err}");
    assert!(out.contains("Created IP pool lib"), "{out}");

    let (code, out, err) = run_in_process(&["-o", "json", "show"], &env);
    assert_eq!(code, EXIT_OK, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(doc["pools"][0]["name"], "lib");

    let (code, out, err) = run_in_process(&["pool", "add", "10.95.0.1/16"], &env);
    assert_eq!(code, EXIT_USAGE);
    assert!(out.is_empty());
    assert!(err.starts_with("error: "), "{err}");
}
