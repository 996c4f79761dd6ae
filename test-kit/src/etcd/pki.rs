//! A throwaway test PKI (a CA, a server and a client certificate) made with the `openssl` command.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::supervisor::ServerTls;

/// A throwaway CA with one server certificate (for `127.0.0.1` and `localhost`) and one client
/// certificate, made with the `openssl` command; removed on drop, and also when the test process
/// ends without dropping it (a `static` server's PKI, a killed process): see [`CLEANUP_WATCHDOG`].
#[derive(Debug)]
pub struct TestPki {
    dir: tempfile::TempDir,
    cleanup: Child,
}

/// Removes the directory named by `$1` once its standard input (a pipe from the test process)
/// closes: when the `TestPki` is dropped, or when the process that made it ends for any reason.
/// It ignores INT/TERM/HUP, so that a signal sent to the whole process group (Ctrl-C, `timeout`)
/// ends the test process but not the clean-up.
const CLEANUP_WATCHDOG: &str = r#"trap '' INT TERM HUP
IFS= read -r _ignored
rm -rf "$1"
"#;

const PKI_CONFIG: &str = "\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = blockipam-test
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

impl TestPki {
    /// Generates the CA and both certificates (EC P-256, valid for two days).
    ///
    /// # Errors
    /// A message when `openssl` is missing or fails (with its output).
    pub fn generate() -> Result<TestPki, String> {
        let dir = tempfile::Builder::new()
            .prefix("blockipam-pki-")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        let cleanup = start_cleanup_watchdog(dir.path())?;
        let pki = TestPki { dir, cleanup };
        let path = |name: &str| pki.dir.path().join(name).display().to_string();
        fs::write(path("openssl.cnf"), PKI_CONFIG)
            .map_err(|e| format!("cannot write the openssl configuration: {e}"))?;
        let new_key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509", "-config", &path("openssl.cnf")],
                &["-extensions", "ca_ext", "-days", "2"],
                &new_key[..],
                &["-subj", "/CN=blockipam-test-ca"],
                &["-keyout", &path("ca-key.pem"), "-out", &path("ca.pem")],
            ]
            .concat(),
        )?;
        for (name, subject, extensions, serial) in [
            ("server", "/CN=127.0.0.1", "server_ext", "2"),
            ("client", "/CN=blockipam-test-client", "client_ext", "3"),
        ] {
            let (key, csr, cert) = (
                path(&format!("{name}-key.pem")),
                path(&format!("{name}.csr")),
                path(&format!("{name}.pem")),
            );
            openssl(
                &[
                    &["req", "-new", "-config", &path("openssl.cnf")],
                    &new_key[..],
                    &["-subj", subject, "-keyout", &key, "-out", &csr],
                ]
                .concat(),
            )?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &path("ca.pem"),
                "-CAkey",
                &path("ca-key.pem"),
                "-set_serial",
                serial,
                "-days",
                "2",
                "-extfile",
                &path("openssl.cnf"),
                "-extensions",
                extensions,
                "-out",
                &cert,
            ])?;
        }
        Ok(pki)
    }

    /// The CA certificate (PEM).
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server certificate (PEM), valid for `127.0.0.1` and `localhost`.
    pub fn server_cert(&self) -> PathBuf {
        self.dir.path().join("server.pem")
    }

    /// The server private key (PEM, PKCS#8).
    pub fn server_key(&self) -> PathBuf {
        self.dir.path().join("server-key.pem")
    }

    /// The client certificate (PEM).
    pub fn client_cert(&self) -> PathBuf {
        self.dir.path().join("client.pem")
    }

    /// The client private key (PEM, PKCS#8).
    pub fn client_key(&self) -> PathBuf {
        self.dir.path().join("client-key.pem")
    }

    /// Server TLS settings using these files; `require_client_cert` turns on
    /// `--client-cert-auth` with this CA.
    pub fn server_tls(&self, require_client_cert: bool) -> ServerTls {
        ServerTls {
            cert_file: self.server_cert(),
            key_file: self.server_key(),
            client_ca_file: require_client_cert.then(|| self.ca_cert()),
        }
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        // Closing the pipe tells the watchdog to remove the directory; the `TempDir` then finds
        // it gone, which it ignores.
        drop(self.cleanup.stdin.take());
        let _ = self.cleanup.wait();
    }
}

fn start_cleanup_watchdog(dir: &Path) -> Result<Child, String> {
    Command::new("sh")
        .args(["-c", CLEANUP_WATCHDOG, "blockipam-pki-cleanup"])
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start the clean-up watchdog (sh): {e}"))
}

fn openssl(args: &[&str]) -> Result<(), String> {
    let output = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run openssl (apt-get install openssl): {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "openssl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}
