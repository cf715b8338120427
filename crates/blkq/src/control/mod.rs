//! The control socket of `blkq serve --control PATH`: [`protocol`] (the mirror's command
//! lines and replies, both ends), [`bitmap`] (the dirty-bitmap commands, and the handler that
//! serves every export's), [`server`] (the array behind the socket), [`socket`] (the
//! socket's server) and [`client`] (what `blkq raid ... --control PATH` and
//! `blkq bitmap ... --control PATH` send).

pub mod bitmap;
pub mod client;
pub mod exports;
pub mod protocol;
pub mod server;
pub mod socket;
