//! Logging for `blkq serve` (tracing): human-readable text or one JSON object per line
//! (`--log-format json`, for log shippers), on stderr. The level is `info` (one line per
//! connection open and close, errors with their context at `warn`); `-v` is `debug`, `-vv`
//! `trace`; `RUST_LOG` (an `EnvFilter` directive such as `nbd=debug`), when set, wins.

use std::io::IsTerminal;

use clap::ValueEnum;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event (colours on a terminal).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and the event's
    /// fields at the top level (`peer`, `export`, `bytes_read`, ...).
    Json,
}

/// The filter for `verbose` `-v`s, unless `RUST_LOG` says otherwise.
fn filter(verbose: u8) -> tracing_subscriber::EnvFilter {
    // rustls warns, at every connection, about clients that send an IP address as the TLS
    // server name (qemu does): not the operator's business unless asked with RUST_LOG.
    let level = match verbose {
        0 => "info,rustls=error",
        1 => "debug,rustls=error",
        _ => "trace",
    };
    match std::env::var("RUST_LOG") {
        Ok(s) if !s.trim().is_empty() => {
            tracing_subscriber::EnvFilter::try_new(&s).unwrap_or_else(|e| {
                eprintln!("RUST_LOG={s:?} is not a valid filter ({e}); using {level}");
                tracing_subscriber::EnvFilter::new(level)
            })
        }
        _ => tracing_subscriber::EnvFilter::new(level),
    }
}

/// Installs the global subscriber (once; later calls do nothing).
pub fn init(format: LogFormat, verbose: u8) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter(verbose))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
}
