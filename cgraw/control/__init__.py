"""Control flow on the device: ``cgraw.while_loop`` and ``cgraw.cond``.

Outside a capture they run on the host; inside ``cgraw.capture()`` (and graph-tree recordings)
they become CUDA conditional nodes (WHILE, IF) whose bodies are captured from the user's code.
``plan`` (pure: structures, node kinds per driver, copies of carried values, body rules),
``kernels`` (the set-condition kernel's CUDA C, ``condition.cu``), ``nodes`` (the capture path),
``hops`` (``torch.cond`` and torch's ``while_loop`` onto the same nodes) and ``flow`` (the public
functions and the host path).
"""
