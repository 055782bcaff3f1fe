# syntax=docker/dockerfile:1
# sglang-sim, the simulated SGLang worker (sim/README.md), as a slim runtime image.
# Build context: the repository root.
#
#   docker build -f docker/sim.Dockerfile -t prefix-router/sglang-sim:dev .
#   docker run --rm -p 30000:30000 prefix-router/sglang-sim:dev --model llama --worker-id w0

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN rm -f rust-toolchain.toml
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked -p sglang-sim --release \
 && install -D target/release/sglang-sim /artifact/sglang-sim

# Same Debian release as the build stage (glibc).
FROM debian:bookworm-slim
# curl: the health check (GET /health).
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /artifact/sglang-sim /usr/local/bin/sglang-sim
USER 65534:65534
EXPOSE 30000
HEALTHCHECK --interval=2s --timeout=2s --start-period=5s --retries=15 \
  CMD curl -fsS -o /dev/null http://127.0.0.1:30000/health || exit 1
# Listen on every interface (the default 127.0.0.1 is unreachable from other containers).
# SIGTERM drains: running requests finish, then the process exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["sglang-sim", "--host", "0.0.0.0", "--port", "30000"]
CMD ["--model", "llama"]
