//! Loom models of the chained wake-up rule (`WakeAlgo::Chain`, module docs of
//! `sbitmap::queue`, "The chained rule"):
//!
//! - depth 4 (wake batch 2 under loom's two wait queues), all tags held, two sleepers that
//!   keep the tag they get, then one batch of two frees: the chained rule wakes one head, and
//!   a link must wake the other (a lost link leaves a sleeper behind a free tag: loom reports
//!   the deadlock); the counter rule passes the same model;
//! - the nested-free model of the counter algorithm, under the chained rule (batch 1);
//! - the first model without the links must fail (run in a child process).
#![cfg(blkq_loom)]

mod common;

use blkq_sync::{thread, Arc};
use sbitmap::{SbitmapQueue, WakeAlgo};

/// Depth 4 (wake batch 2 under loom's two wait queues), all four tags held, two sleepers that
/// keep the tag they get; once both count as waiting, two frees: one due batch. The chained
/// rule wakes one head; the other sleeper gets the second free tag only through a link.
///
/// The frees wait for both sleepers to count themselves first, as the rules assume: a free
/// counted while fewer than a batch of frees are still to come relies on later frees (tags
/// in flight), and this model has none after its two.
fn one_batch_two_sleepers(sbq: SbitmapQueue) {
    let sbq = Arc::new(sbq);
    assert_eq!(sbq.wake_batch(), 2, "the model needs a batch of two");
    let tags: Vec<u32> = (0..4).map(|_| sbq.get().unwrap()).collect();
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let q = sbq.clone();
            thread::spawn(move || q.get_or_wait())
        })
        .collect();
    while sbq.ws_active() < 2 {
        thread::yield_now();
    }
    assert!(sbq.put(tags[0]));
    assert!(sbq.put(tags[1]));
    let got: Vec<u32> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert_ne!(got[0], got[1]);
    assert_eq!(sbq.bitmap().weight(), 4);
}

#[test]
fn loom_chain_batch_wakes_every_sleeper_with_a_tag() {
    blkq_sync::model(|| {
        one_batch_two_sleepers(SbitmapQueue::new(4, None, false, WakeAlgo::Chain).unwrap())
    });
}

#[test]
fn loom_chain_nested_free() {
    blkq_sync::model(|| common::two_sleepers_two_frees(WakeAlgo::Chain, true));
}

#[test]
fn loom_chain_without_links_fails() {
    let stderr = testkit::loom_child::expect_model_failure(
        "loom_chain_without_links_fails",
        "the chain without links passed the model",
        || one_batch_two_sleepers(SbitmapQueue::new_chain_without_links(4).unwrap()),
    );
    assert!(
        stderr.contains("deadlock"),
        "child failed for another reason:\n{stderr}"
    );
}

#[test]
fn loom_counter_batch_wakes_every_sleeper_with_a_tag() {
    blkq_sync::model(|| {
        one_batch_two_sleepers(SbitmapQueue::new(4, None, false, WakeAlgo::Counter).unwrap())
    });
}
