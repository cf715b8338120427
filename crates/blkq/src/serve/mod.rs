//! `blkq serve`, in the order it runs: [`args`] (the flags, and the sections a `--config`
//! file shares with them), [`config`] (flags or file into one configuration), [`settings`]
//! (checked, nothing opened), [`plan`] (devices opened, mirrors assembled), [`tls`] (the
//! certificates loaded) and [`run`] (the server started, signals, shutdown).

pub mod args;
pub mod bitmaps;
pub mod config;
pub mod devices;
pub mod notify;
pub mod plan;
pub mod reload;
pub mod run;
pub mod settings;
pub mod tls;
