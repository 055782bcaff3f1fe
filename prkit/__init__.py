"""prkit: the Python kit that tests/, load/ and benches/ share.

One place for what every Python tool around the filter needs:

* `prkit.build`: the Envoy binary, the filter `.wasm`, the `sglang-sim` binary and the other
  tools, located or built by one policy (cargo builds once per process, so a stale artifact is
  never used; an environment variable names a prebuilt one instead).
* `prkit.ports`: `free_port()`, `port_pair()` (outside the ephemeral range; never one another
  prkit process holds, never the same port twice in a process).
* `prkit.envoy`: `Envoy`, one Envoy process (its own base id, hot-restart epochs, admin, stats);
  `wait_inflight_zero`; `check_config` / `validate_config` (`envoy --mode validate`).
* `prkit.fleet`: `SimWorker` / `SimFleet`, simulated SGLang workers (also the `scripts/fleet` CLI).
* `prkit.fake_workers`: `Worker` / `WorkerPool`, fake recording LLM workers for tests.
* `prkit.client`: `Client` / `Reply`, a keep-alive test client (the decision header parsed).
* `prkit.stack`: `Stack`, fake workers + Envoy on the demo config (the integration tests' unit).
* `prkit.prom`: Prometheus text parsing and metric helpers.
* `prkit.wait`: waiting for a condition up to a deadline (never a timing assertion).
* `prkit.envoy_config`: Envoy configs (the generator behind `envoy/gen`; `run_gen` runs it).

Import it from the repository root (pytest.ini sets `pythonpath = .`; the executables set
PYTHONPATH and run `python -m ...`).
"""
