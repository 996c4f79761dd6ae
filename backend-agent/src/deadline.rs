//! The caller's deadline: set around a call by whoever has one, carried by every request, and turned back into an instant by the agent.
//!
//! A caller that must give up by a given instant (the plugin, under `timeout_seconds`) runs its
//! store calls inside [`within`]; every [`AgentStore`](crate::AgentStore) call made inside sends
//! the earlier of that instant and its own request timeout with the request (protocol 2 on), waits
//! no longer than it, and the agent starts no commit after it.
//!
//! On the wire a deadline is the caller's `CLOCK_MONOTONIC` reading at which it gives up, plus the
//! time it had left. The agent runs on the same host and reads the same clock, so the first is
//! exact however long the request waited to be read. A peer whose monotonic clock differs (a
//! process in another time namespace) is told apart by the two forms disagreeing by more than
//! [`SAME_CLOCK_TOLERANCE`]; its deadline is then counted from the moment the request was read.

use std::future::Future;
use std::time::Duration;

use rustix::time::{clock_gettime, ClockId};
use tokio::time::Instant;

use crate::protocol::WireDeadline;

/// How far the caller's clock reading may fall before the time it had left, counted from when
/// the request was read, and still be taken for the same clock. A request does not wait this long
/// between the caller and the agent; clocks of different time namespaces differ by more.
pub const SAME_CLOCK_TOLERANCE: Duration = Duration::from_secs(60);

/// Longest deadline honoured: a caller's deadline further away than this is cut to it.
pub const LONGEST_DEADLINE: Duration = Duration::from_secs(24 * 60 * 60);

tokio::task_local! {
    static CALLER_DEADLINE: Instant;
}

/// Runs `call` with `deadline` as the deadline of every agent request made inside it (on this
/// task). An inner `within` may only make the deadline earlier.
pub async fn within<F: Future>(deadline: Instant, call: F) -> F::Output {
    let deadline = caller_deadline().map_or(deadline, |outer| outer.min(deadline));
    CALLER_DEADLINE.scope(deadline, call).await
}

/// The deadline set by the innermost [`within`] around this task, if any.
pub fn caller_deadline() -> Option<Instant> {
    CALLER_DEADLINE.try_with(|deadline| *deadline).ok()
}

/// The monotonic clock, in nanoseconds: what [`Instant`] reads on Linux, as a number that can
/// cross a socket.
fn monotonic_nanos() -> u64 {
    let now = clock_gettime(ClockId::Monotonic);
    let seconds = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec).unwrap_or(0);
    seconds.saturating_mul(1_000_000_000).saturating_add(nanos)
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

impl WireDeadline {
    /// `deadline` as sent with a request made now.
    pub fn at(deadline: Instant) -> WireDeadline {
        let remaining = nanos(deadline.saturating_duration_since(Instant::now()));
        WireDeadline {
            monotonic_nanos: monotonic_nanos().saturating_add(remaining),
            remaining_nanos: remaining,
        }
    }

    /// The instant, on this process's clock, at which the caller gives up; `received` is when
    /// the request was read. Never later than `received` plus the time the caller had left (nor
    /// than [`LONGEST_DEADLINE`] after it).
    pub fn instant(&self, received: Instant) -> Instant {
        let remaining = Duration::from_nanos(self.remaining_nanos).min(LONGEST_DEADLINE);
        let by_remaining = received + remaining;
        let (now, clock_now) = (Instant::now(), monotonic_nanos());
        let by_clock = if self.monotonic_nanos >= clock_now {
            now.checked_add(Duration::from_nanos(self.monotonic_nanos - clock_now))
        } else {
            now.checked_sub(Duration::from_nanos(clock_now - self.monotonic_nanos))
        };
        match by_clock {
            Some(by_clock)
                if by_clock <= by_remaining && by_clock + SAME_CLOCK_TOLERANCE >= by_remaining =>
            {
                by_clock
            }
            _ => by_remaining,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_deadline_crosses_the_wire_exactly_on_the_same_clock() {
        let deadline = Instant::now() + Duration::from_secs(5);
        let wire = WireDeadline::at(deadline);
        // Read late (the request waited 2 s to be read): the caller's instant still holds.
        let received = Instant::now() + Duration::from_secs(2);
        let back = wire.instant(received);
        let error = if back > deadline {
            back - deadline
        } else {
            deadline - back
        };
        assert!(error < Duration::from_secs(1), "{back:?} vs {deadline:?}");
    }

    #[tokio::test]
    async fn a_peer_on_another_clock_is_counted_from_when_its_request_was_read() {
        let received = Instant::now();
        for offset in [-3600i64, 3600] {
            let wire = WireDeadline {
                monotonic_nanos: monotonic_nanos()
                    .saturating_add_signed(offset * 1_000_000_000)
                    .saturating_add(5_000_000_000),
                remaining_nanos: 5_000_000_000,
            };
            assert_eq!(
                wire.instant(received),
                received + Duration::from_secs(5),
                "offset {offset} s"
            );
        }
        let forever = WireDeadline {
            monotonic_nanos: u64::MAX,
            remaining_nanos: u64::MAX,
        };
        assert_eq!(
            forever.instant(received),
            received + Duration::from_secs(24 * 60 * 60),
            "cut to a day"
        );
    }

    #[tokio::test]
    async fn a_request_read_after_its_callers_deadline_is_known_to_be_late() {
        // The caller had 5 s left when it sent the request, which waited 8 s to be read: its
        // deadline passed 3 s ago, not 5 s from now.
        let received = Instant::now();
        let wire = WireDeadline {
            monotonic_nanos: monotonic_nanos() - 3_000_000_000,
            remaining_nanos: 5_000_000_000,
        };
        let back = wire.instant(received);
        assert!(back < received, "{back:?} is not before {received:?}");
        let early = received - back;
        assert!(
            early > Duration::from_millis(2_500) && early < Duration::from_millis(3_500),
            "{early:?} before it was read"
        );
    }

    #[tokio::test]
    async fn the_wire_clock_is_the_monotonic_clock_in_nanoseconds() {
        // Read inside the span the process clock measures: never more than it.
        let at = Instant::now();
        let before = monotonic_nanos();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = monotonic_nanos();
        let elapsed = at.elapsed();
        let counted = Duration::from_nanos(after - before);
        assert!(
            counted >= Duration::from_millis(200) && counted <= elapsed,
            "{counted:?} counted over {elapsed:?}"
        );
    }

    #[tokio::test]
    async fn an_inner_deadline_may_only_be_earlier() {
        assert_eq!(caller_deadline(), None);
        let near = Instant::now() + Duration::from_secs(1);
        let far = near + Duration::from_secs(10);
        let seen = within(near, async {
            within(far, async { caller_deadline() }).await
        })
        .await;
        assert_eq!(seen, Some(near));
    }
}
