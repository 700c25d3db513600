"""Diagnostics for process aborts of the GPU tiers (``bash tools/gpu_session.sh segv``); not part of cgraw.

``pytest -p tools.diag.pytest_diag`` from the repository root loads the plugin."""
