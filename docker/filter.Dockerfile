# syntax=docker/dockerfile:1
# The prefix-router Wasm filter, built from this repository (build context: the repository root).
#
#   docker build -f docker/filter.Dockerfile --target export -t prefix-router/filter-export .
#       the stage docker-compose.yml runs: copies prefix_router.wasm into the volume mounted at /out
#   docker build -f docker/filter.Dockerfile --target oci -t REGISTRY/prefix-router:TAG .
#       a FROM-scratch image holding only /plugin.wasm: the OCI Wasm image Istio's WasmPlugin and
#       Envoy Gateway's EnvoyExtensionPolicy pull (see envoy/k8s/README.md)

# Same Rust release as the development toolchain; wasm32-wasip1 added to the image's toolchain.
FROM rust:1.95-slim-bookworm AS build
RUN rustup target add wasm32-wasip1
WORKDIR /src
COPY . .
# rust-toolchain.toml names the floating "stable" channel; inside the image the pinned toolchain
# above is the one to use (no toolchain download at build time).
RUN rm -f rust-toolchain.toml
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked -p prefix-router --target wasm32-wasip1 --release \
 && mkdir -p /artifact \
 && cp target/wasm32-wasip1/release/prefix_router.wasm /artifact/prefix_router.wasm \
 && sha256sum /artifact/prefix_router.wasm

# OCI Wasm image (compat layout: a single file at the root, named plugin.wasm).
FROM scratch AS oci
COPY --from=build /artifact/prefix_router.wasm /plugin.wasm

# One-shot exporter for docker compose: copy the filter into the shared volume and exit 0.
FROM busybox:1.37 AS export
COPY --from=build /artifact/prefix_router.wasm /wasm/prefix_router.wasm
# The Kubernetes init containers fill a config's secret placeholders with it (envoy/k8s).
COPY docker/fill-secrets.awk /usr/local/lib/prefix-router/fill-secrets.awk
CMD ["sh", "-c", "cp /wasm/prefix_router.wasm /out/prefix_router.wasm && chmod 0644 /out/prefix_router.wasm && sha256sum /out/prefix_router.wasm"]
