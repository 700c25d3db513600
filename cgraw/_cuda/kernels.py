"""cgraw's own kernels: NVRTC compilation, module loading and launches.

Part of layer L1 (``cgraw._cuda``). NVRTC is reached through ``cuda.bindings.nvrtc``; a failed
compile raises ``CudaError`` with NVRTC's log in its description. Compiled images are cached per
(architecture, kernel name) and loaded functions per (context, kernel name), so a kernel compiles
once per process and loads once per device.
"""

from __future__ import annotations

import ctypes
import threading

from cuda.bindings import driver as drv

from cgraw.errors import CudaError

_lock = threading.Lock()
_images: dict[tuple, bytes] = {}  # (arch, name, options) -> cubin or PTX
_functions: dict[tuple, object] = {}  # (context, name, options) -> CUfunction
_modules: list = []  # loaded modules stay loaded for the process (kernels of live graphs use them)

ARG_PTR = ctypes.c_uint64
ARG_U64 = ctypes.c_uint64
ARG_I64 = ctypes.c_int64
ARG_F64 = ctypes.c_double
ARG_F32 = ctypes.c_float


def _nvrtc():
    """``cuda.bindings.nvrtc``, its library loaded: cuda-bindings finds ``libnvrtc`` at the first
    call (``cuda.pathfinder``), and a missing library raises ``CudaError`` here, not a loader error
    from inside the first compile."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as e:  # ImportError, or cuda.pathfinder's DynamicLibNotFoundError
        raise CudaError("nvrtcVersion", 0, "NVRTC_UNAVAILABLE", str(e),
                        "install the NVRTC library of the CUDA runtime (pip install nvidia-cuda-nvrtc, which "
                        "CUDA builds of torch and CuPy bring), or put libnvrtc on the library path") from e
    return nvrtc


def _nvrtc_check(nvrtc, result, call: str, prog=None):
    err = result[0]
    if int(err) != 0:
        log = ""
        if prog is not None:
            try:
                _, size = nvrtc.nvrtcGetProgramLogSize(prog)
                buf = b" " * size
                nvrtc.nvrtcGetProgramLog(prog, buf)
                log = buf.decode(errors="replace").strip("\x00 \n")
            except Exception:
                pass
        try:
            _, s = nvrtc.nvrtcGetErrorString(err)
            name = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:
            name = str(err)
        raise CudaError(call, int(err), name, log or name,
                        "cgraw compiles its kernels (random numbers, set-condition) with NVRTC; check that the NVRTC "
                        "library of the installed CUDA runtime loads (libnvrtc)")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def compute_capability(device_ordinal: int) -> tuple[int, int]:
    from cgraw._cuda import check, device_get

    dev = device_get(device_ordinal)
    A = drv.CUdevice_attribute
    major = check(drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                  "cuDeviceGetAttribute")
    minor = check(drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                  "cuDeviceGetAttribute")
    return int(major), int(minor)


def multiprocessor_count(device_ordinal: int) -> int:
    from cgraw._cuda import check, device_get

    A = drv.CUdevice_attribute
    return int(check(drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                              device_get(device_ordinal)), "cuDeviceGetAttribute"))


def compile_image(source: str, name: str, arch: tuple[int, int], options: tuple = ()) -> bytes:
    """Compile ``source`` for ``arch``: a cubin when NVRTC knows the architecture, else PTX for
    the newest one it knows (the driver JIT-compiles it at load). ``options``: more NVRTC options
    (none for the set-condition kernel, ``cgraw.control.kernels``)."""
    nvrtc = _nvrtc()
    major, minor = arch
    supported = None
    try:
        n = _nvrtc_check(nvrtc, nvrtc.nvrtcGetNumSupportedArchs(), "nvrtcGetNumSupportedArchs")
        supported = list(_nvrtc_check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
                         or [])[:n]
    except Exception:
        pass
    cc = major * 10 + minor
    cubin = supported is None or cc in supported
    target = f"sm_{cc}" if cubin else f"compute_{max(a for a in supported if a <= cc) if supported else cc}"
    prog = _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), (name + ".cu").encode(), 0, [], []),
                        "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={target}".encode(), b"--std=c++17", b"-default-device",
                *(o.encode() if isinstance(o, str) else o for o in options)]
        _nvrtc_check(nvrtc, nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram", prog)
        if cubin:
            size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = b" " * size
            _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        else:
            size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            buf = b" " * size
            _nvrtc_check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf
    finally:
        try:
            nvrtc.nvrtcDestroyProgram(prog)
        except Exception:
            pass


def function(device_ordinal: int, name: str, source_for, options: tuple = ()) -> object:
    """The loaded ``CUfunction`` ``name`` on the current context of ``device_ordinal``;
    ``source_for(name)`` gives its source the first time it is needed on this architecture,
    compiled with the extra NVRTC ``options``."""
    from cgraw._cuda import check, ctx_get_current, native

    ctx = native(ctx_get_current())
    options = tuple(options)
    f = _functions.get((ctx, name, options))
    if f is not None:
        return f
    with _lock:
        f = _functions.get((ctx, name, options))
        if f is not None:
            return f
        arch = compute_capability(device_ordinal)
        key = (f"{arch[0]}{arch[1]}", name, options)
        image = _images.get(key)
        if image is None:
            image = _images[key] = compile_image(source_for(name), name, arch, options)
        module = check(drv.cuModuleLoadData(image), "cuModuleLoadData")
        _modules.append(module)
        f = check(drv.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
        _functions[(ctx, name, options)] = f
        return f


def launch(func, grid: int, block: int, args: tuple, types: tuple, stream) -> None:
    """``cuLaunchKernel`` of a 1-D grid on ``stream`` (a ``CUstream`` or an address)."""
    from cgraw._cuda import check

    check(drv.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, 0, stream, (args, types), 0), "cuLaunchKernel")


def memset_d32_async(ptr: int, value: int, count: int, stream) -> None:
    from cgraw._cuda import check

    check(drv.cuMemsetD32Async(ptr, value, count, stream), "cuMemsetD32Async")


def memset_d8_async(ptr: int, value: int, count: int, stream) -> None:
    from cgraw._cuda import check

    check(drv.cuMemsetD8Async(ptr, value, count, stream), "cuMemsetD8Async")
