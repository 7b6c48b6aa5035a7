/* A stand-in libcuda.so.1 for CPU-only machines.
 *
 * sgl_kernel's common_ops extension links against libcuda.so.1 and resolves exactly
 * one driver symbol at load time (checked with `nm -D --undefined-only` on
 * sglang-kernel 0.4.10).  Nothing calls it on the CPU path; if something ever does,
 * it gets CUDA_ERROR_NO_DEVICE instead of a crash.
 */
typedef int CUresult;

CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data;
    (void)attribute;
    (void)ptr;
    return 100; /* CUDA_ERROR_NO_DEVICE */
}
