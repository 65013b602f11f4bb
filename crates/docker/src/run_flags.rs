//! Parsing of `--docker-run-flag` values (docs/decisions.md, "Docker run flags", "Startup validation" rows 15–16) into
//! [`RunFlags`], plain data that the docker backend later maps onto Engine API fields.
//!
//! This module owns the accepted flag set, the value grammar of each flag, the size grammar shared
//! with `--memory` ([`parse_size`]) and the startup error texts for bad run flags. It is a config
//! leaf: it must not import bollard or anything else from `backends`; the mapping to API types
//! lives in `crates/docker/src/run_flags_api.rs`.

use std::collections::BTreeMap;
use std::net::IpAddr;

/// Every setting the accepted `--docker-run-flag` values can carry. Scalars hold the last value
/// given; lists keep every value in order. `None`/empty means "leave the backend default".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFlags {
    /// `--pids-limit`; overrides the server's own `--pids-limit`.
    pub pids_limit: Option<i64>,
    /// `--security-opt`, added after the server's default options.
    pub security_opts: Vec<String>,
    pub cap_add: Vec<String>,
    pub cap_drop: Vec<String>,
    /// `--read-only`: read-only root filesystem.
    pub read_only: Option<bool>,
    /// `--tmpfs PATH[:OPTS]`: mount path → mount options (empty when none were given).
    pub tmpfs: BTreeMap<String, String>,
    /// `-e/--env`, each entry `KEY=VALUE`.
    pub env: Vec<String>,
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub hostname: Option<String>,
    /// `-l/--label`; keys starting with `kilntainers` are refused at parse time.
    pub labels: BTreeMap<String, String>,
    pub runtime: Option<String>,
    /// `--ulimit`, one entry per limit name (a later value for the same name replaces it).
    pub ulimits: Vec<Ulimit>,
    /// `--shm-size` in bytes.
    pub shm_size: Option<i64>,
    /// `--memory-swap` in bytes; `-1` means unlimited swap.
    pub memory_swap: Option<i64>,
    pub cpuset_cpus: Option<String>,
    pub cpu_shares: Option<i64>,
    /// `-v/--volume`, each entry `SOURCE:DESTINATION[:OPTIONS]` as the API's bind syntax.
    pub volumes: Vec<String>,
    pub mounts: Vec<MountSpec>,
    /// `--network/--net`.
    pub network: Option<String>,
    pub dns: Vec<String>,
    /// `--add-host`, each entry normalised to `HOST:IP`.
    pub extra_hosts: Vec<String>,
    pub privileged: Option<bool>,
    pub init: Option<bool>,
    pub devices: Vec<DeviceSpec>,
    pub gpus: Option<Gpus>,
    /// `--platform`: a create option, not part of the create body.
    pub platform: Option<String>,
}

impl RunFlags {
    /// Whether the operator gave computers the raw-socket capability back (`--cap-add
    /// NET_RAW`, `--cap-add ALL`, `--privileged`), which the server otherwise drops.
    pub fn grants_net_raw(&self) -> bool {
        self.privileged == Some(true)
            || self.cap_add.iter().any(|cap| {
                let cap = cap.trim().to_ascii_uppercase();
                matches!(cap.strip_prefix("CAP_").unwrap_or(&cap), "NET_RAW" | "ALL")
            })
    }
}

/// One `--ulimit name=soft[:hard]`; `hard` equals `soft` when it was not given (as in docker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ulimit {
    pub name: String,
    pub soft: i64,
    pub hard: i64,
}

/// The `type=` of a `--mount`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountKind {
    Bind,
    Volume,
    Tmpfs,
}

/// One `--mount`. `source` is `None` for tmpfs and for anonymous volumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountSpec {
    pub kind: MountKind,
    pub source: Option<String>,
    pub target: String,
    pub read_only: bool,
}

/// One `--device SRC[:DST[:PERMS]]` with docker's defaults filled in (DST = SRC, PERMS = `rwm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub host_path: String,
    pub target_path: String,
    pub permissions: String,
}

/// `--gpus all|N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gpus {
    All,
    Count(i64),
}

/// Why a `--docker-run-flag` value was refused. `Display` is the exact startup message without
/// the `kilntainers: error: ` prefix; `token` is the flag token as the user wrote it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RunFlagError {
    #[error("Unsupported --docker-run-flag '{token}'. Supported flags: {list}.", list = supported_flags_list())]
    Unsupported { token: String },
    /// `reason` has no trailing period; the message adds it.
    #[error("Invalid --docker-run-flag '{token}': {reason}.")]
    Invalid { token: String, reason: String },
    #[error("--docker-run-flag '{token}' conflicts with --no-network.")]
    ConflictsWithNoNetwork { token: String },
}

/// Flags that only turn something on or off (`--read-only`, `--read-only=false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SwitchFlag {
    ReadOnly,
    Privileged,
    Init,
}

/// Flags that take a value (`--name=value` or `--name value`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueFlag {
    PidsLimit,
    SecurityOpt,
    CapAdd,
    CapDrop,
    Tmpfs,
    Env,
    User,
    Workdir,
    Hostname,
    Label,
    Runtime,
    Ulimit,
    ShmSize,
    MemorySwap,
    CpusetCpus,
    CpuShares,
    Volume,
    Mount,
    Network,
    Dns,
    AddHost,
    Device,
    Gpus,
    Platform,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FlagKind {
    Switch(SwitchFlag),
    Value(ValueFlag),
}

struct FlagSpec {
    /// The name shown in the "Supported flags" list.
    long: &'static str,
    /// Short forms and aliases that mean the same flag.
    other_names: &'static [&'static str],
    kind: FlagKind,
}

const fn value(
    long: &'static str,
    other_names: &'static [&'static str],
    flag: ValueFlag,
) -> FlagSpec {
    FlagSpec {
        long,
        other_names,
        kind: FlagKind::Value(flag),
    }
}

const fn switch(long: &'static str, flag: SwitchFlag) -> FlagSpec {
    FlagSpec {
        long,
        other_names: &[],
        kind: FlagKind::Switch(flag),
    }
}

/// The accepted flags, in the order of the table in docs/decisions.md, "Docker run flags" (the error message lists
/// them in this order).
const SUPPORTED_FLAGS: &[FlagSpec] = &[
    value("--pids-limit", &[], ValueFlag::PidsLimit),
    value("--security-opt", &[], ValueFlag::SecurityOpt),
    value("--cap-add", &[], ValueFlag::CapAdd),
    value("--cap-drop", &[], ValueFlag::CapDrop),
    switch("--read-only", SwitchFlag::ReadOnly),
    value("--tmpfs", &[], ValueFlag::Tmpfs),
    value("--env", &["-e"], ValueFlag::Env),
    value("--user", &["-u"], ValueFlag::User),
    value("--workdir", &["-w"], ValueFlag::Workdir),
    value("--hostname", &["-h"], ValueFlag::Hostname),
    value("--label", &["-l"], ValueFlag::Label),
    value("--runtime", &[], ValueFlag::Runtime),
    value("--ulimit", &[], ValueFlag::Ulimit),
    value("--shm-size", &[], ValueFlag::ShmSize),
    value("--memory-swap", &[], ValueFlag::MemorySwap),
    value("--cpuset-cpus", &[], ValueFlag::CpusetCpus),
    value("--cpu-shares", &[], ValueFlag::CpuShares),
    value("--volume", &["-v"], ValueFlag::Volume),
    value("--mount", &[], ValueFlag::Mount),
    value("--network", &["--net"], ValueFlag::Network),
    value("--dns", &[], ValueFlag::Dns),
    value("--add-host", &[], ValueFlag::AddHost),
    switch("--privileged", SwitchFlag::Privileged),
    switch("--init", SwitchFlag::Init),
    value("--device", &[], ValueFlag::Device),
    value("--gpus", &[], ValueFlag::Gpus),
    value("--platform", &[], ValueFlag::Platform),
];

/// Docker flags that would fight the server's own lifecycle handling (naming, auto-removal,
/// keep-alive entrypoint, detached exec streams, restart policy). `-i`/`-t`/`-d` may also be
/// combined (`-it`), which [`is_managed`] handles separately.
const MANAGED_FLAGS: &[&str] = &[
    "--rm",
    "--detach",
    "--name",
    "--entrypoint",
    "--interactive",
    "--tty",
    "--restart",
];

const MANAGED_REASON: &str = "the server manages this itself";
const MISSING_VALUE: &str = "missing value";

/// Labels with this prefix carry the server's own bookkeeping (docs/decisions.md, "Labels and metadata").
const RESERVED_LABEL_PREFIX: &str = "kilntainers";

/// The names docker's `--ulimit` understands (docker/go-units `ulimitNameMapping`).
const ULIMIT_NAMES: &[&str] = &[
    "core",
    "cpu",
    "data",
    "fsize",
    "locks",
    "memlock",
    "msgqueue",
    "nice",
    "nofile",
    "nproc",
    "rss",
    "rtprio",
    "rttime",
    "sigpending",
    "stack",
];

/// Parses every `--docker-run-flag` value in order. Later values of a scalar flag win; list flags
/// accumulate. `no_network` is the server's `--no-network`, which a `--network` other than `none`
/// contradicts.
///
/// # Errors
///
/// The first bad token stops parsing: an unknown flag gives [`RunFlagError::Unsupported`], a
/// server-managed flag or malformed value [`RunFlagError::Invalid`], and a network while
/// `no_network` is set [`RunFlagError::ConflictsWithNoNetwork`].
pub fn parse_run_flags(values: &[String], no_network: bool) -> Result<RunFlags, RunFlagError> {
    let mut flags = RunFlags::default();
    for raw in values {
        let words = shell_words::split(raw).map_err(|_| invalid(raw, "unbalanced quotes"))?;
        // A flag's value must sit in the same `--docker-run-flag` value as the flag itself.
        let mut words = words.into_iter();
        while let Some(token) = words.next() {
            apply_token(&mut flags, token, &mut words, no_network)?;
        }
    }
    Ok(flags)
}

/// Applies one flag token, taking its value from `rest` when it was not given after `=`.
fn apply_token(
    flags: &mut RunFlags,
    token: String,
    rest: &mut impl Iterator<Item = String>,
    no_network: bool,
) -> Result<(), RunFlagError> {
    let (name, inline_value) = split_token(&token);
    match lookup(name, &token)? {
        FlagKind::Switch(flag) => {
            let on = match inline_value {
                None => true,
                Some(text) => parse_bool(text).ok_or_else(|| {
                    invalid(&token, &format!("expected true or false, got '{text}'"))
                })?,
            };
            apply_switch(flags, flag, on);
        }
        FlagKind::Value(flag) => {
            let given = match inline_value {
                Some(text) => Some(text.to_owned()),
                None => rest.next(),
            };
            let given = given
                .filter(|text| !text.is_empty())
                .ok_or_else(|| invalid(&token, MISSING_VALUE))?;
            // `--network none` is what --no-network asks for anyway, so only other names clash.
            if flag == ValueFlag::Network && no_network && given != "none" {
                return Err(RunFlagError::ConflictsWithNoNetwork { token });
            }
            apply_value(flags, flag, &given).map_err(|reason| invalid(&token, &reason))?;
        }
    }
    Ok(())
}

/// Parses a size like `512m`, `1g` or `1.5GB` into bytes: a decimal number and an optional unit
/// `b`, `k`, `kb`, `m`, `mb`, `g`, `gb`, `t`, `tb` (binary multiples, case-insensitive). Fractions
/// of a byte are dropped. Returns `None` for anything else, including empty text, a sign, spaces
/// and values beyond `i64::MAX`. Zero is returned as `Some(0)`; callers decide whether it is allowed.
#[must_use]
pub fn parse_size(text: &str) -> Option<i64> {
    let unit_start = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(unit_start);
    let multiplier = unit_multiplier(unit)?;
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let has_point = number.contains('.');
    if !is_digits(whole) || (has_point && !is_digits(fraction)) {
        return None;
    }
    let whole_bytes = whole.parse::<u128>().ok()?.checked_mul(multiplier)?;
    let bytes = whole_bytes.checked_add(fraction_bytes(fraction, multiplier))?;
    i64::try_from(bytes).ok()
}

/// The list used in the "Unsupported" message, e.g. `--pids-limit, --security-opt, ...`.
fn supported_flags_list() -> String {
    SUPPORTED_FLAGS
        .iter()
        .map(|spec| spec.long)
        .collect::<Vec<_>>()
        .join(", ")
}

fn invalid(token: &str, reason: &str) -> RunFlagError {
    RunFlagError::Invalid {
        token: token.to_owned(),
        reason: reason.to_owned(),
    }
}

/// Splits `--name=value` / `-e=value` into name and inline value. A short flag glued to its value
/// (`-eK=V`) is not split: docker allows it, the spec does not require it, and guessing would
/// misread unknown flags.
fn split_token(token: &str) -> (&str, Option<&str>) {
    let is_long = token.starts_with("--");
    let is_short_with_equals = token.starts_with('-') && token.get(2..3) == Some("=");
    match token.split_once('=') {
        Some((name, value)) if is_long || is_short_with_equals => (name, Some(value)),
        _ => (token, None),
    }
}

/// Finds the flag called `name`; `token` (the whole word) is what errors quote.
fn lookup(name: &str, token: &str) -> Result<FlagKind, RunFlagError> {
    if is_managed(name) {
        return Err(invalid(token, MANAGED_REASON));
    }
    SUPPORTED_FLAGS
        .iter()
        .find(|spec| spec.long == name || spec.other_names.contains(&name))
        .map(|spec| spec.kind)
        .ok_or_else(|| RunFlagError::Unsupported {
            token: token.to_owned(),
        })
}

/// True for the managed long flags and for short `-d`, `-i`, `-t` alone or bundled (`-it`).
fn is_managed(name: &str) -> bool {
    if MANAGED_FLAGS.contains(&name) {
        return true;
    }
    match name.strip_prefix('-') {
        Some(letters) if !letters.is_empty() => {
            letters.chars().all(|c| matches!(c, 'd' | 'i' | 't'))
        }
        _ => false,
    }
}

fn apply_switch(flags: &mut RunFlags, flag: SwitchFlag, on: bool) {
    let target = match flag {
        SwitchFlag::ReadOnly => &mut flags.read_only,
        SwitchFlag::Privileged => &mut flags.privileged,
        SwitchFlag::Init => &mut flags.init,
    };
    *target = Some(on);
}

/// Stores one non-empty value; `Err` carries the reason for the "Invalid" message.
fn apply_value(flags: &mut RunFlags, flag: ValueFlag, value: &str) -> Result<(), String> {
    let text = value.to_owned();
    match flag {
        ValueFlag::PidsLimit => flags.pids_limit = Some(parse_integer(value)?),
        ValueFlag::SecurityOpt => flags.security_opts.push(text),
        ValueFlag::CapAdd => flags.cap_add.push(text),
        ValueFlag::CapDrop => flags.cap_drop.push(text),
        ValueFlag::Tmpfs => {
            let (path, options) = parse_tmpfs(value)?;
            flags.tmpfs.insert(path, options);
        }
        ValueFlag::Env => {
            parse_key_value(value)?;
            flags.env.push(text);
        }
        ValueFlag::User => flags.user = Some(text),
        ValueFlag::Workdir => flags.workdir = Some(require_absolute(value)?),
        ValueFlag::Hostname => flags.hostname = Some(text),
        ValueFlag::Label => {
            let (key, label_value) = parse_label(value)?;
            flags.labels.insert(key, label_value);
        }
        ValueFlag::Runtime => flags.runtime = Some(text),
        ValueFlag::Ulimit => set_ulimit(&mut flags.ulimits, parse_ulimit(value)?),
        ValueFlag::ShmSize => flags.shm_size = Some(parse_size_value(value)?),
        ValueFlag::MemorySwap => flags.memory_swap = Some(parse_memory_swap(value)?),
        ValueFlag::CpusetCpus => flags.cpuset_cpus = Some(parse_cpu_list(value)?),
        ValueFlag::CpuShares => flags.cpu_shares = Some(parse_non_negative(value)?),
        ValueFlag::Volume => flags.volumes.push(parse_volume(value)?),
        ValueFlag::Mount => flags.mounts.push(parse_mount(value)?),
        ValueFlag::Network => flags.network = Some(text),
        ValueFlag::Dns => flags.dns.push(parse_ip(value)?),
        ValueFlag::AddHost => flags.extra_hosts.push(parse_extra_host(value)?),
        ValueFlag::Device => flags.devices.push(parse_device(value)?),
        ValueFlag::Gpus => flags.gpus = Some(parse_gpus(value)?),
        ValueFlag::Platform => flags.platform = Some(text),
    }
    Ok(())
}

/// Accepts the spellings docker's boolean flags take after `=`.
fn parse_bool(text: &str) -> Option<bool> {
    match text.to_ascii_lowercase().as_str() {
        "true" | "1" => Some(true),
        "false" | "0" => Some(false),
        _ => None,
    }
}

fn parse_integer(value: &str) -> Result<i64, String> {
    value
        .parse()
        .map_err(|_| format!("expected a whole number, got '{value}'"))
}

fn parse_non_negative(value: &str) -> Result<i64, String> {
    match value.parse::<i64>() {
        Ok(number) if number >= 0 => Ok(number),
        _ => Err(format!(
            "expected a non-negative whole number, got '{value}'"
        )),
    }
}

fn parse_size_value(value: &str) -> Result<i64, String> {
    parse_size(value)
        .ok_or_else(|| format!("expected a size like \"512m\" or \"1g\", got '{value}'"))
}

/// `--memory-swap` also takes `-1`, docker's "unlimited swap".
fn parse_memory_swap(value: &str) -> Result<i64, String> {
    if value == "-1" {
        return Ok(-1);
    }
    parse_size(value).ok_or_else(|| {
        format!("expected a size like \"512m\" or \"1g\", or -1 for unlimited, got '{value}'")
    })
}

fn require_absolute(value: &str) -> Result<String, String> {
    if value.starts_with('/') {
        Ok(value.to_owned())
    } else {
        Err(format!("expected an absolute path, got '{value}'"))
    }
}

/// `KEY=VALUE` with a non-empty key; the value may be empty.
fn parse_key_value(value: &str) -> Result<(String, String), String> {
    match value.split_once('=') {
        Some((key, rest)) if !key.is_empty() => Ok((key.to_owned(), rest.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got '{value}'")),
    }
}

fn parse_label(value: &str) -> Result<(String, String), String> {
    let (key, label_value) = parse_key_value(value)?;
    if key.starts_with(RESERVED_LABEL_PREFIX) {
        return Err(format!("label key '{key}' is reserved"));
    }
    Ok((key, label_value))
}

/// `PATH[:OPTIONS]`, e.g. `/scratch:size=100m,mode=1777`.
fn parse_tmpfs(value: &str) -> Result<(String, String), String> {
    let (path, options) = value.split_once(':').unwrap_or((value, ""));
    if !path.starts_with('/') {
        return Err(format!(
            "expected PATH[:OPTIONS] with an absolute PATH, got '{value}'"
        ));
    }
    Ok((path.to_owned(), options.to_owned()))
}

/// `name=soft[:hard]`, limits as whole numbers (`-1` is unlimited), soft not above hard.
fn parse_ulimit(value: &str) -> Result<Ulimit, String> {
    let malformed = || format!("expected NAME=SOFT[:HARD] with whole-number limits, got '{value}'");
    let (name, limits) = value.split_once('=').ok_or_else(malformed)?;
    if !ULIMIT_NAMES.contains(&name) {
        return Err(format!(
            "unknown ulimit '{name}'; expected one of {}",
            ULIMIT_NAMES.join(", ")
        ));
    }
    let (soft, hard) = limits.split_once(':').unwrap_or((limits, limits));
    let soft: i64 = soft.parse().map_err(|_| malformed())?;
    let hard: i64 = hard.parse().map_err(|_| malformed())?;
    if soft > hard {
        return Err(format!(
            "ulimit soft limit {soft} is above hard limit {hard}"
        ));
    }
    Ok(Ulimit {
        name: name.to_owned(),
        soft,
        hard,
    })
}

/// Docker keeps one ulimit per name, so a repeated name replaces the earlier entry in place.
fn set_ulimit(ulimits: &mut Vec<Ulimit>, ulimit: Ulimit) {
    match ulimits
        .iter_mut()
        .find(|existing| existing.name == ulimit.name)
    {
        Some(existing) => *existing = ulimit,
        None => ulimits.push(ulimit),
    }
}

/// A cpuset list such as `0-3,6`.
fn parse_cpu_list(value: &str) -> Result<String, String> {
    if value
        .chars()
        .all(|c| c.is_ascii_digit() || c == ',' || c == '-')
    {
        Ok(value.to_owned())
    } else {
        Err(format!("expected a CPU list like \"0-3,6\", got '{value}'"))
    }
}

/// `SOURCE:DESTINATION[:OPTIONS]`; the text is passed on unchanged as bind syntax.
fn parse_volume(value: &str) -> Result<String, String> {
    let parts: Vec<&str> = value.split(':').collect();
    let well_formed = matches!(parts.as_slice(),
        [source, destination] | [source, destination, _]
            if !source.is_empty() && destination.starts_with('/'))
        && parts.iter().all(|part| !part.is_empty());
    if well_formed {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "expected SOURCE:DESTINATION[:OPTIONS] with an absolute DESTINATION, got '{value}'"
        ))
    }
}

/// Comma-separated `key=value` fields as docker's `--mount` takes them (keys case-insensitive,
/// `type` defaulting to `volume` as in docker).
fn parse_mount(value: &str) -> Result<MountSpec, String> {
    let mut kind = MountKind::Volume;
    let mut source = None;
    let mut target = None;
    let mut read_only = false;
    for field in value.split(',') {
        let (key, field_value) = match field.split_once('=') {
            Some((key, field_value)) => (key, Some(field_value)),
            None => (field, None),
        };
        match (key.to_ascii_lowercase().as_str(), field_value) {
            ("type", Some(text)) => kind = parse_mount_kind(text)?,
            ("source" | "src", Some(text)) if !text.is_empty() => source = Some(text.to_owned()),
            ("destination" | "dst" | "target", Some(text)) => target = Some(text.to_owned()),
            ("readonly" | "ro", None) => read_only = true,
            ("readonly" | "ro", Some(text)) => {
                read_only = parse_bool(text).ok_or_else(|| {
                    format!("expected readonly=true or readonly=false, got '{field}'")
                })?;
            }
            _ => {
                return Err(format!(
                    "unknown mount field '{field}'; expected type, source/src, destination/dst/target, readonly/ro"
                ));
            }
        }
    }
    let target = target
        .filter(|path| path.starts_with('/'))
        .ok_or_else(|| format!("expected an absolute destination in '{value}'"))?;
    match (kind, &source) {
        (MountKind::Bind, None) => Err(format!("a bind mount needs a source in '{value}'")),
        (MountKind::Tmpfs, Some(_)) => Err(format!("a tmpfs mount takes no source in '{value}'")),
        _ => Ok(MountSpec {
            kind,
            source,
            target,
            read_only,
        }),
    }
}

fn parse_mount_kind(text: &str) -> Result<MountKind, String> {
    match text.to_ascii_lowercase().as_str() {
        "bind" => Ok(MountKind::Bind),
        "volume" => Ok(MountKind::Volume),
        "tmpfs" => Ok(MountKind::Tmpfs),
        _ => Err(format!(
            "expected mount type bind, volume or tmpfs, got '{text}'"
        )),
    }
}

fn parse_ip(value: &str) -> Result<String, String> {
    value
        .parse::<IpAddr>()
        .map(|_| value.to_owned())
        .map_err(|_| format!("expected an IP address, got '{value}'"))
}

/// `HOST:IP` (or docker's newer `HOST=IP`, needed for IPv6 like `HOST=[::1]`), normalised to the
/// API's `HOST:IP`. `host-gateway` is docker's placeholder for the host's address.
fn parse_extra_host(value: &str) -> Result<String, String> {
    let malformed = || format!("expected HOST:IP, got '{value}'");
    let (host, address) = value
        .split_once('=')
        .or_else(|| value.split_once(':'))
        .ok_or_else(malformed)?;
    let address = address.trim_start_matches('[').trim_end_matches(']');
    let address_ok = address == "host-gateway" || address.parse::<IpAddr>().is_ok();
    if host.is_empty() || !address_ok {
        return Err(malformed());
    }
    Ok(format!("{host}:{address}"))
}

/// `SRC[:DST[:PERMS]]`. With two parts, docker reads the second as PERMS when it is a valid
/// permission string (`/dev/sda:r`) and as DST otherwise.
fn parse_device(value: &str) -> Result<DeviceSpec, String> {
    let parts: Vec<&str> = value.split(':').collect();
    let (host_path, target_path, permissions) = match parts.as_slice() {
        [source] => (*source, *source, "rwm"),
        [source, perms] if is_device_permissions(perms) => (*source, *source, *perms),
        [source, target] => (*source, *target, "rwm"),
        [source, target, perms] if is_device_permissions(perms) => (*source, *target, *perms),
        _ => return Err(format!("expected SRC[:DST[:PERMS]], got '{value}'")),
    };
    if !host_path.starts_with('/') || !target_path.starts_with('/') {
        return Err(format!("expected absolute device paths, got '{value}'"));
    }
    Ok(DeviceSpec {
        host_path: host_path.to_owned(),
        target_path: target_path.to_owned(),
        permissions: permissions.to_owned(),
    })
}

/// Some non-empty combination of `r`, `w`, `m`, each at most once.
fn is_device_permissions(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 3
        && text.chars().all(|c| matches!(c, 'r' | 'w' | 'm'))
        && ['r', 'w', 'm']
            .iter()
            .all(|letter| text.matches(*letter).count() <= 1)
}

fn parse_gpus(value: &str) -> Result<Gpus, String> {
    if value == "all" {
        return Ok(Gpus::All);
    }
    match value.parse::<i64>() {
        Ok(count) if count >= 1 => Ok(Gpus::Count(count)),
        _ => Err(format!(
            "expected 'all' or a positive number of GPUs, got '{value}'"
        )),
    }
}

fn unit_multiplier(unit: &str) -> Option<u128> {
    let power = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" => 1,
        "m" | "mb" => 2,
        "g" | "gb" => 3,
        "t" | "tb" => 4,
        _ => return None,
    };
    Some(1024_u128.pow(power))
}

fn is_digits(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit())
}

/// Bytes contributed by the decimal `fraction` digits, rounded down. Only the first 18 digits
/// count: they already resolve far below one byte even for terabytes, and keep the arithmetic
/// inside `u128`.
fn fraction_bytes(fraction: &str, multiplier: u128) -> u128 {
    let (numerator, denominator) =
        fraction
            .bytes()
            .take(18)
            .fold((0_u128, 1_u128), |(numerator, denominator), digit| {
                (numerator * 10 + u128::from(digit - b'0'), denominator * 10)
            });
    numerator * multiplier / denominator
}

#[cfg(test)]
mod tests;
