//! The control socket of `blkq serve --raid1 ... --control PATH`: [`protocol`] (the command
//! lines and replies, both ends), [`server`] (the socket and the array behind it) and
//! [`client`] (what `blkq raid ... --control PATH` sends).

pub mod client;
pub mod protocol;
pub mod server;
