"""Load tools: k6 scenarios, the demo and the router comparison (run `load/compare`)."""
