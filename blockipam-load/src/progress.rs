//! The progress line on a terminal: one line on stderr, rewritten in place, cleared at the end.

use std::io::Write;

use crate::run::Progress;

/// Renders `progress` as one line (without the carriage return).
pub fn line(progress: &Progress) -> String {
    let seconds = progress.elapsed.as_secs_f64();
    let rate = if seconds > 0.0 {
        progress.finished as f64 / seconds
    } else {
        0.0
    };
    let done = match (progress.planned, progress.duration) {
        (Some(planned), _) if planned > 0 => {
            let share = (progress.finished as f64 / planned as f64).min(1.0);
            let filled = (share * 20.0).round() as usize;
            format!(
                "[{}{}] {}/{planned} ops",
                "#".repeat(filled),
                " ".repeat(20 - filled),
                progress.finished
            )
        }
        (_, Some(duration)) => format!(
            "{} ops, {:.0}/{:.0} s",
            progress.finished,
            seconds,
            duration.as_secs_f64()
        ),
        _ => format!("{} ops", progress.finished),
    };
    format!(
        "{done}  {rate:.0} ops/s  {} errors  {seconds:.1} s",
        progress.errors
    )
}

/// Writes the progress line to `terminal` (a TTY), and clears it after the last call.
pub fn draw(terminal: &mut dyn Write, progress: &Progress) {
    let _ = if progress.done {
        write!(terminal, "\r\x1b[2K")
    } else {
        write!(terminal, "\r\x1b[2K{}", line(progress))
    };
    let _ = terminal.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_line_shows_a_bar_when_the_total_is_known() {
        let progress = Progress {
            finished: 50,
            errors: 1,
            planned: Some(100),
            elapsed: Duration::from_secs(2),
            duration: None,
            done: false,
        };
        let text = line(&progress);
        assert!(
            text.starts_with("[##########          ] 50/100 ops"),
            "{text}"
        );
        assert!(
            text.contains("25 ops/s") && text.contains("1 errors"),
            "{text}"
        );
        let timed = Progress {
            planned: None,
            duration: Some(Duration::from_secs(60)),
            ..progress
        };
        assert!(line(&timed).contains("50 ops, 2/60 s"), "{}", line(&timed));
    }
}
