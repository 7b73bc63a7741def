// Session 52 probe (issue 19): what merging a batch-1 read's split partials costs, apart from the attention itself.
// Sessions 51-52 measured the KIVI combine's own cost at 2.4-2.9 us per read, and found it unchanged whether the
// merge ran in a PDL-launched kernel (kivi_v3_combine), in the last CTA of each row (behind an arrival counter), or
// in one pass instead of two (docs/results.md, "Session 52").  This program times the merge alone, on stub split
// kernels that spin for a fixed time and write a partial of the KIVI kernel's shape (M query rows x DV channels per
// CTA, grid splits x rows), so the variants differ only in how the partials meet:
//   none        - the split kernel alone, its partial written to global memory and not merged (the floor);
//   pdl         - then kivi_v3_combine itself (included from kernels/kivi/cuda_kernel.cu), launched with PDL, as today;
//   last-cta    - each CTA fences its partial and counts itself in; the last CTA of a row merges the row from L2 and
//                 resets the counter (session 52's reverted in-kernel merge, on the stub);
//   cluster     - the splits of a row in one thread-block cluster (sm_90, at most 16): each CTA keeps its partial in
//                 shared memory, cluster barrier, every CTA merges its share of the row's channels from all peers'
//                 shared memory (distributed shared memory), cluster barrier - no global round trip, no second kernel;
//   cluster+pdl - clusters of 16, each merging into one global partial, then kivi_v3_combine over splits / 16 of them.
// Every merged output is checked against the pdl variant's.  Times: a CUDA graph of 20 reads back to back, replayed 50
// times (CUDA events), per read.  The head shape is a build option (the combine's DV is the kernel source's KIVI_DV):
//   nvcc -O3 -std=c++17 -w -gencode=arch=compute_90a,code=sm_90a [-DPROBE_DV=64] -o merge_floor gpu_merge_floor.cu
//   ./merge_floor ROWS M SPLITS...    (Llama-3-8B batch 1: 8 4 8 16 32 64; SmolLM2: 3 3 16 32 64, DV 64)
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifndef PROBE_DV
#define PROBE_DV 128
#endif
#define KIVI_DV PROBE_DV
#include "../kernels/kivi/cuda_kernel.cu"
#include "gpu_probe.cuh"

namespace cg = cooperative_groups;

namespace probe {

constexpr int DV = PROBE_DV, MAXM = 8, NT = 128;  // channels, most query rows per CTA, threads per CTA

__device__ __forceinline__ void spin(long long ns) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// A deterministic partial for (split, row, query row, channel) and its LSE, so every variant merges the same data.
__device__ __forceinline__ float part_value(int s, int r, int m, int c) {
  return __sinf(0.37f * s + 0.11f * r + 0.53f * m + 0.017f * c);
}
__device__ __forceinline__ float part_lse(int s, int r, int m) { return 0.5f * __cosf(1.3f * s + 0.7f * r + m); }

__device__ __forceinline__ void write_global(float* po, float* pl, int M) {
  const int s = blockIdx.x, r = blockIdx.y;
  const long long R = (long long)gridDim.y * M;
  for (int i = threadIdx.x; i < M * DV; i += NT) {
    const int m = i / DV, c = i % DV;
    po[((long long)s * R + r * M + m) * DV + c] = part_value(s, r, m, c);
  }
  if (threadIdx.x < M) pl[(long long)s * R + r * M + threadIdx.x] = part_lse(s, r, threadIdx.x);
}

// grid (splits, rows): partial [splits, rows * M, DV] / [splits, rows * M] in global memory.
__global__ void __launch_bounds__(NT) split_global(float* po, float* pl, int M, long long ns) {
  kivi_v3::pdl_trigger();
  spin(ns);
  write_global(po, pl, M);
}

// The same, then the last CTA of each row (arrival counter cnt[row], zero at entry and left zero) merges the row.
__global__ void __launch_bounds__(NT) split_last_cta(float* po, float* pl, float* out, float* lse, int* cnt, int M,
                                                     long long ns) {
  __shared__ int last;
  __shared__ float top[MAXM];
  spin(ns);
  write_global(po, pl, M);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(cnt + blockIdx.y, 1) == (int)gridDim.x - 1;
    if (last) atomicExch(cnt + blockIdx.y, 0);
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int S = gridDim.x, r = blockIdx.y;
  const long long R = (long long)gridDim.y * M;
  if (threadIdx.x < M) {
    float t = -INFINITY;
    for (int s = 0; s < S; ++s) t = fmaxf(t, __ldcg(pl + s * R + r * M + threadIdx.x));
    top[threadIdx.x] = t;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M * DV; i += NT) {
    const int m = i / DV, c = i % DV;
    float acc = 0.f, den = 0.f;
#pragma unroll 8
    for (int s = 0; s < S; ++s) {
      const long long o = s * R + r * M + m;
      const float w = __expf(__ldcg(pl + o) - top[m]);
      den += w;
      acc += w * __ldcg(po + o * DV + c);
    }
    out[(long long)(r * M + m) * DV + c] = acc / den;
    if (c == 0) lse[r * M + m] = top[m] + __logf(den);
  }
}

// grid (splits, rows), clusters of C along x (C = splits, or a divisor of it with the cluster partials in po / pl:
// the cluster's index blockIdx.x / C is its partial's split).  Each CTA merges M * DV / C elements of the row block
// from the C peers' shared memory.
__global__ void __launch_bounds__(NT) split_cluster(float* out, float* lse, float* po, float* pl, int M, long long ns,
                                                   int to_partials) {
  __shared__ float sp[MAXM * DV];
  __shared__ float sl[MAXM];
  __shared__ float stop[MAXM], sden[MAXM];
  cg::cluster_group cl = cg::this_cluster();
  const int C = (int)cl.num_blocks(), rank = (int)cl.block_rank();
  const int s = blockIdx.x, r = blockIdx.y, R = gridDim.y * M;
  kivi_v3::pdl_trigger();
  spin(ns);
  for (int i = threadIdx.x; i < M * DV; i += NT) sp[i] = part_value(s, r, i / DV, i % DV);
  if (threadIdx.x < M) sl[threadIdx.x] = part_lse(s, r, threadIdx.x);
  cl.sync();  // every peer's partial is in its shared memory
  if (threadIdx.x < M) {  // each row's largest LSE over the peers and the sum of their weights
    const int m = threadIdx.x;
    float t = -INFINITY;
    for (int p = 0; p < C; ++p) t = fmaxf(t, cl.map_shared_rank(&sl[0], p)[m]);
    float d = 0.f;
    for (int p = 0; p < C; ++p) d += __expf(cl.map_shared_rank(&sl[0], p)[m] - t);
    stop[m] = t;
    sden[m] = d;
  }
  __syncthreads();
  const int share = (M * DV + C - 1) / C;  // this CTA's elements of the row block
  const int end = min(M * DV, (rank + 1) * share);
  for (int i = rank * share + threadIdx.x; i < end; i += NT) {
    const int m = i / DV, c = i % DV;
    float acc = 0.f;
    for (int p = 0; p < C; ++p) {
      const float w = __expf(cl.map_shared_rank(&sl[0], p)[m] - stop[m]);
      acc += w * cl.map_shared_rank(&sp[0], p)[i];
    }
    const float v = acc / sden[m];
    if (to_partials) {
      po[((long long)(s / C) * R + r * M + m) * DV + c] = v;
      if (c == 0) pl[(long long)(s / C) * R + r * M + m] = stop[m] + __logf(sden[m]);
    } else {
      out[(long long)(r * M + m) * DV + c] = v;
      if (c == 0) lse[r * M + m] = stop[m] + __logf(sden[m]);
    }
  }
  cl.sync();  // no CTA leaves while a peer still reads its shared memory
}

}  // namespace probe

struct Shape {
  int rows, M, splits;
  long long ns;
};
struct Bufs {
  float *po, *pl, *out, *lse;
  int* cnt;
};
enum Variant { NONE, PDL, LAST_CTA, CLUSTER, CLUSTER_PDL, NVARIANTS };
static const char* NAMES[NVARIANTS] = {"none", "pdl", "last-cta", "cluster", "cluster+pdl"};

static cudaLaunchConfig_t cluster_config(const Shape& sh, int csize, cudaLaunchAttribute* attr, cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(sh.splits, sh.rows);
  cfg.blockDim = dim3(probe::NT);
  cfg.stream = st;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = csize;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

static int cluster_size(const Variant v, const Shape& sh) { return v == CLUSTER ? sh.splits : 16; }

// Whether the variant applies to the shape and the device can co-schedule its clusters.
static bool runs(Variant v, const Shape& sh) {
  if (v == CLUSTER && sh.splits > 16) return false;  // a cluster holds at most 16 CTAs (non-portable size)
  if (v == CLUSTER_PDL && (sh.splits <= 16 || sh.splits % 16)) return false;
  if (v != CLUSTER && v != CLUSTER_PDL) return true;
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = cluster_config(sh, cluster_size(v, sh), attr, 0);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, probe::split_cluster, &cfg) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

static void read_once(Variant v, const Bufs& b, const Shape& sh, cudaStream_t st) {
  const long long R = (long long)sh.rows * sh.M;
  const dim3 grid(sh.splits, sh.rows);
  if (v == NONE || v == PDL) {
    probe::split_global<<<grid, probe::NT, 0, st>>>(b.po, b.pl, sh.M, sh.ns);
    CK(cudaGetLastError());
    if (v == PDL) CK(launch_combine<float>(b.po, b.pl, b.out, b.lse, sh.splits, R, st, 1));
  } else if (v == LAST_CTA) {
    probe::split_last_cta<<<grid, probe::NT, 0, st>>>(b.po, b.pl, b.out, b.lse, b.cnt, sh.M, sh.ns);
    CK(cudaGetLastError());
  } else {
    cudaLaunchAttribute attr[1];
    const int c = cluster_size(v, sh);
    cudaLaunchConfig_t cfg = cluster_config(sh, c, attr, st);
    CK(cudaLaunchKernelEx(&cfg, probe::split_cluster, b.out, b.lse, b.po, b.pl, sh.M, sh.ns, (int)(v == CLUSTER_PDL)));
    if (v == CLUSTER_PDL) CK(launch_combine<float>(b.po, b.pl, b.out, b.lse, sh.splits / c, R, st, 1));
  }
}

static float time_variant(Variant v, const Bufs& b, const Shape& sh, cudaStream_t st) {
  read_once(v, b, sh, st);  // warm-up (a launch error surfaces here)
  CK(cudaStreamSynchronize(st));
  return graph_us(st, 20, 50, [&](int) { read_once(v, b, sh, st); });
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s ROWS M SPLITS...  (e.g. 8 4 8 16 32 64)\n", argv[0]);
    return 2;
  }
  const int rows = atoi(argv[1]), M = atoi(argv[2]);
  if (rows < 1 || M < 1 || M > probe::MAXM) {
    fprintf(stderr, "ROWS must be >= 1 and M in 1..%d (got %d, %d)\n", probe::MAXM, rows, M);
    return 2;
  }
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaFuncSetAttribute(probe::split_cluster, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const long long R = (long long)rows * M;
  int most = 0;
  for (int a = 3; a < argc; ++a) most = std::max(most, atoi(argv[a]));
  Bufs b;
  CK(cudaMalloc(&b.po, (size_t)most * R * probe::DV * sizeof(float)));
  CK(cudaMalloc(&b.pl, (size_t)most * R * sizeof(float)));
  CK(cudaMalloc(&b.out, (size_t)R * probe::DV * sizeof(float)));
  CK(cudaMalloc(&b.lse, (size_t)R * sizeof(float)));
  CK(cudaMalloc(&b.cnt, (size_t)rows * sizeof(int)));
  CK(cudaMemset(b.cnt, 0, (size_t)rows * sizeof(int)));
  std::vector<float> ref(R * probe::DV), got(R * probe::DV);
  printf("%s, %d SMs; %d rows x %d query rows x %d channels; a CUDA graph of 20 reads, 50 replays; us per read\n\n",
         prop.name, prop.multiProcessorCount, rows, M, probe::DV);
  printf("| splits | spin (us) |");
  for (int v = 0; v < NVARIANTS; ++v) printf(" %s |", NAMES[v]);
  for (int v = 1; v < NVARIANTS; ++v) printf(" %s - none |", NAMES[v]);
  printf("\n|---|---|");
  for (int v = 1; v < 2 * NVARIANTS; ++v) printf("---|");
  printf("\n");
  for (int a = 3; a < argc; ++a) {
    for (long long ns : {2000LL, 5000LL}) {
      const Shape sh{rows, M, atoi(argv[a]), ns};
      float t[NVARIANTS];
      for (int v = 0; v < NVARIANTS; ++v) {
        t[v] = NAN;
        if (!runs((Variant)v, sh)) continue;
        t[v] = time_variant((Variant)v, b, sh, st);
        if (v == NONE) continue;
        CK(cudaMemcpy(v == PDL ? ref.data() : got.data(), b.out, ref.size() * sizeof(float), cudaMemcpyDeviceToHost));
        if (v == PDL) continue;
        double err = 0;  // the merged output against the combine's
        for (size_t i = 0; i < ref.size(); ++i) err = fmax(err, fabs(ref[i] - got[i]));
        if (!(err <= 1e-4)) printf("%s at %d splits: max |out - pdl's| = %.2e\n", NAMES[v], sh.splits, err);
      }
      printf("| %d | %.0f |", sh.splits, ns / 1000.0);
      for (int v = 0; v < NVARIANTS; ++v) std::isnan(t[v]) ? printf(" - |") : printf(" %.2f |", t[v]);
      for (int v = 1; v < NVARIANTS; ++v) std::isnan(t[v]) ? printf(" - |") : printf(" %+.2f |", t[v] - t[NONE]);
      printf("\n");
    }
  }
  return 0;
}
