//! Process-wide on/off switches for kernel choices: a call sets one, and until one does an
//! environment variable decides, read once.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

pub(crate) struct EnvSwitch {
    /// 0: no call yet (the environment decides), 1: on, 2: off.
    state: AtomicU8,
    var: &'static str,
    /// The value without a call or a variable; the variable flips it only when set to the
    /// other value (`0` for a switch on by default, `1` for one off by default).
    default: bool,
    /// The variable's explicit choice: `1` on, `0` off, anything else (or unset) none.
    from_env: OnceLock<Option<bool>>,
}

impl EnvSwitch {
    pub(crate) const fn new(var: &'static str, default: bool) -> Self {
        Self {
            state: AtomicU8::new(0),
            var,
            default,
            from_env: OnceLock::new(),
        }
    }

    pub(crate) fn set(&self, on: bool) {
        self.state.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> bool {
        self.get_or(self.default)
    }

    /// The switch where a call or the variable chose, else `default` (a switch whose default
    /// depends on the model it applies to).
    pub(crate) fn get_or(&self, default: bool) -> bool {
        match self.state.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => self
                .from_env
                .get_or_init(|| match std::env::var(self.var).as_deref() {
                    Ok("1") => Some(true),
                    Ok("0") => Some(false),
                    _ => None,
                })
                .unwrap_or(default),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::EnvSwitch;

    /// Unset variables give the default; a call overrides whatever the environment said.
    #[test]
    fn a_call_overrides_the_default() {
        let on = EnvSwitch::new("DFLASH_TEST_SWITCH_UNSET_ON", true);
        let off = EnvSwitch::new("DFLASH_TEST_SWITCH_UNSET_OFF", false);
        assert!(on.get() && !off.get());
        on.set(false);
        off.set(true);
        assert!(!on.get() && off.get());
    }

    /// Without a call or a variable, the caller's default decides.
    #[test]
    fn an_unset_switch_takes_the_callers_default() {
        let auto = EnvSwitch::new("DFLASH_TEST_SWITCH_UNSET_AUTO", false);
        assert!(auto.get_or(true) && !auto.get_or(false) && !auto.get());
        auto.set(true);
        assert!(auto.get_or(false));
    }
}
