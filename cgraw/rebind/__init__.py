"""Zero-copy eager inputs: graphs that read the caller's tensors in place instead of copying them.

Owns: finding the kernel-argument words and copy addresses that point into an input's
placeholder (``scan``, pure), the device memory ranges a graph reaches (``ranges``), and the
record-time plan and first-replay proof that decide, per input, between rebinding and copying
(``proof``).

May import: ``errors``, ``_cuda``, ``runtime``, ``rng``, ``interop.torch.private_api``, and
``trees.recording`` (the recording it patches). Never the tree's decisions.
"""
