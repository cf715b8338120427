//! Logging for `blkq serve` (tracing): human-readable text or one JSON object per line
//! (`--log-format json`, for log shippers), on stderr. The level is `info` (one line per
//! connection open and close, errors with their context at `warn`); `-v` is `debug`, `-vv`
//! `trace`; `--log-level FILTER` (`[server] log_level`) sets it, a level or `EnvFilter`
//! directives (`info,nbd=debug`), and SIGHUP applies a new one ([`Levels`]); `RUST_LOG`,
//! when set, wins over both.

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

/// A filter from `--log-level`'s value; the error says what is wrong with it.
pub fn parse_filter(s: &str) -> Result<tracing_subscriber::EnvFilter, String> {
    tracing_subscriber::EnvFilter::try_new(s.trim()).map_err(|e| {
        format!(
            "{s:?} is not a log filter ({e}): a level (error, warn, info, debug, trace) or \
             directives such as info,nbd=debug"
        )
    })
}

/// Changes the filter of the running subscriber (SIGHUP's `log_level`).
type SetFilter = Box<dyn Fn(tracing_subscriber::EnvFilter) -> Result<(), String> + Send + Sync>;

/// The level of the installed subscriber, changed while running ([`Levels::set`]).
pub struct Levels {
    set: SetFilter,
    verbose: u8,
    /// The `--log-level` in force (`None`: `-v`'s level).
    current: Option<String>,
}

impl Levels {
    /// Applies `--log-level` `level` (`None`: back to `-v`'s level); what changed, in words,
    /// or `None` when nothing did. `RUST_LOG`, when set, stays in force.
    pub fn set(&mut self, level: Option<&str>) -> Result<Option<String>, String> {
        if self.current.as_deref() == level {
            return Ok(None);
        }
        if std::env::var("RUST_LOG").is_ok_and(|s| !s.trim().is_empty()) {
            return Err(
                "RUST_LOG is set and wins over log_level: unset it to change the \
                        level with the configuration"
                    .into(),
            );
        }
        let f = match level {
            Some(l) => parse_filter(l)?,
            None => filter(self.verbose),
        };
        (self.set)(f)?;
        self.current = level.map(str::to_string);
        Ok(Some(match level {
            Some(l) => format!("log level now {l:?}"),
            None => "log level back to the command line's".to_string(),
        }))
    }
}

/// Installs the global subscriber (once: a later call changes nothing and returns `None`);
/// returns the handle that changes its level.
pub fn init(format: LogFormat, verbose: u8) -> Option<Levels> {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter(verbose))
        .with_writer(std::io::stderr);
    let set: SetFilter = match format {
        LogFormat::Text => {
            let b = builder
                .with_ansi(std::io::stderr().is_terminal())
                .with_filter_reloading();
            let h = b.reload_handle();
            b.try_init().ok()?;
            Box::new(move |f| h.reload(f).map_err(|e| e.to_string()))
        }
        LogFormat::Json => {
            let b = builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .with_filter_reloading();
            let h = b.reload_handle();
            b.try_init().ok()?;
            Box::new(move |f| h.reload(f).map_err(|e| e.to_string()))
        }
    };
    Some(Levels {
        set,
        verbose,
        current: None,
    })
}
