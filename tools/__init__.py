"""Repository tools, not part of cgraw and not installed with it: diagnostics (``tools/diag``),
probes (``tools/probes``), the sanitizer smoke run and the GPU machine's session script
(``tools/gpu_session.sh``). Run the Python ones from the repository root as modules, e.g.
``python3 -m tools.probes.rebind_probe``; the benchmarks users run are in ``benchmarks/``."""
