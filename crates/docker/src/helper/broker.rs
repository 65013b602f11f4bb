//! The broker binary this server carries (built by `build.rs`, embedded here): the egress proxy
//! with TLS termination for secrets brokering (`broker/`, docs/egress.md). When the build has
//! one, the egress proxy's image carries it instead of the helper ([`crate::egress`]); without
//! one the proxy cannot put secrets into HTTPS requests, and [`broker_available`] says why.

/// The statically linked broker; empty when `build.rs` could not build it.
static BINARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kilntainers-broker"));
/// Why the build has no broker (empty when it has one).
const MISSING_REASON: &str = env!("KILNTAINERS_BROKER_MISSING");

/// The broker's bytes; empty when this build has none.
pub(crate) fn bytes() -> &'static [u8] {
    BINARY
}

/// `Err(reason)` when this build carries no broker, so secrets cannot be brokered (the server
/// refuses them at startup with this reason).
pub fn broker_available() -> Result<(), String> {
    if BINARY.is_empty() {
        Err(format!(
            "this build has no secrets broker ({MISSING_REASON})"
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_build_carries_a_static_broker() {
        // A build that silently lost its broker would pass every other test with the helper.
        broker_available().unwrap();
        assert_eq!(&BINARY[..4], b"\x7fELF");
    }
}
