//! Rendering: aligned tables and readable sizes for people, JSON documents for scripts, and the
//! progress line shown on a terminal.

use std::fmt::Write as _;
use std::io::Write;

use crate::cli::OutputFormat;

/// What a command produced: the JSON document, the table text, and whether it found problems
/// (exit status 1 without an error message, as `check` does).
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Printed with `-o json`: a rendered JSON document (rendered early because pool capacities
    /// can exceed what `serde_json::Value` holds).
    pub json: String,
    /// Printed with `-o table` (the default); may be empty when the command streamed its text.
    pub table: String,
    /// True when the command succeeded in running but found something wrong (exit status 1).
    pub problems_found: bool,
}

impl Outcome {
    /// A successful outcome.
    pub fn ok(json: String, table: String) -> Self {
        Outcome {
            json,
            table,
            problems_found: false,
        }
    }
}

/// Where a command writes, and how.
pub struct Ctx<'a> {
    /// The output format.
    pub format: OutputFormat,
    /// Standard output.
    pub stdout: &'a mut dyn Write,
    /// Standard error.
    pub stderr: &'a mut dyn Write,
    /// Whether standard error is a terminal (progress is shown only then).
    pub stderr_is_terminal: bool,
    progress_shown: bool,
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("format", &self.format)
            .field("stderr_is_terminal", &self.stderr_is_terminal)
            .finish_non_exhaustive()
    }
}

impl<'a> Ctx<'a> {
    /// A context writing to these streams.
    pub fn new(
        format: OutputFormat,
        stdout: &'a mut dyn Write,
        stderr: &'a mut dyn Write,
        stderr_is_terminal: bool,
    ) -> Self {
        Ctx {
            format,
            stdout,
            stderr,
            stderr_is_terminal,
            progress_shown: false,
        }
    }

    /// Replaces the progress line on a terminal; does nothing otherwise.
    pub fn progress(&mut self, message: &str) {
        if self.stderr_is_terminal {
            // Progress is best effort: a closed terminal must not fail the command.
            let _ = write!(self.stderr, "\r\x1b[2K{message}");
            let _ = self.stderr.flush();
            self.progress_shown = true;
        }
    }

    /// Clears the progress line, if one is shown.
    pub fn progress_done(&mut self) {
        if self.progress_shown {
            let _ = write!(self.stderr, "\r\x1b[2K");
            let _ = self.stderr.flush();
            self.progress_shown = false;
        }
    }

    /// Writes text to stdout in table mode (for commands that stream, like `demo`).
    pub fn say(&mut self, text: &str) {
        if self.format == OutputFormat::Table {
            self.progress_done();
            let _ = self.stdout.write_all(text.as_bytes());
            if !text.ends_with('\n') {
                let _ = self.stdout.write_all(b"\n");
            }
            let _ = self.stdout.flush();
        }
    }
}

/// A table with aligned columns.
#[derive(Debug, Clone, Default)]
pub struct Table {
    headers: Vec<String>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers, every column left-aligned.
    pub fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            right: vec![false; headers.len()],
            rows: Vec::new(),
        }
    }

    /// Right-aligns the given columns (numbers).
    pub fn right_align(mut self, columns: &[usize]) -> Self {
        for c in columns {
            if let Some(flag) = self.right.get_mut(*c) {
                *flag = true;
            }
        }
        self
    }

    /// Adds a row (missing cells are empty, extra cells are dropped).
    pub fn row(&mut self, cells: Vec<String>) {
        let mut cells = cells;
        cells.resize(self.headers.len(), String::new());
        self.rows.push(cells);
    }

    /// True when no row was added.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text: a header line, then one line per row, columns separated by two spaces,
    /// no trailing spaces.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for line in std::iter::once(&self.headers).chain(self.rows.iter()) {
            let mut text = String::new();
            for (i, cell) in line.iter().enumerate() {
                if i > 0 {
                    text.push_str("  ");
                }
                let pad = widths[i] - cell.chars().count();
                if self.right[i] {
                    text.push_str(&" ".repeat(pad));
                    text.push_str(cell);
                } else {
                    text.push_str(cell);
                    text.push_str(&" ".repeat(pad));
                }
            }
            let _ = writeln!(out, "{}", text.trim_end());
        }
        out
    }
}

/// A count for people: exact with thousands separators below 100,000, else three significant
/// digits with an SI suffix (`1.05M`, `18.4E`), else scientific notation.
pub fn human_count(value: u128) -> String {
    if value < 100_000 {
        return group_digits(value);
    }
    const UNITS: [&str; 8] = ["k", "M", "G", "T", "P", "E", "Z", "Y"];
    let mut scaled = value as f64;
    for unit in UNITS {
        scaled /= 1000.0;
        // Shown without decimals from 99.95, so 999.5 would round to a four-digit "1000".
        if scaled < 999.5 {
            return if scaled < 9.995 {
                format!("{scaled:.2}{unit}")
            } else if scaled < 99.95 {
                format!("{scaled:.1}{unit}")
            } else {
                format!("{scaled:.0}{unit}")
            };
        }
    }
    format!("{:.2e}", value as f64)
}

/// Digits grouped by three with commas.
pub fn group_digits(value: u128) -> String {
    let digits = value.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `in_use` as a percentage of `capacity`, one decimal (`0.0%` for an empty pool, `<0.1%` for a
/// small but non-zero share).
pub fn percent(in_use: u128, capacity: u128) -> String {
    if capacity == 0 {
        return "-".to_owned();
    }
    let share = in_use as f64 * 100.0 / capacity as f64;
    if in_use > 0 && share < 0.05 {
        "<0.1%".to_owned()
    } else {
        format!("{share:.1}%")
    }
}

/// `1 pool`, `2 pools`: a count with the word in the right number.
pub fn counted(n: u64, singular: &str, plural: &str) -> String {
    if n == 1 {
        format!("1 {singular}")
    } else {
        format!("{n} {plural}")
    }
}

/// `yes` / `no`.
pub fn yes_no(value: bool) -> &'static str {
    if value {
        "yes"
    } else {
        "no"
    }
}

/// Writes an outcome in the chosen format.
pub fn print(ctx: &mut Ctx<'_>, outcome: &Outcome) -> std::io::Result<()> {
    ctx.progress_done();
    match ctx.format {
        OutputFormat::Json => {
            writeln!(ctx.stdout, "{}", outcome.json.trim_end())?;
        }
        OutputFormat::Table => {
            ctx.stdout.write_all(outcome.table.as_bytes())?;
            if !outcome.table.is_empty() && !outcome.table.ends_with('\n') {
                writeln!(ctx.stdout)?;
            }
        }
    }
    ctx.stdout.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_columns_line_up_and_numbers_align_right() {
        let mut table = Table::new(&["NAME", "SIZE"]).right_align(&[1]);
        table.row(vec!["a".into(), "1".into()]);
        table.row(vec!["longer".into(), "1,000".into()]);
        assert_eq!(
            table.render(),
            "NAME     SIZE\na           1\nlonger  1,000\n"
        );
    }

    #[test]
    fn rows_never_end_in_spaces() {
        let mut table = Table::new(&["A", "B"]);
        assert!(table.is_empty());
        table.row(vec!["x".into(), String::new()]);
        assert!(!table.is_empty());
        assert!(table.render().lines().all(|l| !l.ends_with(' ')));
    }

    #[test]
    fn small_counts_are_exact_and_large_ones_readable() {
        assert_eq!(human_count(0), "0");
        assert_eq!(human_count(64), "64");
        assert_eq!(human_count(65_536), "65,536");
        assert_eq!(human_count(1_048_576), "1.05M");
        assert_eq!(human_count(16_777_216), "16.8M");
        assert_eq!(human_count(1u128 << 64), "18.4E");
        assert_eq!(human_count(u128::MAX), "3.40e38");
    }

    #[test]
    fn counts_change_form_exactly_at_their_bounds() {
        // Exact below 100,000, an SI figure from there.
        assert_eq!(human_count(99_999), "99,999");
        assert_eq!(human_count(100_000), "100k");
        // A figure that would round to 1000 of a unit is shown in the next one.
        assert_eq!(human_count(999_499), "999k");
        assert_eq!(human_count(999_500), "1.00M");
        assert_eq!(human_count(999_949), "1.00M");
        // Two decimals below 9.995 of a unit, one below 99.95, none from there.
        assert_eq!(human_count(9_994_999), "9.99M");
        assert_eq!(human_count(9_995_000), "10.0M");
        assert_eq!(human_count(99_949_999), "99.9M");
        assert_eq!(human_count(99_950_000), "100M");
    }

    #[test]
    fn digits_are_grouped_by_three_without_a_leading_comma() {
        assert_eq!(group_digits(0), "0");
        assert_eq!(group_digits(123), "123");
        assert_eq!(group_digits(1_234), "1,234");
        assert_eq!(group_digits(123_456), "123,456");
        assert_eq!(group_digits(1_234_567), "1,234,567");
    }

    #[test]
    fn a_share_of_exactly_a_twentieth_of_a_percent_is_shown_as_a_number() {
        // 1 in 2,000 is 0.05%: shown rounded, 0.1%; anything smaller and non-zero is "<0.1%".
        assert_eq!(percent(1, 2_000), "0.1%");
        assert_eq!(percent(1, 2_001), "<0.1%");
    }

    #[test]
    fn counted_words_agree_with_their_number() {
        assert_eq!(counted(0, "pool", "pools"), "0 pools");
        assert_eq!(counted(1, "pool", "pools"), "1 pool");
        assert_eq!(counted(2, "pool", "pools"), "2 pools");
        assert_eq!(yes_no(true), "yes");
        assert_eq!(yes_no(false), "no");
    }

    /// What `write` puts on stdout and stderr through a context of this format and terminal.
    fn written(
        format: OutputFormat,
        stderr_is_terminal: bool,
        write: impl FnOnce(&mut Ctx<'_>),
    ) -> (String, String) {
        let mut out = Vec::new();
        let mut err = Vec::new();
        {
            let mut ctx = Ctx::new(format, &mut out, &mut err, stderr_is_terminal);
            write(&mut ctx);
        }
        (
            String::from_utf8(out).expect("stdout is UTF-8"),
            String::from_utf8(err).expect("stderr is UTF-8"),
        )
    }

    #[test]
    fn say_writes_one_line_in_table_mode_and_nothing_in_json_mode() {
        let (out, _) = written(OutputFormat::Table, false, |ctx| {
            ctx.say("no newline");
            ctx.say("one newline\n");
        });
        assert_eq!(out, "no newline\none newline\n");
        let (out, err) = written(OutputFormat::Json, false, |ctx| ctx.say("step"));
        assert_eq!((out.as_str(), err.as_str()), ("", ""));
    }

    #[test]
    fn say_clears_a_progress_line_first() {
        let (out, err) = written(OutputFormat::Table, true, |ctx| {
            ctx.progress("working");
            ctx.say("done");
            // Nothing left to clear: no second clearing sequence.
            ctx.progress_done();
        });
        assert_eq!(out, "done\n");
        assert_eq!(err, "\r\x1b[2Kworking\r\x1b[2K");
    }

    #[test]
    fn print_writes_the_chosen_format_ending_in_one_newline() {
        let outcome = |table: &str| Outcome::ok("{\"a\": 1}\n\n".to_owned(), table.to_owned());
        let (out, _) = written(OutputFormat::Json, false, |ctx| {
            print(ctx, &outcome("ignored")).expect("print");
        });
        assert_eq!(out, "{\"a\": 1}\n");
        for (table, expected) in [("", ""), ("A  B", "A  B\n"), ("A  B\n", "A  B\n")] {
            let (out, _) = written(OutputFormat::Table, false, |ctx| {
                print(ctx, &outcome(table)).expect("print");
            });
            assert_eq!(out, expected, "table {table:?}");
        }
    }

    #[test]
    fn a_context_debugs_as_its_format_and_terminal_flag() {
        written(OutputFormat::Json, true, |ctx| {
            let shown = format!("{ctx:?}");
            assert!(shown.starts_with("Ctx {"), "{shown}");
            assert!(shown.contains("format: Json"), "{shown}");
            assert!(shown.contains("stderr_is_terminal: true"), "{shown}");
        });
    }

    #[test]
    fn percentages_show_small_nonzero_shares() {
        assert_eq!(percent(0, 100), "0.0%");
        assert_eq!(percent(1, 65_536), "<0.1%");
        assert_eq!(percent(32, 64), "50.0%");
        assert_eq!(percent(1, 0), "-");
    }

    #[test]
    fn progress_is_silent_when_stderr_is_not_a_terminal() {
        let mut out = Vec::new();
        let mut err = Vec::new();
        {
            let mut ctx = Ctx::new(OutputFormat::Table, &mut out, &mut err, false);
            ctx.progress("working");
            ctx.progress_done();
        }
        assert!(err.is_empty());
        let mut err = Vec::new();
        {
            let mut ctx = Ctx::new(OutputFormat::Table, &mut out, &mut err, true);
            ctx.progress("working");
            ctx.progress_done();
        }
        assert!(String::from_utf8_lossy(&err).contains("working"));
    }
}
