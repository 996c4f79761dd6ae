//! RFC 3339 UTC timestamps (`2024-05-01T12:34:56Z`) for the `timestamp` attribute, both ways, without a date-time crate.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch on this machine's clock (0 if the clock reads before 1970).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Now, as RFC 3339 UTC with whole seconds.
pub fn now_rfc3339() -> String {
    format_unix(unix_now())
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

/// Days in `month` (1 to 12) of `year`, by the Gregorian calendar's leap years.
fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Unix seconds of an RFC 3339 UTC time `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (what the plugin writes);
/// `None` for anything else.
pub fn parse_rfc3339_utc(text: &str) -> Option<u64> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut date = date.splitn(3, '-').map(str::parse::<u64>);
    let (year, month, day) = (date.next()?.ok()?, date.next()?.ok()?, date.next()?.ok()?);
    let time = time.split_once('.').map_or(time, |(whole, _)| whole);
    let mut time = time.splitn(3, ':').map(str::parse::<u64>);
    let (hour, minute, second) = (time.next()?.ok()?, time.next()?.ok()?, time.next()?.ok()?);
    if !(1970..=9999).contains(&year)
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
        || day > days_in_month(year, month)
    {
        return None;
    }
    // Days from 1970-01-01 to the civil date (Howard Hinnant's days_from_civil).
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y / 400;
    let year_of_era = y - era * 400;
    let day_of_year = (153 * m + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = (era * 146_097 + day_of_era).checked_sub(719_468)?;
    Some(days * 86_400 + hour * 3_600 + minute * 60 + second)
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

    #[test]
    fn what_is_formatted_parses_back_to_the_same_second() {
        for seconds in [0, 59, 86_399, 951_782_400, 1_709_210_096, 4_102_444_799] {
            assert_eq!(parse_rfc3339_utc(&format_unix(seconds)), Some(seconds));
        }
        // Every day from 1970 to 2199 (leap years, 2000 that is one and 2100 that is not, every
        // century's start of March), at a second that is not round.
        for day in 0..84_006 {
            let seconds = day * 86_400 + 45_296;
            assert_eq!(parse_rfc3339_utc(&format_unix(seconds)), Some(seconds));
        }
        assert_eq!(
            parse_rfc3339_utc("2024-02-29T12:34:56.789Z"),
            Some(1_709_210_096),
            "a fraction is dropped"
        );
        assert_eq!(
            parse_rfc3339_utc("2016-12-31T23:59:60Z"),
            Some(1_483_228_800),
            "a leap second (RFC 3339 allows it) is the next minute's first"
        );
    }

    #[test]
    fn now_is_this_machines_clock_both_ways() {
        let before = unix_now();
        let text = now_rfc3339();
        let after = unix_now();
        // 2024-01-01T00:00:00Z: no machine running this test reads earlier.
        assert!(before >= 1_704_067_200, "{before}");
        let parsed = parse_rfc3339_utc(&text).unwrap_or_else(|| panic!("{text:?}"));
        assert!(
            (before..=after).contains(&parsed),
            "{before} {text} {after}"
        );
    }

    #[test]
    fn anything_else_is_not_a_time() {
        for text in [
            "",
            "2024-02-29T12:34:56",
            "2024-02-29 12:34:56Z",
            "2024-13-01T00:00:00Z",
            "2024-00-01T00:00:00Z",
            "2024-01-32T00:00:00Z",
            "2023-02-29T00:00:00Z",
            "2100-02-29T00:00:00Z",
            "2024-02-30T00:00:00Z",
            "2024-04-31T00:00:00Z",
            "2024-06-31T00:00:00Z",
            "2024-09-31T00:00:00Z",
            "2024-11-31T00:00:00Z",
            "2024-01-01T24:00:00Z",
            "2024-01-01T00:60:00Z",
            "2024-01-01T00:00:61Z",
            "1969-12-31T23:59:59Z",
            "2024-01-01T00:00:00+01:00",
            "yesterday",
        ] {
            assert_eq!(parse_rfc3339_utc(text), None, "{text:?}");
        }
    }
}
