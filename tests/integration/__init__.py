# Package marker: test modules import as `integration.*`, so their names never clash with tests/sim.
