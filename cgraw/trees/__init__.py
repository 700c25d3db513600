"""Graph trees: ``@cgraw.graphed``, with torch's CUDAGraph-Trees semantics.

Owns, from the public API down: the decorator, per-thread trees and ``report()`` (``graphed``);
``make_graphed_callables`` (``callables``); the CUDA backend that warms up, records, replays
and restores (``cuda_backend``, with ``warmup``); what a recording holds for its replay
(``recording``); the tree's decisions (``manager``, with its pool side ``pool``, the growth of
its nodes, ``growth``, and the outputs it watches, ``outputs``); nodes, settings and the backend
protocol (``nodes``, ``config``); the classification of a call's arguments (``calls``, over
``arrays``, ``frameworks`` and ``buckets``); and the design of autograd through graphed functions
(``autograd``).

The decisions (``manager``, ``growth``, ``pool``, ``outputs``, ``nodes``, ``config``, ``calls``,
``arrays``, ``frameworks``, ``buckets``, ``autograd``) are pure Python, tested on the CPU with a
fake backend; they import no CUDA and no framework. The CUDA side (``cuda_backend``, ``warmup``,
``recording``) may import ``runtime``, ``rebind``, ``rng`` and ``interop``.
"""
