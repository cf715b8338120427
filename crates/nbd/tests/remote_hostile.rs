//! `nbd::remote::RemoteDevice` against a hostile server (`common::hostile_server`): what a
//! server it dials sends must not make the client use unbounded memory, nor hold a request or
//! a connection attempt past its deadline, nor hand out bytes no reply wrote.
// A plain threaded test, never a loom model: its own harness (std locks and atomics) is not
// what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nbd::proto::*;
use nbd::remote::RemoteDevice;

use common::hostile_server::{HostileServer, Peer};
use common::served::log;

/// Replies the flooding server sends to `NBD_OPT_GO` before its real answer.
const FLOOD: usize = 20_000;

/// H1: a server that answers `NBD_OPT_GO` with a flood of `NBD_REP_INFO` replies (4000-byte
/// descriptions, 80 MB in all) before the export's: the client processes each as it arrives
/// and gives the attempt up once the replies pass the per-option bound, rather than keeping
/// them all.
#[test]
fn a_flood_of_option_replies_fails_the_attempt_within_the_bound() {
    log();
    let sent = Arc::new(AtomicUsize::new(0));
    let s2 = sent.clone();
    let srv = HostileServer::start(move |_, p: &mut Peer| {
        p.greet()?;
        loop {
            let (opt, _) = p.option()?;
            if opt != NBD_OPT_GO {
                p.reply(opt, NBD_REP_ACK, &[])?;
                continue;
            }
            let mut d = NBD_INFO_DESCRIPTION.to_be_bytes().to_vec();
            d.extend_from_slice(&[b'x'; 4000]);
            for _ in 0..FLOOD {
                p.reply(opt, NBD_REP_INFO, &d)?;
                s2.fetch_add(1, Ordering::SeqCst);
            }
            p.go_replies(opt)?;
            return p.swallow();
        }
    });
    let r = RemoteDevice::connect(srv.spec(Duration::from_secs(5), Duration::from_secs(1)));
    let n = sent.load(Ordering::SeqCst);
    let e = match r {
        Ok(_) => panic!("connected after the server sent {n} replies to one option"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("replies"), "{e}");
    // What the client read before it gave up, and what the socket's buffers held.
    assert!(n < FLOOD / 10, "the server sent {n} replies");
}
