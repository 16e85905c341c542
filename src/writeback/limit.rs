//! The writeback limit (zram's `writeback_limit` and `writeback_limit_enable`).
//!
//! The limit is counted in 4 KiB units whatever the page size (a 16 KiB page costs 4). While
//! enabled, a page is **charged when its write is submitted** and **refunded when the write
//! fails**, as upstream zram does since the batched writeback landed (charging at completion
//! would let a batch overshoot the limit by up to a batch). A page whose slot changed while its
//! write was in flight keeps its charge: the I/O was done. A charge records whether it was
//! taken while the limit was enabled, so toggling `writeback_limit_enable` between a submission
//! and its completion never refunds what was not charged.
//!
//! The limit and the enable flag belong to the device, not to one initialisation: like the
//! kernel, `reset` keeps them.

use parking_lot::Mutex;

pub use crate::units::units_per_page;

#[derive(Debug, Default, Clone, Copy)]
struct State {
    enabled: bool,
    /// Remaining 4 KiB units.
    limit_units: u64,
}

/// The limit. Protected by its mutex (zram's `wb_limit_lock`), a leaf lock.
#[derive(Debug, Default)]
pub struct WbLimit {
    state: Mutex<State>,
}

/// What a submission was charged: refunded only if it was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    /// 4 KiB units taken from the limit (0 when the limit was disabled).
    pub units: u64,
}

impl WbLimit {
    /// Whether the limit is enforced.
    pub fn enabled(&self) -> bool {
        self.state.lock().enabled
    }
    /// Turns enforcement on or off (the remaining budget is kept).
    pub fn set_enabled(&self, on: bool) {
        self.state.lock().enabled = on;
    }
    /// The remaining budget in 4 KiB units.
    pub fn limit_units(&self) -> u64 {
        self.state.lock().limit_units
    }
    /// Sets the remaining budget.
    pub fn set_limit_units(&self, units: u64) {
        self.state.lock().limit_units = units;
    }
    /// True if a page of `units` could be charged now (the limit is off or has the budget).
    pub fn has_budget(&self, units: u64) -> bool {
        let s = self.state.lock();
        !s.enabled || s.limit_units >= units
    }
    /// Charges one page of `units` at submission. `None` when the limit is enabled and
    /// exhausted (the writeback stops with `EIO`).
    pub fn charge(&self, units: u64) -> Option<Charge> {
        let mut s = self.state.lock();
        if !s.enabled {
            return Some(Charge { units: 0 });
        }
        if s.limit_units < units {
            return None;
        }
        s.limit_units -= units;
        Some(Charge { units })
    }
    /// Gives back a charge whose write failed.
    pub fn refund(&self, charge: Charge) {
        if charge.units != 0 {
            let mut s = self.state.lock();
            s.limit_units = s.limit_units.saturating_add(charge.units);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charge_refund_and_toggle() {
        let l = WbLimit::default();
        assert_eq!(l.charge(1), Some(Charge { units: 0 }));
        l.set_enabled(true);
        l.set_limit_units(5);
        let c = l.charge(4).unwrap();
        assert_eq!(l.limit_units(), 1);
        assert!(l.charge(4).is_none());
        assert!(!l.has_budget(4));
        l.refund(c);
        assert_eq!(l.limit_units(), 5);
        // A charge taken while disabled refunds nothing after enabling.
        l.set_enabled(false);
        let free = l.charge(4).unwrap();
        l.set_enabled(true);
        l.refund(free);
        assert_eq!(l.limit_units(), 5);
        assert_eq!(units_per_page(16384), 4);
    }
}
