//! `MemBackend` (`store=pages`): the `mem` stores' suite (`mem_suite`: data round trips, holes,
//! discard / write-zeroes semantics, allocation maps, concurrency, a flat `Vec<u8>` model).
// A plain threaded test or benchmark, never a loom model: its own harness (std locks, atomics,
// condition variables, baselines) is not what a model must explore, so it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

#[macro_use]
mod mem_suite;

use blk_drivers::backend::MemBackend;

suite!(MemBackend);
