// The set-condition kernel of cgraw.while_loop and cgraw.cond (cgraw.control.kernels): one thread
// reads the device predicate (one byte, nonzero: true) and sets the conditional node's handle.
// Declared here rather than included, so NVRTC needs no CUDA include path; NVRTC's own builtin
// declarations, where present, are the same.
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
