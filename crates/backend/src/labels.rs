//! Provider label and metadata keys (docs/decisions.md, "Labels and metadata"). Byte-identical to the Python
//! reference so either server finds the other's computers; new keys are additive.

/// Docker label keys.
pub mod docker {
    pub const MANAGED: &str = "kilntainers";
    pub const COMPUTER_ID: &str = "kilntainers.computer-id";
    pub const TEMPORARY: &str = "kilntainers.temporary";
    pub const IMAGE: &str = "kilntainers.image";
    /// New: the creating server instance, on temporary computers only (crash GC).
    pub const INSTANCE: &str = "kilntainers.instance";
    /// New: the principal that created the computer (docs/auth.md). Absent on computers made
    /// before principals existed (they are `default`'s) and on warm-pool spares (labels are
    /// fixed before a spare has an owner; the owner tag in the name says whose it is).
    pub const OWNER: &str = "kilntainers.owner";
    /// Container names are `kilntainer-<computer_id>`.
    pub const NAME_PREFIX: &str = "kilntainer-";
    /// New: set on a container born as a warm-pool spare (docs/warm-pool.md). Such a container
    /// has no computer-id label, since it got its id only when it was handed out; its id is its
    /// name after [`NAME_PREFIX`].
    pub const POOLED: &str = "kilntainers.pooled";
    /// Names of spares not yet handed out; never the name of a computer, as the `s` after
    /// `kilntainer` keeps it from starting with [`NAME_PREFIX`].
    pub const SPARE_NAME_PREFIX: &str = "kilntainers-spare-";
    /// New, on networks only: what this server made the network for, `principal` (one
    /// principal's computers, with [`OWNER`]) or `pool` (warm-pool spares); docs/auth.md,
    /// "Network".
    pub const NETWORK: &str = "kilntainers.network";
    /// New: a computer's egress policy when it has rules (docs/egress.md, "Recorded"), compact
    /// JSON; absent on computers in `open` mode without rules.
    pub const EGRESS: &str = "kilntainers.egress";
}

/// Metadata keys of the providers whose keys are dashed rather than dotted (Fly Machine
/// metadata, E2B sandbox metadata, Modal sandbox tags): one set of names for all three.
pub mod dashed {
    pub const MANAGED: &str = "kilntainers";
    pub const COMPUTER_ID: &str = "kilntainers-computer-id";
    pub const TEMPORARY: &str = "kilntainers-temporary";
    pub const IMAGE: &str = "kilntainers-image";
    /// New: the creating server instance, on temporary computers only (crash GC).
    pub const INSTANCE: &str = "kilntainers-instance";
    /// New: the principal that created the computer (docs/auth.md).
    pub const OWNER: &str = "kilntainers-owner";
    /// New: the computer's egress policy when it has rules, as Docker's `kilntainers.egress`
    /// (docs/egress.md, "Recorded").
    pub const EGRESS: &str = "kilntainers-egress";
}

/// Fly Machine metadata keys; the Machine name is the computer id.
pub mod fly {
    pub use super::dashed::{COMPUTER_ID, IMAGE, INSTANCE, MANAGED, OWNER, TEMPORARY};
    /// New: Unix seconds until which a holder vouches for a temporary Machine (Fly has no
    /// session-bound lifetime of its own; see docs/decisions.md, "Fly leases").
    pub const LEASE_UNTIL: &str = "kilntainers-lease-until";
}

/// E2B sandbox metadata keys. E2B has no lease.
pub mod e2b {
    pub use super::dashed::{COMPUTER_ID, EGRESS, IMAGE, INSTANCE, MANAGED, OWNER, TEMPORARY};
}

/// Modal sandbox tag keys; the sandbox name is also the computer id. Modal has no lease.
pub mod modal {
    pub use super::dashed::{COMPUTER_ID, EGRESS, IMAGE, INSTANCE, MANAGED, OWNER, TEMPORARY};
}

/// Kubernetes keys of Pods and PersistentVolumeClaims: the Docker names, which are valid label
/// keys as they are. Labels hold what the server selects by (managed, temporary, instance,
/// name); the computer id, image, owner and egress policy are annotations, since label values
/// are limited to 63 characters of `[A-Za-z0-9._-]` and those may not fit.
pub mod kubernetes {
    pub use super::docker::{
        COMPUTER_ID, EGRESS, IMAGE, INSTANCE, MANAGED, OWNER, POOLED, TEMPORARY,
    };
    /// The computer's object name (a DNS-1123 label, so a valid label value), by which its
    /// NetworkPolicy selects its Pods (docs/kubernetes.md, "Egress").
    pub const NAME: &str = "kilntainers.name";
}

/// Reads a mode label: missing means temporary, values compare case-insensitively.
pub fn parse_temporary(value: Option<&str>) -> bool {
    value.is_none_or(|v| v.trim().eq_ignore_ascii_case("true"))
}

pub fn format_bool(value: bool) -> &'static str {
    if value { "true" } else { "false" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_mode_means_temporary() {
        assert!(parse_temporary(None));
        assert!(parse_temporary(Some("True")));
        assert!(!parse_temporary(Some("false")));
    }
}
