#!/usr/bin/env bash
# Build the container images the integration tests use, without any container registry.
#
#   sandbox-busybox:full             Debian busybox-static, every applet linked in /bin; CMD ["/bin/sh"]
#   sandbox-busybox:minimal          only sh, sleep, cat, echo linked (keep-alive needs just sh + sleep)
#   debian:bookworm-slim             debootstrap --variant=minbase bookworm; CMD ["/bin/bash"]
#   kilntainers-test/debian:bookworm second tag of the same image
#   kilntainers-test/debian-tools:bookworm   the same with curl, git and ca-certificates (the
#                                    secrets tests: real clients trusting the broker's CA)
#   podman (if installed): localhost/sandbox-busybox:full and localhost/sandbox-busybox:minimal
#
#   scripts/build-test-images.sh [IMAGE...]   only the named ones (e.g. debian:bookworm-slim,
#                                             which scripts/serve.sh builds on a machine that
#                                             reaches no registry); all of them without names
#
# Idempotent: images that already exist are skipped unless FORCE=1. The debootstrap rootfs
# is cached as a tarball in .test-env/cache/ (REFRESH_CACHE=1 rebuilds it). Needs a running
# Docker daemon (scripts/ensure-dockerd.sh). Installs busybox-static / debootstrap if missing.
#
# Environment:
#   FORCE=1           rebuild and re-tag every image
#   REFRESH_CACHE=1   re-run debootstrap even if the cached rootfs tarball exists
#   DEBIAN_MIRROR     mirror for debootstrap (default: the first bookworm mirror apt uses)
#   SKIP_DEBIAN=1     do not build the Debian image
#   SKIP_PODMAN=1     do not import into podman
#   CONTAINERS_CONF   passed through to podman
set -euo pipefail

LOG_PREFIX="[build-test-images]"
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

FORCE="${FORCE:-0}"
DEFAULT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
BUSYBOX_FULL=sandbox-busybox:full
BUSYBOX_MINIMAL=sandbox-busybox:minimal
DEBIAN_IMAGE=debian:bookworm-slim
DEBIAN_ALIAS=kilntainers-test/debian:bookworm
DEBIAN_CACHE="$CACHE_DIR/debian-bookworm-minbase.tar"
TOOLS_IMAGE=kilntainers-test/debian-tools:bookworm
TOOLS_CACHE="$CACHE_DIR/debian-bookworm-tools.tar"
TOOLS_PACKAGES=curl,git,ca-certificates
export DOCKER_BUILDKIT=0

WORK=""

# remove_tree DIR: unmount anything mounted below DIR (debootstrap mounts proc/sys in its
# target), then delete it without ever crossing into another file system.
remove_tree() {
    local dir="$1" m
    [[ -n "$dir" && -d "$dir" ]] || return 0
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v w="$dir/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r)
    rm -rf --one-file-system "$dir"
}

cleanup() {
    local rc=$?
    remove_tree "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

docker_has() { docker image inspect "$1" >/dev/null 2>&1; }
docker_id() { docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# drop_if_dangling ENGINE OLD_ID NEW_ID: after a FORCE rebuild moved the tag, remove the
# previous image if nothing refers to it any more (the engine refuses while a container
# uses it, which is fine).
drop_if_dangling() {
    local engine="$1" old="$2" new="$3" tags
    [[ -n "$old" && "$old" != "$new" ]] || return 0
    tags="$("$engine" image inspect --format '{{len .RepoTags}}' "$old" 2>/dev/null || echo 1)"
    if [[ "$tags" == 0 ]]; then
        "$engine" image rm "$old" >/dev/null 2>&1 || true
    fi
}

# ---------------------------------------------------------------------------
# busybox

# busybox_tar full|minimal -> prints the path of a rootfs tarball
busybox_tar() {
    local kind="$1" w root out a
    w="$WORK"
    root="$w/busybox-$kind"
    out="$w/busybox-$kind.tar"
    if [[ -f "$out" ]]; then
        printf '%s' "$out"
        return 0
    fi
    mkdir -p "$root"/{bin,tmp,proc,sys,dev,etc,root}
    chmod 1777 "$root/tmp"
    chmod 0700 "$root/root"
    cp /bin/busybox "$root/bin/busybox"
    if [[ "$kind" == full ]]; then
        for a in $("$root/bin/busybox" --list); do
            [[ "$a" == busybox ]] || ln -sf busybox "$root/bin/$a"
        done
        printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$root/etc/passwd"
        printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
    else
        for a in sh sleep cat echo; do
            ln -sf busybox "$root/bin/$a"
        done
    fi
    tar -C "$root" --numeric-owner --owner=0 --group=0 -cf "$out" .
    printf '%s' "$out"
}

build_busybox() {
    local kind="$1" image="$2" t0 tarball
    if [[ "$FORCE" != 1 ]] && docker_has "$image"; then
        log "$image: exists"
        return 0
    fi
    t0="$(now)"
    local old
    old="$(docker_id "$image")"
    tarball="$(busybox_tar "$kind")"
    docker import --change 'CMD ["/bin/sh"]' --change "ENV PATH=$DEFAULT_PATH" \
        "$tarball" "$image" >/dev/null
    drop_if_dangling docker "$old" "$(docker_id "$image")"
    log "$image: built in $(elapsed "$t0")"
}

# ---------------------------------------------------------------------------
# debian

# The first http(s) mirror of the `debian` archive (suite bookworm) that apt uses, from
# one-line *.list files and deb822 *.sources files. Files with other suffixes (for example
# "*.list.disabled") are ignored, and so are disabled stanzas and security/updates suites.
apt_mirror() {
    local files=() f
    [[ -f /etc/apt/sources.list ]] && files+=(/etc/apt/sources.list)
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] && files+=("$f")
    done
    ((${#files[@]})) || return 1
    local f2 m
    for f2 in "${files[@]}"; do
        case "$f2" in
            *.sources)
                m="$(awk '
                    function flush() {
                        if (enabled && types ~ /(^| )deb( |$)/ && suites ~ /(^| )bookworm( |$)/ && uri != "") { print uri; found = 1; exit }
                        types = ""; suites = ""; uri = ""; enabled = 1
                    }
                    BEGIN { enabled = 1 }
                    /^[ \t]*#/ { next }
                    /^[ \t]*$/ { flush(); next }
                    tolower($1) == "types:" { types = $0; sub(/^[^:]*:[ \t]*/, "", types) }
                    tolower($1) == "suites:" { suites = $0; sub(/^[^:]*:[ \t]*/, "", suites) }
                    tolower($1) == "uris:" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { uri = $i; break } }
                    tolower($1) == "enabled:" { enabled = (tolower($2) != "no") }
                    END { if (!found) flush() }
                ' "$f2")"
                ;;
            *)
                m="$(awk '
                    /^[ \t]*deb[ \t]/ {
                        line = $0
                        gsub(/\[[^]]*\]/, "", line)
                        n = split(line, a, /[ \t]+/)
                        j = 0
                        for (i = 1; i <= n; i++) if (a[i] != "") b[++j] = a[i]
                        if (b[2] ~ /^https?:\/\// && b[3] == "bookworm") { print b[2]; exit }
                    }
                ' "$f2")"
                ;;
        esac
        if [[ -n "$m" ]]; then
            printf '%s' "${m%/}"
            return 0
        fi
    done
    return 1
}

# debian_rootfs_tarball CACHE [PACKAGES]: a minbase bookworm root file system (with the
# comma-separated PACKAGES added) as the tarball CACHE, unless it is there already.
debian_rootfs_tarball() {
    local cache="$1" include="${2:-}"
    if [[ -s "$cache" && "${REFRESH_CACHE:-0}" != 1 ]]; then
        log "debian rootfs: cached $cache"
        return 0
    fi
    apt_ensure debootstrap || die "could not install debootstrap"
    local mirror t0 w
    mirror="${DEBIAN_MIRROR:-}"
    if [[ -z "$mirror" ]]; then
        mirror="$(apt_mirror || true)"
    fi
    mirror="${mirror:-http://deb.debian.org/debian}"
    w="$WORK"
    t0="$(now)"
    local extra=()
    if [[ -n "$include" ]]; then
        extra=("--include=$include")
    fi
    rm -rf "$w/rootfs-debian"
    log "debian rootfs: debootstrap --variant=minbase ${extra[*]} bookworm from $mirror (about 30 s)"
    if ! debootstrap --variant=minbase "${extra[@]}" bookworm "$w/rootfs-debian" "$mirror" >"$w/debootstrap.log" 2>&1; then
        tail -n 30 "$w/debootstrap.log" >&2
        if [[ -f "$w/rootfs-debian/debootstrap/debootstrap.log" ]]; then
            tail -n 30 "$w/rootfs-debian/debootstrap/debootstrap.log" >&2
        fi
        die "debootstrap failed"
    fi
    log "debian rootfs: debootstrap done in $(elapsed "$t0")"
    # debootstrap copies the host's resolv.conf and hostname; the engine provides both at
    # run time, so do not bake this machine's into the image.
    : >"$w/rootfs-debian/etc/resolv.conf"
    chmod 0644 "$w/rootfs-debian/etc/resolv.conf"
    rm -f "$w/rootfs-debian/etc/hostname"
    mkdir -p "$CACHE_DIR"
    tar -C "$w/rootfs-debian" --numeric-owner \
        --exclude='./var/cache/apt/archives/*.deb' \
        --exclude='./var/lib/apt/lists/*' \
        -cf "$cache.partial" .
    mv -f "$cache.partial" "$cache"
    remove_tree "$w/rootfs-debian"
}

build_debian() {
    local t0 old=""
    if [[ "$FORCE" != 1 ]] && docker_has "$DEBIAN_IMAGE"; then
        log "$DEBIAN_IMAGE: exists"
    else
        t0="$(now)"
        old="$(docker_id "$DEBIAN_IMAGE")"
        debian_rootfs_tarball "$DEBIAN_CACHE"
        docker import --change 'CMD ["/bin/bash"]' --change "ENV PATH=$DEFAULT_PATH" \
            "$DEBIAN_CACHE" "$DEBIAN_IMAGE" >/dev/null
        log "$DEBIAN_IMAGE: built in $(elapsed "$t0")"
    fi
    local id alias_id
    id="$(docker image inspect --format '{{.Id}}' "$DEBIAN_IMAGE")"
    alias_id="$(docker image inspect --format '{{.Id}}' "$DEBIAN_ALIAS" 2>/dev/null || true)"
    if [[ "$id" != "$alias_id" ]]; then
        docker tag "$DEBIAN_IMAGE" "$DEBIAN_ALIAS"
        drop_if_dangling docker "$alias_id" "$id"
        log "$DEBIAN_ALIAS: tagged"
    else
        log "$DEBIAN_ALIAS: exists"
    fi
    drop_if_dangling docker "${old:-}" "$id"
}

build_debian_tools() {
    local t0 old=""
    if [[ "$FORCE" != 1 ]] && docker_has "$TOOLS_IMAGE"; then
        log "$TOOLS_IMAGE: exists"
        return 0
    fi
    t0="$(now)"
    old="$(docker_id "$TOOLS_IMAGE")"
    debian_rootfs_tarball "$TOOLS_CACHE" "$TOOLS_PACKAGES"
    docker import --change 'CMD ["/bin/bash"]' --change "ENV PATH=$DEFAULT_PATH" \
        "$TOOLS_CACHE" "$TOOLS_IMAGE" >/dev/null
    drop_if_dangling docker "${old:-}" "$(docker_id "$TOOLS_IMAGE")"
    log "$TOOLS_IMAGE: built in $(elapsed "$t0")"
}

# ---------------------------------------------------------------------------
# podman

podman_import() {
    local kind="$1" image="localhost/$2" t0 tarball
    if [[ "$FORCE" != 1 ]] && podman image exists "$image" 2>/dev/null; then
        log "podman $image: exists"
        return 0
    fi
    t0="$(now)"
    local old
    old="$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
    tarball="$(busybox_tar "$kind")"
    podman import --quiet --change 'CMD ["/bin/sh"]' --change "ENV PATH=$DEFAULT_PATH" \
        "$tarball" "$image" >/dev/null
    drop_if_dangling podman "$old" "$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
    log "podman $image: imported in $(elapsed "$t0")"
}

# wanted IMAGE: no names were given, or IMAGE is one of them.
WANTED=()
wanted() {
    local name
    ((${#WANTED[@]} == 0)) && return 0
    for name in "${WANTED[@]}"; do
        [[ "$name" == "$1" ]] && return 0
    done
    return 1
}

main() {
    WANTED=("$@")
    local name
    for name in "${WANTED[@]}"; do
        case "$name" in
        "$BUSYBOX_FULL" | "$BUSYBOX_MINIMAL" | "$DEBIAN_IMAGE" | "$DEBIAN_ALIAS" | "$TOOLS_IMAGE") ;;
        *) die "unknown image '$name'; this script builds $BUSYBOX_FULL, $BUSYBOX_MINIMAL, $DEBIAN_IMAGE, $DEBIAN_ALIAS and $TOOLS_IMAGE" ;;
        esac
    done
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/kilntainers-images.XXXXXX")"
    docker info >/dev/null 2>&1 || die "docker is not answering; run scripts/ensure-dockerd.sh first"
    if wanted "$BUSYBOX_FULL" || wanted "$BUSYBOX_MINIMAL"; then
        if ! pkg_installed busybox-static; then
            apt_ensure busybox-static || die "could not install busybox-static"
        fi
        [[ -x /bin/busybox ]] || die "/bin/busybox missing after installing busybox-static"
    fi

    if wanted "$BUSYBOX_FULL"; then build_busybox full "$BUSYBOX_FULL"; fi
    if wanted "$BUSYBOX_MINIMAL"; then build_busybox minimal "$BUSYBOX_MINIMAL"; fi
    if [[ "${SKIP_DEBIAN:-0}" != 1 ]]; then
        if wanted "$DEBIAN_IMAGE" || wanted "$DEBIAN_ALIAS"; then
            build_debian
        fi
        if wanted "$TOOLS_IMAGE"; then build_debian_tools; fi
    fi
    if [[ "${SKIP_PODMAN:-0}" != 1 ]] && ((${#WANTED[@]} == 0)) && command -v podman >/dev/null 2>&1; then
        podman_import full "$BUSYBOX_FULL"
        podman_import minimal "$BUSYBOX_MINIMAL"
    fi
}

main "$@"
