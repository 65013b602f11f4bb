# The HTTP server image (docs/decisions.md, "Deployment files").
#
#   docker build -t mcp-sandbox-computer-vm-for-ai .          # compiles in rust:1.95-bookworm
#   docker build --target prebuilt -t mcp-sandbox-computer-vm-for-ai .
#                      # no compiler image: packs target/release/mcp-sandbox-computer-vm-for-ai
#                      # built on a Debian 12 host with `cargo build --release --locked`
#                      # (used offline by scripts/docker-image-test.sh)
#
# The runtime talks to the Docker Engine API directly, so it needs no docker CLI; mounting the
# host's /var/run/docker.sock gives the server (and anyone who can reach /mcp) control of the
# host's Docker daemon. Without a token the default command refuses to listen on 0.0.0.0: set
# KILNTAINERS_AUTH_TOKEN, or pass --allow-unauthenticated-http behind a trusted network.
#
# Stage order matters for the legacy (non-BuildKit) builder, which builds every stage up to the
# target: `prebuilt` comes before `builder` so that it never needs the Rust image.

FROM debian:bookworm-slim AS runtime-base
# ca-certificates for https:// engines and cloud APIs; openssh-client for ssh:// Docker hosts.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates openssh-client \
    && rm -rf /var/lib/apt/lists/*
ENV HOME=/root
# Instance locks (crash GC across container restarts) and fly.json live here.
VOLUME ["/root/.mcp-sandbox-computer-vm-for-ai"]
EXPOSE 8080
# No curl in the image: bash's /dev/tcp speaks just enough HTTP.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8080 && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && grep -q '\"ok\"' <&3"]
ENTRYPOINT ["mcp-sandbox-computer-vm-for-ai"]
CMD ["--transport", "http", "--host", "0.0.0.0", "--port", "8080", "--backend", "docker"]

# A binary built on the host (see .dockerignore, which lets only this file of target/ in).
# Tolerates its absence so that legacy builders, which build this stage on the way to the
# default target, still work; scripts/docker-image-test.sh checks the result.
FROM runtime-base AS prebuilt
COPY Cargo.toml target/release/mcp-sandbox-computer-vm-for-ai* /tmp/prebuilt/
RUN if [ -f /tmp/prebuilt/mcp-sandbox-computer-vm-for-ai ]; then \
        install -m 0755 /tmp/prebuilt/mcp-sandbox-computer-vm-for-ai /usr/local/bin/; \
    else \
        echo "no target/release/mcp-sandbox-computer-vm-for-ai in the build context" >&2; \
    fi \
    && rm -rf /tmp/prebuilt

FROM rust:1.95-bookworm AS builder
WORKDIR /src
# Dependencies first, against placeholder sources of the server crate, so that edits to the
# server reuse this layer. The default features are every backend; the backend crates
# (crates/*: their build scripts compile the Modal .proto, the exec helper, a workspace
# member, std only, and the secrets broker, a workspace member built by a nested cargo) come
# along with the manifests. The Modal test fake is a workspace member
# too: cargo needs its manifest, but only the server package is built.
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
COPY helper ./helper
COPY broker ./broker
COPY fakes ./fakes
RUN mkdir -p src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked --package mcp-sandbox-computer-vm-for-ai \
    && rm -rf src target/release/.fingerprint/mcp-sandbox-computer-vm-for-ai-* \
        target/release/deps/mcp_sandbox_computer_vm_for_ai-* \
        target/release/deps/libmcp_sandbox_computer_vm_for_ai-*
COPY src ./src
RUN cargo build --release --locked --package mcp-sandbox-computer-vm-for-ai \
    && install -m 0755 target/release/mcp-sandbox-computer-vm-for-ai /usr/local/bin/

FROM runtime-base AS runtime
COPY --from=builder /usr/local/bin/mcp-sandbox-computer-vm-for-ai /usr/local/bin/mcp-sandbox-computer-vm-for-ai
