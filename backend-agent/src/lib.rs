//! The store adapter that reaches a `blockipam-agent` over its unix socket, and the protocol both sides speak.
//!
//! A node agent holds the configured store open for its whole life and serves the
//! [`KvStore`](ipam_core::KvStore) trait itself over a unix socket; [`AgentStore`] is the adapter on
//! the other end, so the allocator, the plugin and the CLI run unchanged on top of it.
//!
//! The protocol ([`protocol`]) is a stream of length-prefixed bincode frames: a 4-byte big-endian
//! length, then one encoded [`RequestFrame`](protocol::RequestFrame) or
//! [`ResponseFrame`](protocol::ResponseFrame). Every request carries an id and the answer repeats it,
//! so one connection carries many calls at once. The first request is a hello: the agent answers
//! with its protocol version and which store it serves ([`StoreIdentity`]), or refuses a peer whose
//! uid it does not allow. Store errors cross the socket with their kind and fields intact.
//!
//! Every request carries the caller's deadline ([`deadline`]; protocol 2 on, negotiated in the
//! hello, with protocol 1 still spoken to and by the previous release): the agent starts no commit
//! after it, and orders later requests behind any commit already started. Protocol 3 adds range
//! reads (`Read::Range`) to batched reads; with an agent that speaks an earlier version the client
//! reads the prefix's listing instead and cuts the window itself.
//!
//! Every call is bounded ([`AgentConfig`]): a socket that exists but does not answer is
//! [`KvError::Unavailable`](ipam_core::KvError::Unavailable); a connection lost (or an answer
//! missing) while a transaction was in flight is
//! [`KvError::Indeterminate`](ipam_core::KvError::Indeterminate); a read that fails that way is
//! `Unavailable`.

mod config;
pub mod deadline;
mod error;
pub mod protocol;
mod store;

pub use config::{AgentConfig, DEFAULT_AGENT_SOCKET};
pub use protocol::StoreIdentity;
pub use store::AgentStore;
