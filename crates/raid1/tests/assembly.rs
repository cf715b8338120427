//! `Assembly::decide`: what a set of superblocks says about the array the legs form, without
//! a device: the array most legs belong to, foreign and duplicate legs refused, the newest
//! view (events first; equal events that disagree; split brain), and each leg's slot.

use raid1::superblock::{Role, Superblock};
use raid1::{Assembly, AssemblyError};

fn array(legs: usize) -> Vec<Superblock> {
    Superblock::new_array(legs, 64 << 20, 1 << 20).unwrap()
}

fn decide(sbs: &[&Superblock]) -> Result<Assembly, AssemblyError> {
    let given: Vec<Option<&Superblock>> = sbs.iter().map(|sb| Some(*sb)).collect();
    Assembly::decide(&given)
}

#[test]
fn one_array_takes_its_slots_from_the_newest_superblock() {
    let mut a = array(3);
    a[1].events = 5;
    let got = decide(&[&a[2], &a[1], &a[0]]).unwrap();
    assert_eq!(got.newest, 1);
    assert_eq!(got.slots, vec![Some(2), Some(1), Some(0)]);
    assert!(got.warnings.is_empty());
}

#[test]
fn unreadable_legs_are_left_out_and_take_no_slot() {
    let a = array(2);
    let got = Assembly::decide(&[None, Some(&a[1])]).unwrap();
    assert_eq!(got.newest, 1);
    assert_eq!(got.slots, vec![None, Some(1)]);
    assert_eq!(
        Assembly::decide(&[None, None]),
        Err(AssemblyError::NoSuperblock)
    );
    assert_eq!(Assembly::decide(&[]), Err(AssemblyError::NoSuperblock));
}

#[test]
fn a_spare_and_a_replaced_leg_take_no_slot() {
    let mut a = array(2);
    // Slot 1 was given to a new leg since: the old leg's superblock still claims it.
    let mut old = a[1].clone();
    old.events = 1;
    a[0].events = 3;
    a[0].legs[1].uuid = uuid::Uuid::new_v4();
    let mut spare = a[0].clone();
    spare.leg_uuid = uuid::Uuid::new_v4();
    spare.role = Role::Spare;
    let got = decide(&[&a[0], &old, &spare]).unwrap();
    assert_eq!(got.newest, 0);
    assert_eq!(got.slots, vec![Some(0), None, None]);
}

#[test]
fn the_array_most_legs_belong_to_wins_and_the_other_leg_is_named() {
    let mut a = array(2);
    let mut c = array(2);
    // The foreign leg is newer: the majority still decides which array this is.
    c[0].events = 9;
    a[0].events = 2;
    let err = decide(&[&a[0], &c[0], &a[1]]).unwrap_err();
    assert_eq!(
        err,
        AssemblyError::ForeignLeg {
            leg: 1,
            its: c[0].array_uuid,
            members: vec![0, 2],
            array: a[0].array_uuid,
        }
    );
    assert!(err.to_string().contains("another array"), "{err}");
    // One leg each: the newer array's (then the earlier leg's) is the array.
    match decide(&[&a[0], &c[0]]).unwrap_err() {
        AssemblyError::ForeignLeg { leg, .. } => assert_eq!(leg, 0),
        e => panic!("{e}"),
    }
    c[0].events = 2;
    match decide(&[&a[0], &c[0]]).unwrap_err() {
        AssemblyError::ForeignLeg { leg, .. } => assert_eq!(leg, 1),
        e => panic!("{e}"),
    }
}

#[test]
fn a_leg_given_twice_is_refused() {
    let a = array(2);
    assert_eq!(
        decide(&[&a[0], &a[1], &a[0]]),
        Err(AssemblyError::DuplicateLeg {
            first: 0,
            second: 2,
            leg_uuid: a[0].leg_uuid,
        })
    );
}

#[test]
fn equal_events_that_disagree_pick_the_view_recording_the_failure_in_any_order() {
    let a = array(2);
    let mut b = a[1].clone();
    b.legs[0].faulty = true;
    for (order, want) in [(vec![&a[0], &b], 1), (vec![&b, &a[0]], 0)] {
        let got = decide(&order).unwrap();
        assert_eq!(got.newest, want);
        assert_eq!(got.warnings.len(), 1, "{:?}", got.warnings);
    }
}

#[test]
fn split_brain_is_refused() {
    let a = array(2);
    let (mut x, mut y) = (a[0].clone(), a[1].clone());
    x.legs[1].faulty = true;
    y.legs[0].faulty = true;
    let err = decide(&[&x, &y]).unwrap_err();
    assert_eq!(
        err,
        AssemblyError::SplitBrain {
            legs: vec![0, 1],
            events: 1,
        }
    );
    assert!(err.to_string().contains("split brain"), "{err}");
}
