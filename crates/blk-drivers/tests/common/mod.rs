//! Helpers shared by the mq-deadline tests.
#![allow(dead_code)] // each test file uses its own subset

use std::sync::Arc;

use blk::sched::{Deadline, LockMode};
use blk::Queue;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};

/// The queue `spec` names (one with `sched=mq-deadline`), its scheduler's lock in `mode`.
pub fn deadline_queue(spec: &str, mode: LockMode) -> Arc<Queue> {
    Arc::new(
        spec.parse::<DeviceSpec>()
            .unwrap()
            .build(&QueueOverrides {
                sched_lock: Some(mode),
                ..Default::default()
            })
            .unwrap(),
    )
}

/// The queue's mq-deadline scheduler.
pub fn deadline(q: &Queue) -> &Deadline {
    q.scheduler()
        .unwrap()
        .as_any()
        .unwrap()
        .downcast_ref::<Deadline>()
        .unwrap()
}
