/* A stand-in libcuda.so.1 for CPU-only machines.
 *
 * sgl_kernel's common_ops extension links against libcuda.so.1 and resolves its driver
 * symbols at load time (checked with `nm -D --undefined-only` on each release's
 * `sgl_kernel/sm100/common_ops.abi3.so`): sglang-kernel 0.4.10 (SGLang 0.5.23) needs
 * cuPointerGetAttribute only; 0.4.2.post2 (SGLang 0.5.12) also the virtual-memory calls
 * below and cuGetErrorString.  Nothing calls them on the CPU path; if something ever
 * does, it gets CUDA_ERROR_NO_DEVICE instead of a crash.
 */
#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

#define NO_DEVICE 100 /* CUDA_ERROR_NO_DEVICE */

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    (void)data;
    (void)attribute;
    (void)ptr;
    return NO_DEVICE;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    (void)error;
    if (text != NULL) {
        *text = "no CUDA device (the sglang_r3 CPU stub libcuda.so.1)";
    }
    return 0;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    (void)ptr;
    (void)size;
    return NO_DEVICE;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
    (void)base;
    (void)size;
    (void)ptr;
    return NO_DEVICE;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    (void)handle;
    return NO_DEVICE;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    (void)handle;
    (void)addr;
    return NO_DEVICE;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    (void)ptr;
    (void)size;
    (void)desc;
    (void)count;
    return NO_DEVICE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    (void)ptr;
    (void)size;
    return NO_DEVICE;
}
