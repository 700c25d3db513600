"""The CUDA C of the set-condition kernel (``condition.cu``) and the NVRTC options it needs.

Layer L1 (pure): text and option lists only; ``cgraw.control.nodes`` compiles and launches it
through ``cgraw._cuda.kernels``. ``cudaGraphSetConditional`` is a device-runtime function: NVRTC
compiles calls to it with relocatable device code (``-rdc=true``). The file declares what it
uses, so no header is needed; a CUDA include directory, when one is found, is passed as well.
"""

from __future__ import annotations

import os
from importlib import resources

SET_CONDITION = "cgraw_set_condition"


def source(name: str) -> str:
    """The CUDA C defining kernel ``name``."""
    if name != SET_CONDITION:
        raise KeyError(f"no control-flow kernel named {name!r}")
    return resources.files(__package__).joinpath("condition.cu").read_text()


def include_dirs(environ=None, exists=os.path.isdir) -> list[str]:
    """CUDA include directories: ``$CUDA_HOME/include``, ``$CUDA_PATH/include``, then
    ``/usr/local/cuda/include``, those that exist (the first found is enough)."""
    env = os.environ if environ is None else environ
    candidates = [os.path.join(env[k], "include") for k in ("CUDA_HOME", "CUDA_PATH") if env.get(k)]
    candidates.append("/usr/local/cuda/include")
    return [d for d in candidates if exists(d)][:1]


def options(environ=None, exists=os.path.isdir) -> tuple[str, ...]:
    """The extra NVRTC options of the set-condition kernel."""
    return ("-rdc=true", *(f"--include-path={d}" for d in include_dirs(environ, exists)))
