//! `nbd`: an NBD (Network Block Device) server and a blocking client over the sans-I/O codec
//! of the `nbd-proto` crate.
//!
//! - [`server`]: the NBD server (TCP and Unix listeners, a thread per connection, batched
//!   submission to a [`blk::Device`], coalesced replies).
//! - [`client`]: a small blocking client (tests, tools, and a remote leg's handshakes).
//! - [`remote`]: an export on another NBD server as a [`blk::Device`] (`nbd://`, `nbd+unix://`).
//! - [`stream`]: one type over TCP and Unix stream sockets, plain or TLS ([`socket`]: the
//!   plain one; [`tls`]: TLS over it).
//! - [`unix_listener`]: Unix sockets bound private from their first moment.
//!
//! The codec (`nbd-proto`) is re-exported under one name, [`codec`] (`nbd::codec::Command`,
//! `nbd::codec::proto`, ...), so a user of the server or the client needs one dependency.
#![warn(missing_docs)]
// Only `sys` (one `sendmsg` call) opts back in.
#![deny(unsafe_code)]
#![warn(clippy::too_many_lines)]

pub mod client;
mod coverage;
#[cfg(not(blkq_loom))]
#[doc(hidden)]
pub mod fuzzing;
pub mod remote;
pub mod server;
pub mod socket;
pub mod stream;
mod sys;
pub mod tls;
pub mod unix_listener;

/// The sans-I/O codec crate, `nbd-proto`.
pub use nbd_proto as codec;
