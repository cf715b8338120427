//! What the simulators print of a mirror.

use raid1::LegStatus;

/// A present leg's state in a trace: `F` faulty, `S` in sync, `R@<offset>K` recovering.
pub fn leg_state(s: &LegStatus) -> String {
    if s.faulty {
        "F".to_string()
    } else if s.in_sync {
        "S".to_string()
    } else {
        format!("R@{}K", s.recovery_offset >> 10)
    }
}
