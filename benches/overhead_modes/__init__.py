"""benches/overhead, one module per measurement mode (table, count, rss, stream) and what
they share (common); the command line is benches/overhead.py."""
