// Session 52 probe (issue 19): what merging a batch-1 read's split partials costs, apart from the attention itself.
// Sessions 51-52 measured the KIVI combine's own cost at 2.4-2.9 us per read, and found it unchanged whether the
// merge ran in a PDL-launched kernel (kivi_v3_combine), in the last CTA of each row (behind an arrival counter), or
// in one pass instead of two (docs/results.md, "Session 52").  This program times the merge alone, on stub split
// kernels that spin for a fixed time and write a partial of the KIVI kernel's shape (4 query rows x 128 channels per
// CTA, grid splits x rows), so the variants differ only in how the partials meet:
//   none     - the split kernel alone, its partial written to global memory and not merged (the floor);
//   pdl      - then kivi_v3_combine itself (included from kernels/kivi/cuda_kernel.cu), launched with PDL, as today;
//   cluster  - the splits of a row in one thread-block cluster (sm_90): each CTA keeps its partial in shared memory,
//              cluster barrier, every CTA merges its share of the row's channels from all peers' shared memory
//              (distributed shared memory), cluster barrier - no global round trip, no second kernel;
//   cluster+pdl - clusters of at most 16 CTAs, each merging into one global partial, then kivi_v3_combine over the
//              splits / 16 cluster partials (a row with more splits than a cluster holds).
// Every variant's merged output is checked against the pdl variant's.  Times: a CUDA graph of 20 reads back to back,
// replayed 50 times (CUDA events), per read.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o merge_floor benchmarks/gpu_merge_floor.cu
//   ./merge_floor            (prints a Markdown table)
#include <cooperative_groups.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../kernels/kivi/cuda_kernel.cu"

namespace cg = cooperative_groups;

namespace probe {

constexpr int M = 4, DV = 128, NT = 128;  // rows per CTA (a GQA group of 4), channels, threads per CTA

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

// grid (splits, rows): partial [splits, rows * M, DV] / [splits, rows * M] in global memory.
__global__ void __launch_bounds__(NT) split_global(float* po, float* pl, long long ns) {
  kivi_v3::pdl_trigger();
  spin(ns);
  const int s = blockIdx.x, r = blockIdx.y, R = gridDim.y * M;
  for (int i = threadIdx.x; i < M * DV; i += NT) {
    const int m = i / DV, c = i % DV;
    po[((long long)s * R + r * M + m) * DV + c] = part_value(s, r, m, c);
  }
  if (threadIdx.x < M) pl[(long long)s * R + r * M + threadIdx.x] = part_lse(s, r, threadIdx.x);
}

// grid (splits, rows), clusters of C along x (C = splits, or a divisor of it with cluster partials in po / pl: the
// cluster's rank-0 index blockIdx.x / C is its partial's split).  Each CTA merges DV / C channels of the M rows from
// the C peers' shared memory.
__global__ void __launch_bounds__(NT) split_cluster(float* out, float* lse, float* po, float* pl, long long ns,
                                                   int to_partials) {
  __shared__ float sp[M][DV];
  __shared__ float sl[M];
  __shared__ float stop[M], sden[M];
  cg::cluster_group cl = cg::this_cluster();
  const int C = (int)cl.num_blocks(), rank = (int)cl.block_rank();
  const int s = blockIdx.x, r = blockIdx.y, R = gridDim.y * M;
  kivi_v3::pdl_trigger();
  spin(ns);
  for (int i = threadIdx.x; i < M * DV; i += NT) sp[i / DV][i % DV] = part_value(s, r, i / DV, i % DV);
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
  const int share = M * DV / C;  // this CTA's elements of the row block
  for (int i = rank * share + threadIdx.x; i < (rank + 1) * share; i += NT) {
    const int m = i / DV, c = i % DV;
    float acc = 0.f;
    for (int p = 0; p < C; ++p) {
      const float w = __expf(cl.map_shared_rank(&sl[0], p)[m] - stop[m]);
      acc += w * cl.map_shared_rank(&sp[0][0], p)[m * DV + c];
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

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

struct Bufs {
  float *po, *pl, *out, *lse;
};

static void combine_pdl(const Bufs& b, int nsplit, long long R, cudaStream_t st) {
  CK(launch_combine<float>(b.po, b.pl, b.out, b.lse, nsplit, R, st, 1));
}

static void launch_cluster(const Bufs& b, int splits, int rows, int csize, long long ns, int to_partials,
                           cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(splits, rows);
  cfg.blockDim = dim3(probe::NT);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = csize;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, probe::split_cluster, b.out, b.lse, b.po, b.pl, ns, to_partials));
}

// one read of a variant: 0 none, 1 pdl, 2 cluster, 3 cluster+pdl
static void read_once(int variant, const Bufs& b, int splits, int rows, long long ns, cudaStream_t st) {
  const long long R = (long long)rows * probe::M;
  if (variant <= 1) {
    probe::split_global<<<dim3(splits, rows), probe::NT, 0, st>>>(b.po, b.pl, ns);
    CK(cudaGetLastError());
    if (variant == 1) combine_pdl(b, splits, R, st);
  } else if (variant == 2) {
    launch_cluster(b, splits, rows, splits, ns, 0, st);
  } else {
    const int c = splits < 16 ? splits : 16;
    launch_cluster(b, splits, rows, c, ns, 1, st);
    combine_pdl(b, splits / c, R, st);
  }
}

static float time_variant(int variant, const Bufs& b, int splits, int rows, long long ns, cudaStream_t st) {
  constexpr int PER_GRAPH = 20, REPLAYS = 50;
  read_once(variant, b, splits, rows, ns, st);  // warm-up (and a launch error surfaces here)
  CK(cudaStreamSynchronize(st));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < PER_GRAPH; ++i) read_once(variant, b, splits, rows, ns, st);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0, st));
  for (int i = 0; i < REPLAYS; ++i) CK(cudaGraphLaunch(ge, st));
  CK(cudaEventRecord(e1, st));
  CK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms * 1000.f / (PER_GRAPH * REPLAYS);
}

int main() {
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaFuncSetAttribute(probe::split_cluster, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int rows = 8;  // Llama-3-8B batch 1: 8 KV heads, each a row of 4 query heads
  const long long R = (long long)rows * probe::M;
  Bufs b;
  CK(cudaMalloc(&b.po, 64 * R * probe::DV * sizeof(float)));
  CK(cudaMalloc(&b.pl, 64 * R * sizeof(float)));
  CK(cudaMalloc(&b.out, R * probe::DV * sizeof(float)));
  CK(cudaMalloc(&b.lse, R * sizeof(float)));
  std::vector<float> ref(R * probe::DV), got(R * probe::DV);
  const char* names[4] = {"none", "pdl", "cluster", "cluster+pdl"};
  printf("%s, %d SMs; rows %d (x %d query rows x %d channels); a CUDA graph of 20 reads, 50 replays\n\n", prop.name,
         prop.multiProcessorCount, rows, probe::M, probe::DV);
  printf("| splits | spin (us) | none (us) | pdl (us) | cluster (us) | cluster+pdl (us) | pdl - none | cluster - none |"
         " cluster+pdl - none |\n|---|---|---|---|---|---|---|---|---|\n");
  for (int splits : {8, 16, 32, 64}) {
    for (long long ns : {2000LL, 5000LL}) {
      float t[4] = {NAN, NAN, NAN, NAN};
      for (int v = 0; v < 4; ++v) {
        if (v == 2 && splits > 16) continue;  // a cluster holds at most 16 CTAs (non-portable size)
        if (v == 3 && splits <= 16) continue;
        int nclusters = 0;
        if (v >= 2) {  // can the device co-schedule a cluster of this size?
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(splits, rows);
          cfg.blockDim = dim3(probe::NT);
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeClusterDimension;
          attr[0].val.clusterDim.x = splits < 16 ? splits : 16;
          attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
          cfg.attrs = attr;
          cfg.numAttrs = 1;
          if (cudaOccupancyMaxActiveClusters(&nclusters, probe::split_cluster, &cfg) != cudaSuccess ||
              nclusters == 0) {
            cudaGetLastError();
            continue;
          }
        }
        t[v] = time_variant(v, b, splits, rows, ns, st);
        if (v >= 1) {  // the merged output against the pdl variant's
          CK(cudaMemcpy(v == 1 ? ref.data() : got.data(), b.out, ref.size() * sizeof(float), cudaMemcpyDeviceToHost));
          if (v >= 2) {
            double err = 0;
            for (size_t i = 0; i < ref.size(); ++i) err = fmax(err, fabs(ref[i] - got[i]));
            if (err > 1e-4) printf("%s at %d splits: max |out - pdl's| = %.2e\n", names[v], splits, err);
          }
        }
      }
      auto cell = [](float x) {
        static char buf[4][32];
        static int k = 0;
        k = (k + 1) % 4;
        if (std::isnan(x)) snprintf(buf[k], 32, "-");
        else snprintf(buf[k], 32, "%.2f", x);
        return buf[k];
      };
      printf("| %d | %.0f | %s | %s | %s | %s |", splits, ns / 1000.0, cell(t[0]), cell(t[1]), cell(t[2]), cell(t[3]));
      printf(" %s | %s | %s |\n", cell(t[1] - t[0]), cell(t[2] - t[0]), cell(t[3] - t[0]));
    }
  }
  return 0;
}
