// Session 53 probe (issue 19): the highest read bandwidth a kernel reaches on this GPU for the bytes of a decode read
// of a full-precision cache (K and V of [B, Hkv, T, d] fp16: 4 * B * Hkv * T * d bytes), timed as benchutil times a
// read (a CUDA graph of reads back to back; buffers rotated so a read never finds its bytes in L2).
//
// Why: 23 of the 31 H100 grid cells below 1.0x (session 53) are full-precision reads - the empty stack and paged
// dense - which read the same bytes as SDPA and run at 0.94-1.00x of it (0.82-0.84x at the three largest paged
// pools).  Whether a better kernel can put them above 1.0x depends on how far SDPA itself is from what the GPU can
// read.  This program measures that ceiling with kernels that only read (and XOR what they read, so nothing is
// optimised away), three ways:
//   ldg U      - every thread loads U 16-byte vectors per step (ld.global.nc.L1::no_allocate), grid-stride over the
//                bytes, one wave of CTAs (as many as fit); ptxas keeps at most 4 of a thread's loads in flight
//                whatever U is (it consumes the first ones before issuing the rest), which at 8 CTAs of 256 threads
//                is still 128 KB in flight per SM - several times what the bandwidth-latency product needs;
//   cpasync S  - 16 KB tiles copied into shared memory by cp.async (16 bytes a thread, .cg), S stages in flight per CTA,
//                each tile read back from shared memory (the decode kernels' pipeline without the arithmetic);
//   bulk S     - 32 KB tiles copied by the tensor memory accelerator's 1-D bulk copy (cp.async.bulk, one thread per
//                tile, an mbarrier per stage), S stages in flight per CTA (sm_90).
// Every variant's XOR of all the bytes is checked against the first one's (a tile read twice or skipped changes it).
//   nvcc -O3 -std=c++17 -w -gencode=arch=compute_90a,code=sm_90a -o read_ceiling gpu_read_ceiling.cu
//   ./read_ceiling llama3-8b:16:32k smollm2-135m:64:32k ...   (benchutil's shape names; prints a markdown table)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_probe.cuh"

namespace rc {

constexpr int NT = 256;            // threads per CTA
constexpr int CP_TILE = 16 * 1024;  // bytes per cp.async stage
constexpr int BULK_TILE = 32 * 1024;  // bytes per bulk-copy stage

__global__ void fill(uint4* p, long long n, unsigned seed) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const unsigned h = (unsigned)i * 2654435761u ^ (unsigned)(i >> 32) * 40503u ^ seed;
    p[i] = make_uint4(h, h * 3u + 1u, h ^ 0x9e3779b9u, h + seed);
  }
}

__device__ __forceinline__ uint4 x4(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

__device__ __forceinline__ uint4 load_nc(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The CTA's XOR into out[blockIdx.x] (written, not accumulated: one launch gives the checksum).
__device__ __forceinline__ void finish(uint4 acc, uint4* out) {
  __shared__ uint4 w[NT / 32];
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    acc.x ^= __shfl_xor_sync(0xffffffffu, acc.x, o);
    acc.y ^= __shfl_xor_sync(0xffffffffu, acc.y, o);
    acc.z ^= __shfl_xor_sync(0xffffffffu, acc.z, o);
    acc.w ^= __shfl_xor_sync(0xffffffffu, acc.w, o);
  }
  if ((threadIdx.x & 31) == 0) w[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint4 r = w[0];
    for (int i = 1; i < NT / 32; ++i) r = x4(r, w[i]);
    out[blockIdx.x] = r;
  }
}

template <int U>
__global__ void __launch_bounds__(NT) read_ldg(const uint4* __restrict__ p, long long n, uint4* out) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long long stride = (long long)gridDim.x * NT;
  long long i = blockIdx.x * (long long)NT + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load_nc(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc = x4(acc, v[u]);
  }
  for (; i < n; i += stride) acc = x4(acc, load_nc(p + i));
  finish(acc, out);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Tile t of the CTA's tiles (blockIdx.x, blockIdx.x + gridDim.x, ...), S stages of CP_TILE bytes.
template <int S>
__global__ void __launch_bounds__(NT) read_cpasync(const uint4* __restrict__ p, long long n, uint4* out) {
  extern __shared__ __align__(128) uint4 sm[];
  constexpr int V = CP_TILE / 16;
  const long long ntiles = (n + V - 1) / V;
  uint4 acc = make_uint4(0, 0, 0, 0);
  auto issue = [&](long long tile, int stage) {
    if (tile < ntiles) {
      for (int j = threadIdx.x; j < V; j += NT) {
        const long long idx = tile * V + j;
        if (idx < n)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(sm + stage * V + j)), "l"(p + idx)
                       : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue(blockIdx.x + (long long)s * gridDim.x, s);
  for (long long k = 0;; ++k) {
    const long long cur = blockIdx.x + k * gridDim.x;
    if (cur >= ntiles) break;
    issue(cur + (long long)(S - 1) * gridDim.x, (int)((k + S - 1) % S));  // the stage read in iteration k - 1
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");
    __syncthreads();
    const int st = (int)(k % S);
    for (int j = threadIdx.x; j < V; j += NT) {
      if (cur * V + j < n) acc = x4(acc, sm[st * V + j]);
    }
    __syncthreads();
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  finish(acc, out);
}

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
  unsigned ok;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!ok);
}

template <int S>
__global__ void __launch_bounds__(NT) read_bulk(const uint4* __restrict__ p, long long n, uint4* out) {
  extern __shared__ __align__(128) uint4 sm[];
  __shared__ __align__(8) unsigned long long bars[S];
  constexpr int V = BULK_TILE / 16;
  const long long ntiles = (n + V - 1) / V;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + s)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](long long tile, int stage) {  // thread 0
    if (tile >= ntiles) return;
    const long long left = n - tile * V;
    const unsigned bytes = (unsigned)((left < V ? left : V) * 16);
    const unsigned bar = smem_addr(bars + stage);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stage's generic reads before the async write
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(sm + stage * V)),
                 "l"(p + tile * V), "r"(bytes), "r"(bar)
                 : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < S; ++s) issue(blockIdx.x + (long long)s * gridDim.x, s);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long k = 0;; ++k) {
    const long long cur = blockIdx.x + k * gridDim.x;
    if (cur >= ntiles) break;
    const int st = (int)(k % S);
    bar_wait(smem_addr(bars + st), (unsigned)((k / S) & 1));
    for (int j = threadIdx.x; j < V; j += NT) {
      if (cur * V + j < n) acc = x4(acc, sm[st * V + j]);
    }
    __syncthreads();  // every thread is done with the stage before it is refilled
    if (threadIdx.x == 0) issue(cur + (long long)S * gridDim.x, st);
  }
  finish(acc, out);
}

using Kernel = void (*)(const uint4*, long long, uint4*);

struct Variant {
  std::string name;
  Kernel k;
  int smem;  // dynamic shared memory bytes
};

std::vector<Variant> variants(int major) {
  std::vector<Variant> v = {{"ldg 4", read_ldg<4>, 0},
                            {"ldg 16", read_ldg<16>, 0},
                            {"cpasync 2", read_cpasync<2>, 2 * CP_TILE},
                            {"cpasync 4", read_cpasync<4>, 4 * CP_TILE},
                            {"cpasync 8", read_cpasync<8>, 8 * CP_TILE}};
  if (major >= 9) {
    v.push_back({"bulk 2", read_bulk<2>, 2 * BULK_TILE});
    v.push_back({"bulk 3", read_bulk<3>, 3 * BULK_TILE});
    v.push_back({"bulk 6", read_bulk<6>, 6 * BULK_TILE});
  }
  return v;
}

// benchutil's shape names: llama3-8b (8 kv heads, d 128), smollm2-135m (3, 64); ctx 4k / 32k / 128k or a number
bool parse(const char* spec, long long* bytes) {
  char model[64];
  int b = 0;
  char ctx[32];
  if (sscanf(spec, "%63[^:]:%d:%31s", model, &b, ctx) != 3 || b < 1) return false;
  int h, d;
  if (!strcmp(model, "llama3-8b")) {
    h = 8, d = 128;
  } else if (!strcmp(model, "smollm2-135m")) {
    h = 3, d = 64;
  } else {
    return false;
  }
  char* end;
  long long t = strtoll(ctx, &end, 10);
  if (*end == 'k') t *= 1024, ++end;
  if (*end != 0 || t < 1) return false;
  *bytes = 4LL * b * h * t * d;
  return true;
}

}  // namespace rc

int main(int argc, char** argv) {
  using namespace rc;
  if (argc < 2) {
    fprintf(stderr, "usage: %s SHAPE... (e.g. llama3-8b:16:32k smollm2-135m:64:32k)\n", argv[0]);
    return 2;
  }
  int dev = 0, sms = 0, major = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  const std::vector<Variant> vs = variants(major);
  printf("%s, %d SMs; reads of K + V (4 * B * Hkv * T * d bytes), a CUDA graph of %d reads, %d replays, buffers "
         "rotated past L2\n\n",
         prop.name, sms, 10, 20);
  printf("| shape | bytes (MB) | variant | CTAs | us per read | TB/s |\n|---|---|---|---|---|---|\n");
  std::vector<std::pair<std::string, std::string>> best;
  int bad = 0;
  for (int a = 1; a < argc; ++a) {
    long long bytes = 0;
    if (!rc::parse(argv[a], &bytes)) {
      fprintf(stderr, "bad shape %s (MODEL:B:CTX, MODEL llama3-8b or smollm2-135m)\n", argv[a]);
      return 2;
    }
    size_t free_b = 0, total_b = 0;
    CK(cudaMemGetInfo(&free_b, &total_b));
    const long long l2 = 256LL << 20;
    const int copies = (int)std::max(1LL, std::min(8LL, (l2 + bytes - 1) / bytes));
    if ((double)bytes * copies > 0.8 * (double)free_b) {
      printf("| %s | %.1f | (does not fit) | | | |\n", argv[a], bytes / 1e6);
      continue;
    }
    const long long n = bytes / 16;
    std::vector<uint4*> buf(copies);
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&buf[c], (size_t)n * 16));
      fill<<<4 * sms, 256>>>(buf[c], n, 1234u);  // the same bytes in every copy
    }
    CK(cudaDeviceSynchronize());
    uint4* out = nullptr;
    CK(cudaMalloc(&out, 64 * 1024 * sizeof(uint4)));
    std::vector<uint4> host;
    uint4 ref = make_uint4(0, 0, 0, 0);
    double best_tbps = 0;
    std::string best_name;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (size_t vi = 0; vi < vs.size(); ++vi) {
      const Variant& v = vs[vi];
      if (v.smem > 48 * 1024) CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
      int per_sm = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.k, NT, v.smem));
      if (per_sm < 1) continue;
      const int grid = per_sm * sms;
      // checksum of one launch
      v.k<<<grid, NT, v.smem, s>>>(buf[0], n, out);
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      host.resize(grid);
      CK(cudaMemcpy(host.data(), out, grid * sizeof(uint4), cudaMemcpyDeviceToHost));
      uint4 x = make_uint4(0, 0, 0, 0);
      for (int i = 0; i < grid; ++i) x.x ^= host[i].x, x.y ^= host[i].y, x.z ^= host[i].z, x.w ^= host[i].w;
      if (vi == 0) ref = x;
      const bool ok = x.x == ref.x && x.y == ref.y && x.z == ref.z && x.w == ref.w;
      bad += !ok;
      // timing: a graph of 10 reads, each of the next copy
      const double us = graph_us(s, 10, 20, [&](int r) { v.k<<<grid, NT, v.smem, s>>>(buf[r % copies], n, out); });
      const double tbps = bytes / us / 1e6;
      printf("| %s | %.1f | %s%s | %d (%d per SM) | %.1f | %.2f |\n", argv[a], bytes / 1e6, v.name.c_str(),
             ok ? "" : " (CHECKSUM MISMATCH)", grid, per_sm, us, tbps);
      fflush(stdout);
      if (ok && tbps > best_tbps) best_tbps = tbps, best_name = v.name;
    }
    char line[160];
    snprintf(line, sizeof line, "%.2f TB/s (%s)", best_tbps, best_name.c_str());
    best.emplace_back(argv[a], line);
    CK(cudaStreamDestroy(s));
    CK(cudaFree(out));
    for (auto* b : buf) CK(cudaFree(b));
  }
  printf("\n| shape | best |\n|---|---|\n");
  for (auto& b : best) printf("| %s | %s |\n", b.first.c_str(), b.second.c_str());
  if (bad) printf("\n%d variant(s) read other bytes than the first (checksum mismatch)\n", bad);
  return bad ? 1 : 0;
}
