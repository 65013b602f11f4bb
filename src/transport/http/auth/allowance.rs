//! A token bucket for what the server does for callers it has not authenticated: the refusal
//! lines of the audit log ([`super::RefusalLog`]) and the dashboard's sign-in relay
//! (`pages::sign_in`). Neither may be driven at the rate a client can send requests.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `burst` at once, then one more every `every`.
#[derive(Debug)]
pub struct Allowance {
    burst: u32,
    every: Duration,
    /// What is still allowed now (fractional while refilling), as of the instant.
    left: Mutex<(f64, Instant)>,
}

impl Allowance {
    pub fn new(burst: u32, every: Duration) -> Self {
        Self {
            burst,
            every,
            left: Mutex::new((f64::from(burst), Instant::now())),
        }
    }

    /// Takes one place, or says how long until there is one.
    pub fn take(&self) -> Result<(), Duration> {
        let mut left = self
            .left
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        let refilled = now.duration_since(left.1).as_secs_f64() / self.every.as_secs_f64();
        *left = ((left.0 + refilled).min(f64::from(self.burst)), now);
        if left.0 >= 1.0 {
            left.0 -= 1.0;
            Ok(())
        } else {
            Err(self.every.mul_f64(1.0 - left.0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_one_every_period() {
        let allowance = Allowance::new(2, Duration::from_secs(60));
        assert!(allowance.take().is_ok() && allowance.take().is_ok());
        let wait = allowance.take().unwrap_err();
        assert!(
            wait > Duration::from_secs(59) && wait <= Duration::from_secs(60),
            "{wait:?}"
        );
        // A minute later, one more.
        let mut left = allowance.left.lock().unwrap();
        left.1 = left.1.checked_sub(Duration::from_secs(60)).unwrap();
        drop(left);
        assert!(allowance.take().is_ok());
        assert!(allowance.take().is_err());
    }
}
