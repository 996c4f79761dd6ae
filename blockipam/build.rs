//! Links the `blockipam` executable for a fast start: every CNI call is a new process, and the
//! loader's work is a large part of a call (docs/benchmarks.md, "Where a call through the agent
//! goes").
//!
//! On Linux with glibc, and unless `BLOCKIPAM_DEFAULT_LINK=1` is set at build time:
//! - position-dependent (`-no-pie`): the loader no longer relocates about 14,000 addresses of the
//!   executable (and copies the pages that hold them) at every start. The object code stays
//!   position-independent; only the executable's own load address is fixed (shared libraries,
//!   stack and heap are still randomised);
//! - GCC's unwinder linked in from `libgcc_eh.a` (what `gcc -static-libgcc` links) instead of
//!   loading `libgcc_s.so.1` at every start, whose constructor probes the CPU (`cpuid`, slow in a
//!   virtual machine). Panics still unwind: the plugin's `catch_unwind` safety nets rely on it.
//!
//! Only the `blockipam` binary is affected: the library, the tests' own executables and the other
//! crates link as rustc does by default.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=BLOCKIPAM_DEFAULT_LINK");
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    if env::var("BLOCKIPAM_DEFAULT_LINK").is_ok_and(|v| v == "1") {
        return;
    }
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_env = env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if target_os != "linux" || target_env != "gnu" {
        return;
    }
    println!("cargo:rustc-link-arg-bin=blockipam=-no-pie");
    // The C compiler that links (rustc's default `cc`, or the one configured for the target) knows
    // where its own libgcc_eh.a is; a cross build leaves the unwinder as it is.
    if env::var("HOST").ok() != env::var("TARGET").ok() {
        return;
    }
    let linker = env::var("RUSTC_LINKER").unwrap_or_else(|_| "cc".to_owned());
    let Some(out_dir) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        return;
    };
    match static_unwinder_dir(&linker, &out_dir) {
        // rustc asks for the unwinder as `-lgcc_s`; the linker takes the first match along the
        // search path (every -L applies to every -l, whatever their order), which is this
        // directory's static copy.
        Ok(dir) => println!("cargo:rustc-link-arg-bin=blockipam=-L{}", dir.display()),
        Err(why) => println!(
            "cargo:warning=blockipam links libgcc_s.so.1 dynamically (slower start): {why}"
        ),
    }
}

/// A directory holding `libgcc_s.a`: a copy of the linker's `libgcc_eh.a`.
fn static_unwinder_dir(linker: &str, out_dir: &Path) -> Result<PathBuf, String> {
    let output = Command::new(linker)
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .map_err(|e| format!("cannot run {linker}: {e}"))?;
    let printed = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let archive = PathBuf::from(&printed);
    // Without the file, the compiler prints the bare name back.
    if !output.status.success() || !archive.is_absolute() || !archive.is_file() {
        return Err(format!(
            "{linker} does not know libgcc_eh.a (it printed {printed:?})"
        ));
    }
    let dir = out_dir.join("static-unwinder");
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let copy = dir.join("libgcc_s.a");
    fs::copy(&archive, &copy).map_err(|e| {
        format!(
            "cannot copy {} to {}: {e}",
            archive.display(),
            copy.display()
        )
    })?;
    Ok(dir)
}
