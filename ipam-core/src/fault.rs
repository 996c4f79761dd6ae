//! Named crash points for fault-injection tests: compiled to nothing unless the `fault-injection` feature is on.
//!
//! With the feature, setting `BLOCKIPAM_FAULT=<point>[:<nth>]` in a process's environment makes it
//! abort (`std::process::abort`: no destructors run, no buffer is flushed, no lock is released
//! except by the kernel) the `nth` time (default 1) it reaches the named [`FaultPoint`]. The crash
//! tests run the real plugin binary this way. The shipped binaries are built without the feature:
//! then [`point`] is an empty inline function and neither the variable's name nor the point names
//! are in the binary.

/// A place where a fault-injection test may crash the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// The plugin holds its host lock and has not opened the store yet (`holding-lock`).
    HoldingLock,
    /// The allocator is about to commit a transaction (`before-commit`).
    BeforeCommit,
    /// The store acknowledged a transaction; nothing was replied yet (`after-commit`).
    AfterCommit,
    /// The plugin's command succeeded (store closed, lock released); the result is not printed
    /// yet (`before-reply`).
    BeforeReply,
}

/// Marks a fault point: a no-op without the `fault-injection` feature.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn point(_point: FaultPoint) {}

/// Marks a fault point: aborts the process if `BLOCKIPAM_FAULT` names this point and this is its
/// `nth` hit.
#[cfg(feature = "fault-injection")]
pub fn point(point: FaultPoint) {
    armed::hit(point);
}

#[cfg(feature = "fault-injection")]
pub use armed::{parse_spec, FaultSpec, ENV_FAULT};

#[cfg(feature = "fault-injection")]
mod armed {
    use std::io::Write;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::OnceLock;

    use super::FaultPoint;

    /// The environment variable that arms a fault point.
    pub const ENV_FAULT: &str = "BLOCKIPAM_FAULT";

    /// Exit status of a process whose `BLOCKIPAM_FAULT` does not parse (a test bug, never a
    /// crash: a test that sees it must fail rather than count a fault).
    const INVALID_SPEC_STATUS: i32 = 86;

    /// An armed fault: crash at the `nth` hit of `point`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct FaultSpec {
        /// Where.
        pub point: FaultPoint,
        /// At which hit of that point (1 = the first).
        pub nth: u32,
    }

    impl FaultPoint {
        /// Every point, in the order of [`FaultPoint::name`].
        pub const ALL: [FaultPoint; 4] = [
            FaultPoint::HoldingLock,
            FaultPoint::BeforeCommit,
            FaultPoint::AfterCommit,
            FaultPoint::BeforeReply,
        ];

        /// The name used in `BLOCKIPAM_FAULT`.
        pub fn name(self) -> &'static str {
            match self {
                FaultPoint::HoldingLock => "holding-lock",
                FaultPoint::BeforeCommit => "before-commit",
                FaultPoint::AfterCommit => "after-commit",
                FaultPoint::BeforeReply => "before-reply",
            }
        }

        fn index(self) -> usize {
            match self {
                FaultPoint::HoldingLock => 0,
                FaultPoint::BeforeCommit => 1,
                FaultPoint::AfterCommit => 2,
                FaultPoint::BeforeReply => 3,
            }
        }
    }

    /// Parses `<point>[:<nth>]`.
    ///
    /// # Errors
    /// A message naming what is wrong: an unknown point, or an `nth` that is not a positive
    /// integer.
    pub fn parse_spec(text: &str) -> Result<FaultSpec, String> {
        let (name, nth) = match text.split_once(':') {
            Some((name, nth)) => (name, Some(nth)),
            None => (text, None),
        };
        let point = FaultPoint::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown fault point {name:?} (known: {})",
                    FaultPoint::ALL.map(FaultPoint::name).join(", ")
                )
            })?;
        let nth = match nth {
            None => 1,
            Some(text) => text
                .parse::<u32>()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| format!("invalid hit number {text:?}: expected 1 or more"))?,
        };
        Ok(FaultSpec { point, nth })
    }

    static HITS: [AtomicU32; 4] = [
        AtomicU32::new(0),
        AtomicU32::new(0),
        AtomicU32::new(0),
        AtomicU32::new(0),
    ];

    fn armed() -> Option<FaultSpec> {
        static ARMED: OnceLock<Option<FaultSpec>> = OnceLock::new();
        *ARMED.get_or_init(|| {
            let text = std::env::var(ENV_FAULT).ok()?;
            match parse_spec(&text) {
                Ok(spec) => Some(spec),
                Err(why) => {
                    let _ = writeln!(std::io::stderr(), "{ENV_FAULT}={text:?}: {why}");
                    std::process::exit(INVALID_SPEC_STATUS);
                }
            }
        })
    }

    pub(super) fn hit(point: FaultPoint) {
        let Some(spec) = armed() else {
            return;
        };
        if spec.point != point {
            return;
        }
        let count = HITS[point.index()].fetch_add(1, Ordering::SeqCst) + 1;
        if count == spec.nth {
            // stderr is unbuffered: the line is out before the abort.
            let _ = writeln!(
                std::io::stderr(),
                "fault injection: aborting at {} (hit {count})",
                point.name()
            );
            std::process::abort();
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn spec_parses_point_and_optional_hit_number() {
            assert_eq!(
                parse_spec("before-commit"),
                Ok(FaultSpec {
                    point: FaultPoint::BeforeCommit,
                    nth: 1
                })
            );
            assert_eq!(
                parse_spec("after-commit:3"),
                Ok(FaultSpec {
                    point: FaultPoint::AfterCommit,
                    nth: 3
                })
            );
            for point in FaultPoint::ALL {
                assert_eq!(parse_spec(point.name()).map(|s| s.point), Ok(point));
            }
        }

        #[test]
        fn spec_rejects_unknown_points_and_bad_hit_numbers() {
            assert!(parse_spec("before-comit").is_err());
            assert!(parse_spec("holding-lock:0").is_err());
            assert!(parse_spec("holding-lock:x").is_err());
            assert!(parse_spec("").is_err());
        }
    }
}
