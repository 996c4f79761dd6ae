//! RFC 3339 UTC timestamps for the `timestamp` attribute: the model's codec, which the agent's leak pass reads back.

pub use ipam_core::model::timestamp::{format_unix, now_rfc3339};
