//! The `blockipam-manpages` executable: writes every man page into `OUT_DIR/man<section>/` and prints their paths.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(out_dir), None) = (args.next(), args.next()) else {
        eprintln!("usage: blockipam-manpages OUT_DIR");
        return ExitCode::from(2);
    };
    match write_pages(&PathBuf::from(out_dir)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blockipam-manpages: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write_pages(out_dir: &std::path::Path) -> std::io::Result<()> {
    for page in blockipam_manpages::render_all()? {
        let dir = out_dir.join(format!("man{}", page.section));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(page.file_name());
        std::fs::write(&path, page.roff)?;
        println!("{}", path.display());
    }
    Ok(())
}
