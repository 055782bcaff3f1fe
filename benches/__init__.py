"""Benchmark tooling (Python): `benches/overhead` runs `python -m benches.overhead`."""
