"""One-off GPU probes: each answers one question about the runtime on a device (what fills a
tree's pool, whether a kernel's input can be read in place, what graph-safe random numbers do
inside a capture) and writes a JSON to ``$OUT``. Not benchmarks, not tests. Run from the
repository root: ``python3 -m tools.probes.NAME``."""
