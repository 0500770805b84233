/* cuda_launch.h: kernel launches with programmatic dependent launch (PDL, Hopper), internal to
 * kernels/cuda/.
 *
 * A decode step is a chain of ~15 small kernels a layer; between two of them the GPU normally
 * drains the first grid before it starts the second. Launched with programmatic stream
 * serialization, the next kernel's blocks may start while the previous grid's last blocks still
 * run; every kernel launched this way calls grid_dep_wait() before it touches memory that the
 * previous kernel writes or reads (the wait returns once the previous grid has completed and
 * its writes are visible), and may do independent work before it: the GEMV streams its first
 * weights there. Kernels launched by cuBLAS keep ordinary stream order.
 *
 * KVS_CUDA_PDL=0 turns it off (plain launches; grid_dep_wait() is then a no-op).
 * Errors: CUDA_CHECK (below) aborts with file:line on any failed CUDA call (bugs, not client
 * errors); it needs base/util.h (kvs_panic) included first.
 */
#ifndef KVS_CUDA_LAUNCH_H
#define KVS_CUDA_LAUNCH_H

#include <cuda_runtime.h>
#include <stdlib.h>
#include <utility>

#define CUDA_CHECK(call)                                                                     \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess)                                                               \
            kvs_panic(__FILE__, __LINE__, "CUDA error %s (%s) in %s", cudaGetErrorName(e_),   \
                      cudaGetErrorString(e_), #call);                                        \
    } while (0)

__device__ __forceinline__ void grid_dep_wait()
{
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

/* Early launch of the next kernel: without it a grid lets its dependent start only as its last
 * blocks exit, so the dependent's blocks (and the weights a GEMM fetches before its wait) only
 * begin once this grid's tail has drained. Called by every thread once it is past grid_dep_wait()
 * (and, in the GEMMs, once its first copies are issued): when every block of this grid has
 * called it, the next kernel's blocks may take SM slots as this grid's blocks leave and run up to
 * their own wait. Safe whatever the position: the dependent's grid_dep_wait() still waits for
 * this grid to complete and flush, and since this grid has passed its own wait, for its
 * predecessors too. `on` is the kernel's copy of kvs_cu_pdl_early() (a launch argument, so that
 * the knob needs no device symbol per translation unit). */
__device__ __forceinline__ void grid_dep_launch(int on)
{
    if (on) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

/* 1 unless KVS_CUDA_PDL=0 (read once) */
inline int kvs_cu_pdl_enabled()
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVS_CUDA_PDL");
        on = e ? atoi(e) != 0 : 1;
    }
    return on;
}

/* 1 when the decode-step kernels call grid_dep_launch (above): KVS_CUDA_PDL_EARLY=0/1, else the
 * default (cuda_skinny.cu, where it was measured); read once, 0 whenever PDL is off. */
int kvs_cu_pdl_early(void);
/* for tests and benchmarks: 0 / 1 sets it for later launches (graphs keep the value they were
 * captured with), -1 back to the environment or default. Not thread-safe. */
void kvs_cu_set_pdl_early(int on);

/* kern<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization; returns
 * the launch status (the caller checks it) */
template <typename... KArgs, typename... Args>
inline cudaError_t kvs_cu_launch(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                 Args &&...args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = kvs_cu_pdl_enabled() ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...);
}

#endif
