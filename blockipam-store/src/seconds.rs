//! Numbers of seconds (lock waits, timeouts, deadlines) as every entry point accepts them.

use std::time::Duration;

/// Largest number of seconds accepted anywhere: one day.
pub const MAX_SECONDS: f64 = 86_400.0;

/// Why a number of seconds was refused; each entry point words the message for its own flag,
/// variable or netconf key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecondsError {
    /// The text is not a number.
    NotANumber,
    /// A number, but negative, not finite, above [`MAX_SECONDS`], or (where zero is refused)
    /// zero or so small that it is zero once counted in nanoseconds.
    OutOfRange,
}

/// `value` seconds as a duration: finite, from 0 up to [`MAX_SECONDS`], and not zero unless
/// `allow_zero` (a positive value below one nanosecond is zero).
///
/// # Errors
/// [`SecondsError::OutOfRange`] for any other value.
pub fn seconds_from_f64(value: f64, allow_zero: bool) -> Result<Duration, SecondsError> {
    if !value.is_finite() || value > MAX_SECONDS {
        return Err(SecondsError::OutOfRange);
    }
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|duration| allow_zero || !duration.is_zero())
        .ok_or(SecondsError::OutOfRange)
}

/// `text` (surrounding white space ignored, fractions allowed) as a number of seconds, under the
/// rules of [`seconds_from_f64`].
///
/// # Errors
/// [`SecondsError::NotANumber`] when `text` is not a number; otherwise as [`seconds_from_f64`].
pub fn parse_seconds(text: &str, allow_zero: bool) -> Result<Duration, SecondsError> {
    let value: f64 = text.trim().parse().map_err(|_| SecondsError::NotANumber)?;
    seconds_from_f64(value, allow_zero)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_from_zero_to_one_day_are_accepted_with_fractions() {
        assert_eq!(
            parse_seconds(" 0.5 ", false),
            Ok(Duration::from_millis(500))
        );
        assert_eq!(parse_seconds("0", true), Ok(Duration::ZERO));
        assert_eq!(
            parse_seconds("86400", false),
            Ok(Duration::from_secs(86_400))
        );
        assert_eq!(seconds_from_f64(2.0, false), Ok(Duration::from_secs(2)));
    }

    #[test]
    fn zero_is_refused_where_it_is_not_allowed_even_below_one_nanosecond() {
        for zero in ["0", "0.0", "1e-10"] {
            assert_eq!(
                parse_seconds(zero, false),
                Err(SecondsError::OutOfRange),
                "{zero}"
            );
        }
        assert_eq!(parse_seconds("1e-10", true), Ok(Duration::ZERO));
    }

    #[test]
    fn negative_endless_and_over_a_day_are_out_of_range_and_words_are_not_numbers() {
        for bad in ["-1", "-1e-12", "inf", "NaN", "86400.5", "1e300"] {
            assert_eq!(
                parse_seconds(bad, true),
                Err(SecondsError::OutOfRange),
                "{bad}"
            );
        }
        for bad in ["", "ten", "1s", "1,5"] {
            assert_eq!(
                parse_seconds(bad, true),
                Err(SecondsError::NotANumber),
                "{bad}"
            );
        }
    }
}
