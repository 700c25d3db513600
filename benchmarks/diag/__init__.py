"""Diagnostics for process aborts of the GPU tiers (``gpu_session.sh segv``); not part of cgraw."""
