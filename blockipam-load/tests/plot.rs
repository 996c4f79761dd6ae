//! blockipam-plot: two hand-made reports become a PNG of the requested size (checked by decoding
//! its header), and a missing report or font is a clear error, through the library and the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

use blockipam_load::plot::{render, PlotRequest, SeriesSpec, DEFAULT_FONT};
use blockipam_load::LoadError;

const BIN: &str = env!("CARGO_BIN_EXE_blockipam-plot");

fn write_report(dir: &Path, name: &str, nodes: u32, first_add_p99: f64, add_p99: f64) -> PathBuf {
    let report = serde_json::json!({
        "config": {"nodes": nodes},
        "kinds": {
            "first_add": {"p50_ms": first_add_p99 / 2.0, "p99_ms": first_add_p99},
            "add": {"p50_ms": add_p99 / 2.0, "p99_ms": add_p99},
            "del": {"p50_ms": 1.0, "p99_ms": 2.0},
        },
    });
    let path = dir.join(name);
    std::fs::write(&path, report.to_string()).expect("write a report");
    path
}

/// Width and height from a PNG's signature and IHDR chunk.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(bytes.len() > 24, "{} bytes is no PNG", bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "no PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR", "the first chunk is not IHDR");
    let number =
        |at: usize| u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    (number(16), number(20))
}

fn request(dir: &Path, files: Vec<PathBuf>) -> PlotRequest {
    PlotRequest {
        series: vec![SeriesSpec {
            label: "1 member".into(),
            files,
        }],
        output: dir.join("plot.png"),
        width: 640,
        height: 400,
        font: PathBuf::from(DEFAULT_FONT),
        title: "test".into(),
    }
}

#[test]
fn two_reports_become_a_png_of_the_requested_size() {
    let dir = tempfile::tempdir().expect("temp dir");
    let files = vec![
        write_report(dir.path(), "b.json", 1000, 15.0, 6.0),
        write_report(dir.path(), "a.json", 10, 6.9, 6.5),
    ];
    let request = request(dir.path(), files);
    render(&request).unwrap_or_else(|e| panic!("the plot was not drawn: {e}"));
    let png = std::fs::read(&request.output).expect("the PNG was written");
    assert_eq!(png_size(&png), (640, 400));
    // A blank image of that size compresses to well under a kilobyte; lines and text do not.
    assert!(
        png.len() > 4_000,
        "the PNG looks empty: {} bytes",
        png.len()
    );
}

#[test]
fn a_missing_report_or_font_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let present = write_report(dir.path(), "a.json", 10, 6.9, 6.5);
    let missing = dir.path().join("nowhere.json");
    let error = render(&request(dir.path(), vec![present.clone(), missing.clone()]))
        .expect_err("a missing report was accepted");
    assert!(
        matches!(&error, LoadError::Failed(m) if m.contains("cannot read the report") && m.contains("nowhere.json")),
        "{error}"
    );
    assert!(
        !dir.path().join("plot.png").exists(),
        "a PNG was written anyway"
    );

    let mut no_font = request(dir.path(), vec![present]);
    no_font.font = dir.path().join("missing.ttf");
    let error = render(&no_font).expect_err("a missing font was accepted");
    assert!(
        matches!(&error, LoadError::Failed(m) if m.contains("cannot read the font") && m.contains("--font")),
        "{error}"
    );

    // The binary: exit 1 with the message on stderr, 2 for a malformed series.
    let output = Command::new(BIN)
        .arg("--series")
        .arg(format!("x={}", missing.display()))
        .arg("--output")
        .arg(dir.path().join("bin.png"))
        .output()
        .expect("run blockipam-plot");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot read the report"), "{stderr}");
    let output = Command::new(BIN)
        .args(["--series", "no-label-here", "--output", "x.png"])
        .output()
        .expect("run blockipam-plot");
    assert_eq!(output.status.code(), Some(2));
}
