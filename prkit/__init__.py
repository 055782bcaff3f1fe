"""prkit: the Python kit that tests/, load/, benches/ and envoy/gen share (run from the repository
root, or with it on PYTHONPATH)."""
