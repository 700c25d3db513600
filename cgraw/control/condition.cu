// The set-condition kernel of cgraw.while_loop and cgraw.cond (cgraw.control.kernels): one thread
// reads the device predicate (one byte, nonzero: true) and sets the conditional node's handle.
// NVRTC has cudaGraphConditionalHandle built in but not cudaGraphSetConditional, which is declared
// here as cuda_device_runtime_api.h declares it (so no include path is needed; the typedef repeats
// NVRTC's own, which C++ allows). Compiled without -rdc: the driver resolves the call at load.
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

// negate: 1 sets the handle to the opposite of the predicate (the ELSE of two IF nodes, for drivers
// before 12.8, which have no IF node with two bodies)
extern "C" __global__ void cgraw_set_condition(cudaGraphConditionalHandle handle, const unsigned char* pred,
                                               unsigned long long negate) {
  unsigned int v = *pred != 0 ? 1u : 0u;
  cudaGraphSetConditional(handle, negate ? 1u - v : v);
}
