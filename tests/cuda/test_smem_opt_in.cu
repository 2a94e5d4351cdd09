// tests/cuda/test_smem_opt_in.cu — the dynamic shared-memory opt-in of cuda/common/device_info.h.
//
// allow_dynamic_smem remembers what it set per (device, kernel) so that a repeated launch makes no runtime
// call. The attribute must only grow: a launch with less after one with more must not lower it, or the next
// launch with more is refused (cudaErrorInvalidValue at launch). One kernel, launched with 100 KB, then 60 KB,
// then 100 KB again, each after its allow_dynamic_smem. GTEST_SKIP without a GPU (CI builds it and skips).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include "common/device_info.h"

namespace {

__global__ void touch_smem_kernel(int* out, int words) {
  extern __shared__ int smem[];
  for (int i = threadIdx.x; i < words; i += blockDim.x) smem[i] = i;
  __syncthreads();
  if (threadIdx.x == 0) *out = smem[words - 1];
}

bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Launches with `bytes` of dynamic shared memory after allow_dynamic_smem; returns the launch's error.
cudaError_t launch_with(int* out, int bytes) {
  deltacp::cuda::allow_dynamic_smem(touch_smem_kernel, static_cast<size_t>(bytes));
  touch_smem_kernel<<<1, 128, bytes>>>(out, bytes / 4);
  const cudaError_t err = cudaGetLastError();
  return err != cudaSuccess ? err : cudaDeviceSynchronize();
}

TEST(SmemOptIn, ALaunchWithLessDoesNotLowerTheOptIn) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device";
  if (deltacp::cuda::max_smem_optin() < 100 * 1024) GTEST_SKIP() << "this GPU allows less than 100 KB per block";
  int* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, sizeof(int)), cudaSuccess);
  for (int bytes : {100 * 1024, 60 * 1024, 100 * 1024, 48 * 1024, 100 * 1024}) {
    EXPECT_EQ(launch_with(out, bytes), cudaSuccess) << bytes << " bytes";
    int host = -1;
    ASSERT_EQ(cudaMemcpy(&host, out, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(host, bytes / 4 - 1) << bytes << " bytes";
  }
  cudaFree(out);
}

}  // namespace
