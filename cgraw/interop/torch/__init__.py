"""torch: everything cgraw does with torch, imported only once the user has imported torch.

Owns: the one module of torch's private API (``private_api``: every private name, feature-detected
and checked); routing torch's allocations into a pool during a capture (``pools``) and the pool's
checkpoints (``checkpoints``); the settings that choose kernels (``kernel_state``); the dispatch
modes (``modes``, ``observe``: what a warm-up learns); random numbers inside captures (``rng``,
``rng_patch``); autograd through graphed functions (``autograd``); and ``torch.compile``'s
``backend="cgraw"`` (``backend``, with Inductor's partitions in ``partitions``).

May import: ``errors``, ``_cuda``, ``runtime``, ``rng``; ``autograd`` the tree's pure modules;
``backend`` the public ``trees.graphed``.
"""
