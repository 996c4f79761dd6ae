//! RFC 3339 UTC timestamps for the `timestamp` attribute, without a date-time crate.
//!
//! RFC 3339 UTC timestamps (`2024-05-01T12:34:56Z`) for the `timestamp` attribute, without a
//! date-time crate.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, as RFC 3339 UTC with whole seconds.
pub fn now_rfc3339() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_unix(seconds)
}

/// Formats seconds since the Unix epoch as RFC 3339 UTC.
pub fn format_unix(seconds: u64) -> String {
    let days = seconds / 86_400;
    let rest = seconds % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        (rest % 3600) / 60,
        rest % 60
    )
}

/// Howard Hinnant's `civil_from_days` for days since 1970-01-01 (non-negative).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants_format_as_rfc3339_utc() {
        assert_eq!(format_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_unix(1_709_210_096), "2024-02-29T12:34:56Z");
        assert_eq!(format_unix(4_102_444_799), "2099-12-31T23:59:59Z");
    }
}
