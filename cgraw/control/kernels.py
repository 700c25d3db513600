"""The CUDA C of the set-condition kernel (``condition.cu``) and the NVRTC options it needs.

Layer L1 (pure): text and option lists only; ``cgraw.control.nodes`` compiles and launches it
through ``cgraw._cuda.kernels``. ``cudaGraphSetConditional`` is a CUDA runtime builtin
(``__cudart_builtin__``, declared in ``cuda_device_runtime_api.h``): compiled without relocatable
device code, the cubin is an executable image whose reference to it the driver resolves when it
loads the module, as it resolves ``vprintf`` for ``printf``. That is how cuda.core's tests
(NVRTC, ``std=c++17``, ``arch=sm_XX``, a cubin) and CuPy's graph API (``RawModule``, NVRTC) build
their set-condition kernels, and how PyTorch's ``CUDAGraph.cu`` is compiled. ``-rdc=true`` is
wrong here: it makes a relocatable object (ELF type REL) that needs a link step with the device
runtime library, which ``cuModuleLoadData`` does not do. NVRTC knows ``cudaGraphConditionalHandle``
but not the function, so the file declares both, as cuda.core's tests do; no include path is needed.
"""

from __future__ import annotations

from importlib import resources

SET_CONDITION = "cgraw_set_condition"


def source(name: str) -> str:
    """The CUDA C defining kernel ``name``."""
    if name != SET_CONDITION:
        raise KeyError(f"no control-flow kernel named {name!r}")
    return resources.files(__package__).joinpath("condition.cu").read_text()


def options() -> tuple[str, ...]:
    """The extra NVRTC options of the set-condition kernel: none (an executable cubin, no
    relocatable device code, no include path)."""
    return ()
