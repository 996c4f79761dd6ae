//! `blockipam-plot`: p99 (and p50) latency of a node's first ADD and of steady ADDs against the
//! node count, from the JSON reports of several load runs, drawn as a PNG.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Parser;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::cli::{EXIT_FAILED, EXIT_PASSED, EXIT_USAGE};
use crate::error::LoadError;

/// The font text is drawn with when `--font` is not given (Debian's `fonts-dejavu-core`).
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// blockipam-plot: latency against node count from blockipam-load JSON reports, as a PNG.
#[derive(Debug, Parser)]
#[command(
    name = "blockipam-plot",
    version,
    about = "Latency against node count from blockipam-load --json reports, as a PNG",
    after_help = "Each report needs .config.nodes and .kinds.{first_add,add}.{p50_ms,p99_ms}. \
                  Example: blockipam-plot --series \"1 member=a.json,b.json,c.json\" \
                  --series \"3 members=d.json,e.json,f.json\" --output docs/scale.png"
)]
pub struct PlotCli {
    /// A series: its label, '=', then its reports, comma-separated (repeat for several series)
    #[arg(long, value_name = "LABEL=FILE,FILE,...")]
    pub series: Vec<String>,
    /// Reports forming one more series, labelled with --label
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// The label of the --input series
    #[arg(long, value_name = "TEXT", default_value = "runs")]
    pub label: String,
    /// The PNG to write
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Image width in pixels
    #[arg(long, value_name = "PIXELS", default_value_t = 1024)]
    pub width: u32,
    /// Image height in pixels
    #[arg(long, value_name = "PIXELS", default_value_t = 640)]
    pub height: u32,
    /// A TrueType font for the text, read at run time
    #[arg(long, value_name = "FILE", default_value = DEFAULT_FONT)]
    pub font: PathBuf,
    /// The chart's title
    #[arg(
        long,
        value_name = "TEXT",
        default_value = "blockipam: ADD latency against node count"
    )]
    pub title: String,
}

/// One line of the plot's legend: a label and the reports that make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeriesSpec {
    /// The legend's label.
    pub label: String,
    /// The reports, one point each.
    pub files: Vec<PathBuf>,
}

impl SeriesSpec {
    /// Parses `LABEL=FILE,FILE,...`.
    ///
    /// # Errors
    /// [`LoadError::Usage`] without a label or a file.
    pub fn parse(text: &str) -> Result<SeriesSpec, LoadError> {
        let (label, files) = text.split_once('=').ok_or_else(|| {
            LoadError::usage(format!(
                "--series {text:?}: expected LABEL=FILE,FILE,... (a label, '=', the reports)"
            ))
        })?;
        let files: Vec<PathBuf> = files
            .split(',')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(PathBuf::from)
            .collect();
        if label.trim().is_empty() || files.is_empty() {
            return Err(LoadError::usage(format!(
                "--series {text:?}: needs a label and at least one report"
            )));
        }
        Ok(SeriesSpec {
            label: label.trim().to_owned(),
            files,
        })
    }
}

/// What the plot needs from one report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReportPoint {
    /// `.config.nodes`.
    pub nodes: u32,
    /// `.kinds.first_add.p50_ms`.
    pub first_add_p50_ms: Option<f64>,
    /// `.kinds.first_add.p99_ms`.
    pub first_add_p99_ms: Option<f64>,
    /// `.kinds.add.p50_ms`.
    pub add_p50_ms: Option<f64>,
    /// `.kinds.add.p99_ms`.
    pub add_p99_ms: Option<f64>,
}

/// Reads the plot's figures from one blockipam-load JSON report.
///
/// # Errors
/// [`LoadError::Failed`] naming the file when it cannot be read, is not JSON, or lacks
/// `.config.nodes` or both `.kinds.first_add` and `.kinds.add`.
pub fn read_report(path: &Path) -> Result<ReportPoint, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        LoadError::failed(format!("cannot read the report {}: {e}", path.display()))
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        LoadError::failed(format!(
            "the report {} is not JSON ({e}); write it with blockipam-load --json",
            path.display()
        ))
    })?;
    let nodes = json["config"]["nodes"]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            LoadError::failed(format!(
                "the report {} has no .config.nodes (a blockipam-load --json report?)",
                path.display()
            ))
        })?;
    let figure = |kind: &str, field: &str| json["kinds"][kind][field].as_f64();
    let point = ReportPoint {
        nodes,
        first_add_p50_ms: figure("first_add", "p50_ms"),
        first_add_p99_ms: figure("first_add", "p99_ms"),
        add_p50_ms: figure("add", "p50_ms"),
        add_p99_ms: figure("add", "p99_ms"),
    };
    if point.first_add_p99_ms.is_none() && point.add_p99_ms.is_none() {
        return Err(LoadError::failed(format!(
            "the report {} has neither .kinds.first_add.p99_ms nor .kinds.add.p99_ms",
            path.display()
        )));
    }
    Ok(point)
}

/// Everything one plot needs.
#[derive(Debug, Clone)]
pub struct PlotRequest {
    /// The series, in legend order.
    pub series: Vec<SeriesSpec>,
    /// The PNG to write.
    pub output: PathBuf,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// The TrueType font, read at run time.
    pub font: PathBuf,
    /// The title.
    pub title: String,
}

impl PlotCli {
    /// The plot the flags ask for.
    ///
    /// # Errors
    /// [`LoadError::Usage`] for a bad series, no series, or a zero size.
    pub fn request(&self) -> Result<PlotRequest, LoadError> {
        let mut series = self
            .series
            .iter()
            .map(|s| SeriesSpec::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        if !self.input.is_empty() {
            series.push(SeriesSpec {
                label: self.label.clone(),
                files: self.input.clone(),
            });
        }
        if series.is_empty() {
            return Err(LoadError::usage(
                "nothing to plot: give --series LABEL=FILE,... or --input FILE...",
            ));
        }
        if self.width < 200 || self.height < 150 {
            return Err(LoadError::usage("--width and --height: at least 200 x 150"));
        }
        Ok(PlotRequest {
            series,
            output: self.output.clone(),
            width: self.width,
            height: self.height,
            font: self.font.clone(),
            title: self.title.clone(),
        })
    }
}

/// Registers the TrueType font at `path` as plotters' `sans-serif`.
fn load_font(path: &Path) -> Result<(), LoadError> {
    let bytes = std::fs::read(path).map_err(|e| {
        LoadError::failed(format!(
            "cannot read the font {} ({e}): install fonts-dejavu-core or pass --font FILE.ttf",
            path.display()
        ))
    })?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| {
        LoadError::failed(format!(
            "the font {} is not a TrueType/OpenType font",
            path.display()
        ))
    })
}

/// The lines drawn for each series: which figure, its legend text, and whether it is dashed.
type Figure = fn(&ReportPoint) -> Option<f64>;
const LINES: [(Figure, &str, bool); 4] = [
    (|p| p.first_add_p99_ms, "first ADD p99", false),
    (|p| p.add_p99_ms, "ADD p99", false),
    (|p| p.first_add_p50_ms, "first ADD p50", true),
    (|p| p.add_p50_ms, "ADD p50", true),
];

/// Reads every report of `request` and draws the PNG.
///
/// # Errors
/// [`LoadError::Failed`] for a missing or bad report, a missing font, or a PNG that cannot be
/// written.
pub fn render(request: &PlotRequest) -> Result<(), LoadError> {
    let mut series: Vec<(String, Vec<ReportPoint>)> = Vec::new();
    for spec in &request.series {
        let mut points = spec
            .files
            .iter()
            .map(|f| read_report(f))
            .collect::<Result<Vec<_>, _>>()?;
        points.sort_by_key(|p| p.nodes);
        series.push((spec.label.clone(), points));
    }
    load_font(&request.font)?;

    let all = series.iter().flat_map(|(_, points)| points.iter());
    let (min_nodes, max_nodes) = all.clone().fold((u32::MAX, 0), |(lo, hi), p| {
        (lo.min(p.nodes), hi.max(p.nodes))
    });
    let max_ms = all
        .flat_map(|p| LINES.iter().filter_map(move |(figure, _, _)| figure(p)))
        .fold(0.0_f64, f64::max);
    let x_range = (f64::from(min_nodes) / 1.5)..(f64::from(max_nodes) * 1.5);
    let y_range = 0.0..(max_ms * 1.15).max(1.0);

    let draw_error = |e: &dyn std::fmt::Display| {
        LoadError::failed(format!("cannot draw {}: {e}", request.output.display()))
    };
    let root =
        BitMapBackend::new(&request.output, (request.width, request.height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_error(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&request.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(x_range.log_scale(), y_range)
        .map_err(|e| draw_error(&e))?;
    chart
        .configure_mesh()
        .x_desc("nodes (log scale)")
        .y_desc("latency (ms)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|e| draw_error(&e))?;

    let mut color_index = 0;
    for (label, points) in &series {
        for (line, (figure, what, dashed)) in LINES.iter().enumerate() {
            // first ADD and ADD get their own colours; p50 (dashed) shares its p99's colour.
            let color = Palette99::pick(color_index + line % 2).to_rgba();
            let coords: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|p| figure(p).map(|ms| (f64::from(p.nodes), ms)))
                .collect();
            if coords.is_empty() {
                continue;
            }
            let style = color.stroke_width(if *dashed { 1 } else { 2 });
            let legend = format!("{label}: {what}");
            let drawn = if *dashed {
                chart.draw_series(DashedLineSeries::new(coords.clone(), 6, 4, style))
            } else {
                chart.draw_series(LineSeries::new(coords.clone(), style))
            };
            drawn
                .map_err(|e| draw_error(&e))?
                .label(legend)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            chart
                .draw_series(
                    coords
                        .iter()
                        .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                )
                .map_err(|e| draw_error(&e))?;
        }
        color_index += 2;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| draw_error(&e))?;
    root.present().map_err(|e| draw_error(&e))?;
    Ok(())
}

/// The whole `blockipam-plot` program: parses `args`, draws, reports on `stdout`/`stderr`, and
/// returns the exit status (0 drawn, 1 failed, 2 usage).
pub fn run_plot_cli<I, T>(args: I, stdout: &mut dyn Write, stderr: &mut dyn Write) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match PlotCli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            if e.use_stderr() {
                let _ = write!(stderr, "{e}");
                return EXIT_USAGE;
            }
            let _ = write!(stdout, "{e}");
            return EXIT_PASSED;
        }
    };
    match cli.request().and_then(|request| render(&request)) {
        Ok(()) => {
            let _ = writeln!(stdout, "wrote {}", cli.output.display());
            EXIT_PASSED
        }
        Err(e) => {
            let _ = writeln!(stderr, "blockipam-plot: error: {e}");
            match e {
                LoadError::Usage(_) => EXIT_USAGE,
                _ => EXIT_FAILED,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_series_is_a_label_then_files_and_a_bad_one_is_a_usage_error() {
        let spec = SeriesSpec::parse("1 member=a.json, b.json").expect("parses");
        assert_eq!(spec.label, "1 member");
        assert_eq!(
            spec.files,
            vec![PathBuf::from("a.json"), PathBuf::from("b.json")]
        );
        for bad in ["no-equals", "=a.json", "label="] {
            assert!(
                matches!(SeriesSpec::parse(bad), Err(LoadError::Usage(_))),
                "{bad:?} was accepted"
            );
        }
    }
}
