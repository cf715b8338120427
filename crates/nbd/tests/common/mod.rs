//! Helpers shared by the NBD server's integration tests.
#![allow(dead_code)]

use nbd::client::ClientOptions;

pub mod hooks;
pub mod hostile_server;
pub mod link;
pub mod load;
pub mod mirror;
pub mod nbdkit;
pub mod pki;
pub mod served;
pub mod stamp;
pub mod tracking;
pub mod trickle;

/// Client options for each transmission mode: simple replies, structured replies, extended
/// headers.
pub fn modes() -> Vec<(&'static str, ClientOptions)> {
    vec![
        (
            "simple",
            ClientOptions {
                structured: false,
                base_allocation: false,
                ..ClientOptions::default()
            },
        ),
        ("structured", ClientOptions::default()),
        (
            "extended",
            ClientOptions {
                extended: true,
                ..ClientOptions::default()
            },
        ),
    ]
}
