// DoubleSparse label scores + exact top-k as a two-kernel CUDA radix select (radix_cuda.py documents the design;
// radix_cuda.emulate is a PyTorch model of the same steps that the CPU tests check).  No torch headers: the Python
// side passes raw pointers, strides and sizes in an int64 array and the current stream.
//
// 1. ds_keys_kernel - grid (token chunks, B * Hkv * blocks of GN query heads): each thread scores TPT consecutive
//    tokens of its chunk for the GN (<= GMAX) query heads of one kv head from one (vector) read of each label row,
//    writes the order-preserving uint32 keys [B * Hq, KS] and counts their top BITS0 bits in a shared-memory
//    histogram per head (shared-memory atomics), added to the global histogram [B * Hq, 2^BITS0].
// 2. ds_select_kernel - one CTA per query head: from the histogram, the digit holding the k-th largest key; then up
//    to two more passes over the head's keys histogram the next BITS digit of the keys still tied with the prefix
//    (shared-memory atomics), until the prefix holds exactly the keys still needed (or all 32 bits are fixed); a
//    last pass writes the chosen token indices in token order (block-wide scans): every key above the prefix, and
//    the lowest-token ties at it.
// 3. ds_cluster_kernel - instead of 1 + 2 where few heads meet a long context: one thread-block cluster per query head
//    (see its comment).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <cooperative_groups.h>

#define DS_EXPORT __attribute__((visibility("default")))

namespace ds_radix {

constexpr int BITS0 = 10;             // the keys kernel's digit (bits 31..22)
constexpr int BITS = 11;              // the select kernel's digits (bits 21..11, 10..0)
constexpr int BINS0 = 1 << BITS0;
constexpr int BINS = 1 << BITS;
constexpr int GMAX = 8;               // query heads scored per keys CTA
constexpr int RMAX = 256;             // label channels
constexpr int KEYS_THREADS = 256;      // the most threads of a keys CTA (the launch picks 128 or 256)
constexpr int SELECT_THREADS = 1024;   // the most threads of a select CTA (the launch picks 256, 512 or 1024)
constexpr int EMIT = 4;               // consecutive tokens per thread in the emit pass

enum DType { F16 = 0, BF16 = 1, F32 = 2, U8 = 3 };

template <int DT> __device__ __forceinline__ float load_f(const void* p, long long i) {
  if constexpr (DT == F16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  else if constexpr (DT == BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  else return reinterpret_cast<const float*>(p)[i];
}

// fp32 -> uint32 with the same order (-inf lowest; NaN is not expected); as triton_kernel._orderable
__device__ __forceinline__ uint32_t orderable(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct KeysParams {
  const void* q; long long sq_b, sq_h;
  const long long* ch; long long sch_h;
  const void* lab; long long sl_b, sl_h, sl_c;
  const __half* sc; const __half* ze; long long sz_b, sz_h;
  const uint8_t* va; long long sva_b;
  uint32_t* keys; int* hist;
  long long T, HQ, HKV, G, W, per, bits, chunk, gblocks, KS;
  long long qg, sq_g;  // query rows summed per select row (1: none), sq_g apart; a row's first one at hq * sq_h
  int qt, has_valid;
};

// Query channel c of select row hq: the sum of its qg query rows (fp32, added in row order; reference.group_query sums
// in fp32 too).  The rows' loads are issued QG_LOADS at a time, in one basic block per dtype, before any is converted
// or added: one round trip for up to 8 rows, not one per row (session 47's phases: the group-shared query load took
// 1.66 - 1.80 us against 1.25 for one row; a runtime-dtype load each sat in a branch with its conversion,
// which waited for it).  The adds are the same, in the same order.
constexpr int QG_LOADS = 8;

template <int DT>
__device__ __forceinline__ float query_sum(const void* q, long long base, long long qg, long long sq_g) {
  float v = load_f<DT>(q, base);
  for (long long j0 = 1; j0 < qg; j0 += QG_LOADS) {
    float t[QG_LOADS];
#pragma unroll
    for (int u = 0; u < QG_LOADS; ++u) t[u] = j0 + u < qg ? load_f<DT>(q, base + (j0 + u) * sq_g) : 0.f;
#pragma unroll
    for (int u = 0; u < QG_LOADS; ++u)
      if (j0 + u < qg) v += t[u];
  }
  return v;
}

__device__ __forceinline__ float query_value(const KeysParams& p, long long b, long long hq, long long c) {
  const long long base = b * p.sq_b + hq * p.sq_h + c;
  switch (p.qt) {
    case F16: return query_sum<F16>(p.q, base, p.qg, p.sq_g);
    case BF16: return query_sum<BF16>(p.q, base, p.qg, p.sq_g);
    default: return query_sum<F32>(p.q, base, p.qg, p.sq_g);
  }
}

constexpr int TPT = 8;  // consecutive tokens per thread in the keys kernel (one 16-byte load of fp16 labels)


// The labels of tokens [t, t + TPT) of one channel (or code byte) row as loaded, before any conversion: 8 fp16 /
// bf16 values in 4 words, 8 fp32 values in 8 words, or 8 code bytes in 2 words.  A thread holds WU of these at once
// (WU rows in flight): raw words, not converted floats, so 4 rows fit the 64 registers of a 1024-thread CTA.
template <int LT> struct RawRow {
  static constexpr int N = LT == F32 ? 8 : (LT == U8 ? 2 : 4);
  uint32_t w[N];
};

// VEC: one aligned vector load (the caller checked alignment and that all TPT tokens are below t1), else scalar
// loads; tokens at or past t1 read 0.
template <int LT, bool VEC>
__device__ __forceinline__ void load_row(const void* base, long long off, long long t, long long t1, RawRow<LT>& r) {
  if constexpr (VEC) {
    if constexpr (LT == F16 || LT == BF16) {
      const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(base) + off + t);
      r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
    } else if constexpr (LT == F32) {
      const uint4* f = reinterpret_cast<const uint4*>(reinterpret_cast<const float*>(base) + off + t);
      const uint4 a = f[0], b = f[1];
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w; r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(base) + off + t);
      r.w[0] = v.x; r.w[1] = v.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < RawRow<LT>::N; ++j) r.w[j] = 0u;
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      if (t + i < t1) {
        if constexpr (LT == F32) {
          r.w[i] = reinterpret_cast<const uint32_t*>(base)[off + t + i];
        } else if constexpr (LT == U8) {
          r.w[i / 4] |= (uint32_t)reinterpret_cast<const uint8_t*>(base)[off + t + i] << (8 * (i % 4));
        } else {
          r.w[i / 2] |= (uint32_t)reinterpret_cast<const uint16_t*>(base)[off + t + i] << (16 * (i % 2));
        }
      }
    }
  }
}

// A loaded row as floats (codes: their byte values).
template <int LT>
__device__ __forceinline__ void unpack_row(const RawRow<LT>& r, float* x) {
  if constexpr (LT == F16 || LT == BF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (LT == F16) {
        const __half2 h = *reinterpret_cast<const __half2*>(&r.w[i]);
        x[2 * i] = __low2float(h); x[2 * i + 1] = __high2float(h);
      } else {
        const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&r.w[i]);
        x[2 * i] = __low2float(h); x[2 * i + 1] = __high2float(h);
      }
    }
  } else if constexpr (LT == F32) {
#pragma unroll
    for (int i = 0; i < TPT; ++i) x[i] = __uint_as_float(r.w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = (float)((r.w[0] >> (8 * i)) & 0xFF);
      x[4 + i] = (float)((r.w[1] >> (8 * i)) & 0xFF);
    }
  }
}

// Label scores of tokens [tb, tb + TPT) (those below t1) for GN query heads, from the query values qv[g][c] of their
// label channels (codes added word w, then field j): acc[g][i].  WU label rows are loaded (RawRow) before any of
// them is used.
template <int LT, bool VEC, int WU, int GN>
__device__ __forceinline__ void score_tokens(const KeysParams& p, const float (*qv)[RMAX], long long lbase,
                                             long long tb, long long t1, float (&acc)[GN][TPT]) {
  constexpr bool QUANT = LT == U8;
  const unsigned mask_bits = (1u << p.bits) - 1u;
#pragma unroll
  for (int g = 0; g < GN; ++g)
#pragma unroll
    for (int i = 0; i < TPT; ++i) acc[g][i] = 0.f;
  for (int w0 = 0; w0 < p.W; w0 += WU) {
    RawRow<LT> raw[WU];
    if (VEC && tb + TPT <= t1) {  // the common case, one branch for all WU rows: their vector loads in a row
#pragma unroll
      for (int u = 0; u < WU; ++u)
        if (w0 + u < p.W) load_row<LT, VEC>(p.lab, lbase + (w0 + u) * p.sl_c, tb, t1, raw[u]);
    } else {
#pragma unroll
      for (int u = 0; u < WU; ++u) {
#pragma unroll
        for (int j = 0; j < RawRow<LT>::N; ++j) raw[u].w[j] = 0u;
        if (w0 + u < p.W) load_row<LT, false>(p.lab, lbase + (w0 + u) * p.sl_c, tb, t1, raw[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < WU; ++u) {
      const int w = w0 + u;
      if (w >= p.W) break;
      float x[TPT];
      unpack_row<LT>(raw[u], x);
      if constexpr (QUANT) {
        for (int j = 0; j < p.per; ++j) {
#pragma unroll
          for (int g = 0; g < GN; ++g) {
            const float qj = qv[g][j * p.W + w];
#pragma unroll
            for (int i = 0; i < TPT; ++i)
              acc[g][i] = fmaf(qj, (float)(((unsigned)x[i] >> (p.bits * j)) & mask_bits), acc[g][i]);
          }
        }
      } else {
#pragma unroll
        for (int g = 0; g < GN; ++g) {
          const float qw = qv[g][w];
#pragma unroll
          for (int i = 0; i < TPT; ++i) acc[g][i] = fmaf(qw, x[i], acc[g][i]);
        }
      }
    }
  }
}

// One CTA: tokens [blockIdx.x * chunk, + chunk) of query heads [gb * GN, + GN) of kv head h, batch row b (GN: the
// heads per CTA, a power of two <= GMAX; gblocks = ceil(G / GN)).  Each thread scores TPT consecutive tokens per
// step for the GN heads from one read of each label row.
// WU: label rows (channels or code bytes) a thread loads before using them (1 or 4).
template <int LT, int GN, bool VEC, int WU>
__global__ void __launch_bounds__(KEYS_THREADS, 1) ds_keys_kernel(KeysParams p) {
  constexpr bool QUANT = LT == U8;
  __shared__ int hist[GN][BINS0];
  __shared__ float qv[GN][RMAX];
  __shared__ float qsum[GN];
  const long long y = blockIdx.y;
  const long long gb = y % p.gblocks;
  const long long h = (y / p.gblocks) % p.HKV;
  const long long b = y / (p.gblocks * p.HKV);
  const int g0 = (int)(gb * GN);
  const int ng = (int)min((long long)GN, p.G - g0);
  const int r = (int)(p.W * p.per);
  for (int i = threadIdx.x; i < GN * BINS0; i += blockDim.x) (&hist[0][0])[i] = 0;
  for (int i = threadIdx.x; i < GN * RMAX; i += blockDim.x) {
    const int g = i / RMAX, c = i % RMAX;
    float v = 0.f;
    if (g < ng && c < r) {
      v = query_value(p, b, h * p.G + g0 + g, p.ch[h * p.sch_h + c]);
    }
    qv[g][c] = v;
  }
  __syncthreads();
  if (QUANT && threadIdx.x < GN) {  // in the order the scores add the codes: word w, then field j
    float s = 0.f;
    for (int w = 0; w < p.W; ++w)
      for (int j = 0; j < p.per; ++j) s += qv[threadIdx.x][j * p.W + w];
    qsum[threadIdx.x] = s;
  }
  __syncthreads();
  const long long t0 = (long long)blockIdx.x * p.chunk;
  const long long t1 = min(t0 + p.chunk, p.T);
  const long long lbase = b * p.sl_b + h * p.sl_h;
  for (long long tb = t0 + (long long)threadIdx.x * TPT; tb < t1; tb += (long long)blockDim.x * TPT) {
    float acc[GN][TPT];
    score_tokens<LT, VEC, WU, GN>(p, qv, lbase, tb, t1, acc);
    bool ok[TPT];
    float s[TPT], z[TPT];
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      const long long t = tb + i;
      const bool in = t < t1;
      ok[i] = in && (!p.has_valid || p.va[b * p.sva_b + t] != 0);
      s[i] = 1.f; z[i] = 0.f;
      if (QUANT && in) {
        const float sv = __half2float(p.sc[b * p.sz_b + h * p.sz_h + t]);
        s[i] = sv == 0.f ? 1.f : sv;
        z[i] = __half2float(p.ze[b * p.sz_b + h * p.sz_h + t]);
      }
    }
#pragma unroll
    for (int g = 0; g < GN; ++g) {
      if (g < ng) {
        const long long row = b * p.HQ + h * p.G + g0 + g;
        uint32_t key[TPT];
#pragma unroll
        for (int i = 0; i < TPT; ++i) {
          float v = QUANT ? fmaf(acc[g][i], s[i], qsum[g] * z[i]) : acc[g][i];
          if (!ok[i]) v = -INFINITY;
          key[i] = orderable(v);
          if (tb + i < t1) atomicAdd(&hist[g][key[i] >> (32 - BITS0)], 1);
        }
        uint32_t* kp = p.keys + row * p.KS + tb;  // KS: a multiple of TPT, 16-byte aligned rows
        reinterpret_cast<uint4*>(kp)[0] = make_uint4(key[0], key[1], key[2], key[3]);
        reinterpret_cast<uint4*>(kp)[1] = make_uint4(key[4], key[5], key[6], key[7]);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < ng * BINS0; i += blockDim.x) {
    const int g = i / BINS0, bin = i % BINS0;
    const int c = hist[g][bin];
    if (c) atomicAdd(&p.hist[(b * p.HQ + h * p.G + g0 + g) * BINS0 + bin], c);
  }
}

struct SelectParams {
  const uint32_t* keys; const int* hist; long long* out;
  long long T, K, KS;
  int emit_vecs;  // 16-byte key reads per thread per emit tile (emit_chosen)
};

// Warp-wide inclusive scan of (a, b) pairs, in lane order.  All 32 lanes of the warp call it.
__device__ __forceinline__ int2 warp_inclusive_scan2(int2 v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int xa = __shfl_up_sync(0xffffffffu, v.x, o), xb = __shfl_up_sync(0xffffffffu, v.y, o);
    if (lane >= o) { v.x += xa; v.y += xb; }
  }
  return v;
}

// Block-wide exclusive scan of (a, b) pairs; writes the totals to *total (shared).  All threads of the block call it.
__device__ __forceinline__ int2 block_exclusive_scan2(int2 v, int2* total) {
  __shared__ int2 warp_tot[SELECT_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int2 inc = warp_inclusive_scan2(v);
  if (lane == 31) warp_tot[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int2 w = lane < nwarps ? warp_tot[lane] : make_int2(0, 0);
    const int2 wi = warp_inclusive_scan2(w);
    if (lane < nwarps) warp_tot[lane] = make_int2(wi.x - w.x, wi.y - w.y);  // exclusive per warp
    if (lane == 31) *total = wi;
  }
  __syncthreads();
  const int2 base = warp_tot[warp];
  const int2 res = make_int2(base.x + inc.x - v.x, base.y + inc.y - v.y);
  __syncthreads();  // warp_tot is reused by the next call
  return res;
}

// The digit of h[0..nb) (counts per digit value) holding the need-th largest key, counting from the top: writes
// (digit, count of keys in higher digits) to st[0..1].  Every thread of the block calls it.
__device__ __forceinline__ void find_digit(const int* h, int nb, int need, int* st) {
  const int per = nb / blockDim.x > 0 ? nb / blockDim.x : 1;
  const int j0 = threadIdx.x * per;  // this thread's digits in descending order: nb-1-j0 .. nb-1-(j0+per-1)
  int local = 0;
  if (j0 < nb)
    for (int j = j0; j < j0 + per; ++j) local += h[nb - 1 - j];
  __shared__ int2 tot;
  const int2 ex = block_exclusive_scan2(make_int2(local, 0), &tot);
  if (j0 < nb) {
    int before = ex.x;
    for (int j = j0; j < j0 + per; ++j) {
      const int c = h[nb - 1 - j];
      if (before < need && before + c >= need) { st[0] = nb - 1 - j; st[1] = before; }
      before += c;
    }
  }
  __syncthreads();
}

// emit_chosen with one 16-byte read (EMIT keys) per thread per tile (vecs = 1: emit_auto's choice where a tile of
// EMIT keys per thread covers the CTA's keys): the pass as it was before emit_vectors, kept as its own code.
template <bool LDG>
__device__ __forceinline__ void emit_chosen4(const uint32_t* keys, long long n, long long t0, uint32_t prefix, int shift,
                                            int need, int base_above, int base_tie, long long* out, int2* tile_tot) {
  for (long long l0 = 0; l0 < n; l0 += (long long)EMIT * blockDim.x) {
    const long long lb = l0 + (long long)threadIdx.x * EMIT;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (lb < n) v = LDG ? __ldg(reinterpret_cast<const uint4*>(keys) + lb / 4) : reinterpret_cast<const uint4*>(keys)[lb / 4];
    const uint32_t kv[EMIT] = {v.x, v.y, v.z, v.w};
    uint32_t hi[EMIT];
    int a = 0, e = 0;
#pragma unroll
    for (int u = 0; u < EMIT; ++u) {
      const bool valid = lb + u < n;
      hi[u] = kv[u] >> shift;  // shift < 32: the first digit fixes BITS0 bits
      a += valid && hi[u] > prefix;
      e += valid && hi[u] == prefix;
    }
    const int2 ex = block_exclusive_scan2(make_int2(a, e), tile_tot);
    const int2 tot = *tile_tot;
    int ab = base_above + ex.x, tie = base_tie + ex.y;
#pragma unroll
    for (int u = 0; u < EMIT; ++u) {
      if (lb + u >= n) continue;
      const long long t = t0 + lb + u;
      if (hi[u] > prefix) {
        out[ab + min(tie, need)] = t;
        ++ab;
      } else if (hi[u] == prefix) {
        if (tie < need) out[ab + tie] = t;
        ++tie;
      }
    }
    base_above += tot.x;
    base_tie += tot.y;
    __syncthreads();  // tile_tot is rewritten by the next tile's scan
  }
}

// The emit pass over keys[0..n) (tokens t0 + i): chosen = key above the prefix (its top 32 - shift bits), or at it
// among the first `need` such tokens; slot = rank in token order, after base_above / base_tie keys above / at the
// prefix that come before these tokens.  Per tile each thread takes `vecs` (1 - EMIT_VECS) consecutive 16-byte reads
// of EMIT keys (keys 16-byte aligned, n padded to a multiple of 4 in memory): one block scan per tile, so more keys
// per thread take fewer scans (and fewer block barriers) over a long row.  LDG: read through the read-only cache
// (global keys).  Every thread of the block calls it.
constexpr int EMIT_VECS = 4;

template <bool LDG>
__device__ __forceinline__ void emit_chosen(const uint32_t* keys, long long n, long long t0, uint32_t prefix, int shift,
                                            int need, int base_above, int base_tie, long long* out, int2* tile_tot,
                                            int vecs) {
  if (vecs == 1) {
    emit_chosen4<LDG>(keys, n, t0, prefix, shift, need, base_above, base_tie, out, tile_tot);
    return;
  }
  const long long per = (long long)EMIT * vecs;  // keys per thread per tile
  for (long long l0 = 0; l0 < n; l0 += per * blockDim.x) {
    const long long lb = l0 + (long long)threadIdx.x * per;
    uint32_t above = 0, at = 0;  // bit w * EMIT + u: that key is above / at the prefix (two registers, not 16 keys)
#pragma unroll
    for (int w = 0; w < EMIT_VECS; ++w) {
      const long long lw = lb + (long long)w * EMIT;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (w < vecs && lw < n)
        v = LDG ? __ldg(reinterpret_cast<const uint4*>(keys) + lw / 4) : reinterpret_cast<const uint4*>(keys)[lw / 4];
      const uint32_t kv[EMIT] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int u = 0; u < EMIT; ++u) {
        const bool valid = w < vecs && lw + u < n;
        const uint32_t h = kv[u] >> shift;  // shift < 32: the first digit fixes BITS0 bits
        above |= (uint32_t)(valid && h > prefix) << (w * EMIT + u);
        at |= (uint32_t)(valid && h == prefix) << (w * EMIT + u);
      }
    }
    const int2 ex = block_exclusive_scan2(make_int2(__popc(above), __popc(at)), tile_tot);
    const int2 tot = *tile_tot;
    int ab = base_above + ex.x, tie = base_tie + ex.y;
    const int keys_here = (int)min(per, max(0LL, n - lb));
#pragma unroll 4
    for (int j = 0; j < keys_here; ++j) {
      const long long t = t0 + lb + j;
      if ((above >> j) & 1u) {
        out[ab + min(tie, need)] = t;
        ++ab;
      } else if ((at >> j) & 1u) {
        if (tie < need) out[ab + tie] = t;
        ++tie;
      }
    }
    base_above += tot.x;
    base_tie += tot.y;
    __syncthreads();  // tile_tot is rewritten by the next tile's scan
  }
}

// SMEM: the head's keys are copied to dynamic shared memory once (KS * 4 bytes) and every pass reads them there;
// otherwise each pass reads them from global memory (L2).
template <bool SMEM>
__global__ void __launch_bounds__(SELECT_THREADS, 1) ds_select_kernel(SelectParams p) {
  extern __shared__ uint4 dyn[];
  __shared__ int hist[BINS];
  __shared__ int st[2];
  __shared__ int2 tile_tot;
  const long long row = blockIdx.x;
  const uint32_t* gk = p.keys + row * p.KS;
  uint32_t* sk = reinterpret_cast<uint32_t*>(dyn);
  const uint32_t* keys = SMEM ? sk : gk;
  long long* out = p.out + row * p.K;
  if (SMEM)
    for (long long i = threadIdx.x; i < p.KS / 4; i += blockDim.x)
      dyn[i] = __ldg(reinterpret_cast<const uint4*>(gk) + i);
  for (int i = threadIdx.x; i < BINS0; i += blockDim.x) hist[i] = p.hist[row * BINS0 + i];
  __syncthreads();
  int need = (int)p.K;
  find_digit(hist, BINS0, need, st);
  uint32_t prefix = (uint32_t)st[0];
  need -= st[1];
  int shift = 32 - BITS0;  // bits below the prefix
  int in_bin = hist[st[0]];
  __syncthreads();
  while (in_bin != need && shift > 0) {  // the prefix's keys are not all taken: the next digit
    const int nb = shift >= BITS ? BITS : shift;
    const int low = shift - nb;
    for (int i = threadIdx.x; i < BINS; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (long long t0 = 0; t0 < p.T; t0 += 4LL * blockDim.x) {
      uint32_t k4[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const long long t = t0 + u * blockDim.x + threadIdx.x;
        k4[u] = t < p.T ? (SMEM ? keys[t] : __ldg(keys + t)) : 0u;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const long long t = t0 + u * blockDim.x + threadIdx.x;
        if (t < p.T && (k4[u] >> shift) == prefix) atomicAdd(&hist[(k4[u] >> low) & ((1u << nb) - 1u)], 1);
      }
    }
    __syncthreads();
    find_digit(hist, 1 << nb, need, st);
    prefix = (prefix << nb) | (uint32_t)st[0];
    need -= st[1];
    shift = low;
    in_bin = hist[st[0]];
    __syncthreads();
  }
  emit_chosen<!SMEM>(keys, p.T, 0, prefix, shift, need, 0, 0, out, &tile_tot, p.emit_vecs);
}

// Phase clocks of the cluster select, only in a build with -DDS_PHASES (benchmarks/gpu_cluster_phases.py; the
// default build has none of this): thread 0 of each CTA writes, per CTA (row * gridDim.x + blockIdx.x), slot 0 the
// global timer at entry, slot 1 its SM, slot 2 the digit passes after the first, then slots 3.. clock64() at: entry,
// query loaded, keys scored, first digit found, last digit found, ties of the CTAs before it read, indices written,
// and slot 10 the global timer at the end; slots 11 and 12 clock64() within the first digit's cluster_find: after
// its barrier, then after the warp's remote reads and finds.
#ifdef DS_PHASES
constexpr int PH_SLOTS = 16;
constexpr long long PH_CTAS = 8192;
__device__ long long ds_phase_buf[PH_CTAS * PH_SLOTS];
__device__ __forceinline__ void phase_put(int slot, long long v) {
  const long long i = (long long)blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0 && i < PH_CTAS) ds_phase_buf[i * PH_SLOTS + slot] = v;
}
__device__ __forceinline__ long long phase_timer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ long long phase_smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return (long long)s;
}
#define DS_PHASE(slot) phase_put((slot), clock64())
#else
#define DS_PHASE(slot) do {} while (0)
#endif

// ---------------------------------------------------------------------------------------------- cluster select
// One thread-block cluster of C CTAs per query head (sm_90): CTA r scores tokens [r * n, (r + 1) * n) into its own
// shared memory (no keys scratch, no global histogram), and the CTAs run the select together - each digit's
// histogram is the sum of the C CTAs' shared-memory histograms (read through distributed shared memory), and each
// CTA writes its tokens' indices after the counts of the CTAs before it (summed from the same histograms as they are
// read: no round of their own).  One launch; at batch 1 every head's work
// spreads over C SMs.  p.chunk = n (a multiple of TPT).

constexpr int CMAX = 8;  // the most CTAs of a cluster (ds_radix_cluster_launch)

// The cluster barrier of an exchange: after it, every CTA's shared-memory writes before it (its histogram and group
// sums, or its pick list) are visible to the other CTAs' distributed-shared-memory reads.  A release fence restricted
// to this CTA's own shared memory at cluster scope (PTX ISA 8.6 fence.release.sync_restrict::shared::cta.cluster:
// MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S on sm_90a), then a relaxed arrive and an acquire wait - the writes to order are
// all to shared::cta; the remote reads of the round before are complete by then (each one's value was consumed before
// the barrier), so a CTA that reuses a buffer after the barrier overwrites nothing still being read.  cluster.sync()
// (a release arrive) puts a MEMBAR.ALL.GPU before each arrive instead (about 0.55 us: session 48's phases).  Session
// 49 (H100, PART=ds-fence, two rounds): this fence against cluster.sync() took 2 - 8 % less time at every one of
// the 24 cluster reads (each read's two rounds; geometric mean 0.95); compute-sanitizer racecheck found no hazard.
__device__ __forceinline__ void cluster_exchange() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.release.sync_restrict::shared::cta.cluster;" ::: "memory");
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The digit of the need-th largest key of the cluster's histogram (the sum over ranks of hist; nb 1024 or 2048).
// Leaves st = (digit, keys in higher digits, keys in higher digits in the CTAs before this one), comb[st[0]] (the
// cluster's keys at the digit) and combb[st[0]] (those of the CTAs before this one).  One
// cluster barrier, on entry (every CTA's hist is complete): the caller alternates two hist buffers, so a CTA that
// fills the next digit's histogram never writes one another CTA may still read (that CTA has passed the barrier
// of the digit in between only after its reads), and arrives at a last barrier after its last digit before it
// leaves (ds_cluster_kernel).  The C remote loads of a bin are all issued before any is added (CMAX of them, those
// past C predicated off).  STAMP: phase clocks 11 and 12 (a -DDS_PHASES build).
//
// The digit comes in two small steps (session 48: 7 - 16 % faster than every CTA summing every bin of every CTA and
// scanning them with the whole block).  Each CTA first writes the sums of its hist's 32-bin groups (gsum, as
// double-buffered as hist); after the barrier one warp finds the group of the need-th key from the C CTAs' group
// sums, then its digit from the C CTAs' 32 bins of that group: two remote round trips of one warp and warp scans.
static_assert(BINS0 == 1024 && BINS == 2048, "the grouped find takes 32 or 64 groups of 32 bins (one or two a lane)");
template <bool STAMP = false>
__device__ __forceinline__ void cluster_find(int* hist, int* gsum, int* comb, int* combb, int nb, int need, int* st) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int g = warp; g < (nb >> 5); g += nwarps) {
      int v = hist[(g << 5) + lane];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) gsum[g] = v;
    }
  }
  cluster_exchange();  // every CTA's histogram is complete
  if (STAMP) DS_PHASE(11);
  const int c = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
  if (threadIdx.x < 32) {
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x, groups = nb >> 5, per = groups >> 5;  // per: 1 or 2 groups a lane
    int tg[2] = {0, 0}, tb[2] = {0, 0};  // the cluster's / the earlier CTAs' keys in the lane's groups
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u < per) {
        const int g = groups - 1 - (lane * per + u);  // descending
        int v[CMAX];
#pragma unroll
        for (int q = 0; q < CMAX; ++q) v[q] = q < c ? cluster.map_shared_rank(gsum, q)[g] : 0;
#pragma unroll
        for (int q = 0; q < CMAX; ++q) { tg[u] += v[q]; tb[u] += q < rank ? v[q] : 0; }
      }
    }
    const int2 own = make_int2(tg[0] + tg[1], tb[0] + tb[1]);
    const int2 inc = warp_inclusive_scan2(own);
    int2 before = make_int2(inc.x - own.x, inc.y - own.y), at = make_int2(0, 0);
    int found = -1;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u < per) {
        if (before.x < need && before.x + tg[u] >= need) { found = groups - 1 - (lane * per + u); at = before; }
        before.x += tg[u];
        before.y += tb[u];
      }
    }
    const int src = __ffs(__ballot_sync(full, found >= 0)) - 1;  // exactly one lane: the need-th key exists
    const int g = __shfl_sync(full, found, src);
    const int ax = __shfl_sync(full, at.x, src), ay = __shfl_sync(full, at.y, src);
    const int bin = (g << 5) + 31 - lane;  // the group's bins, descending
    int v[CMAX];
#pragma unroll
    for (int q = 0; q < CMAX; ++q) v[q] = q < c ? cluster.map_shared_rank(hist, q)[bin] : 0;
    int cnt = 0, cntb = 0;
#pragma unroll
    for (int q = 0; q < CMAX; ++q) { cnt += v[q]; cntb += q < rank ? v[q] : 0; }
    const int2 inc2 = warp_inclusive_scan2(make_int2(cnt, cntb));
    const int bx = ax + inc2.x - cnt, by = ay + inc2.y - cntb;
    if (bx < need && bx + cnt >= need) {
      st[0] = bin; st[1] = bx; st[2] = by;
      comb[bin] = cnt;
      combb[bin] = cntb;
    }
  }
  __syncthreads();  // st, comb[st[0]], combb[st[0]] for the block
  if (STAMP) DS_PHASE(12);
#endif
}

// The exact pick that replaces a digit's histogram round once at most PICK_CAP keys of the cluster share the prefix
// (in_bin of them, need still to take): each CTA lists its keys at the prefix (key, token) in `list` - a histogram
// buffer no other CTA can still read (the one before the current digit's) - then, after one cluster barrier, every
// CTA copies all the lists in rank order (token order) into `scratch` (its own comb) and finds the need-th of them
// by (key descending, token ascending): kstar.  Leaves the state of a digit that fixed all 32 bits: prefix = kstar,
// shift = 0, need = the ties at kstar still to take, above_before / tie_before = the keys above / at kstar in the
// CTAs before this one.  Every thread of the CTA calls it; ends with a block barrier.
constexpr int PICK_CAP = 128;

__device__ __forceinline__ void pick_exact(const uint32_t* sk, long long n, long long t0, int rank, int* list,
                                           int* scratch, int in_bin, uint32_t& prefix, int& shift, int& need,
                                           int& above_before, int& tie_before) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ int lcount, gbase[CMAX + 1], kst[1], cnt[3];
  int* lkey = list + 1;             // list[0]: this CTA's count
  int* ltok = list + 1 + PICK_CAP;
  int* gkey = scratch;
  int* gtok = scratch + PICK_CAP;
  if (threadIdx.x == 0) lcount = 0;
  if (threadIdx.x < 3) cnt[threadIdx.x] = 0;
  __syncthreads();
  for (long long t = threadIdx.x; t < n; t += blockDim.x) {
    const uint32_t k = sk[t];
    if ((k >> shift) == prefix) {  // at most in_bin <= PICK_CAP of them in the cluster
      const int j = atomicAdd(&lcount, 1);
      lkey[j] = (int)k;
      ltok[j] = (int)(t0 + t);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) list[0] = lcount;
  cluster_exchange();  // every CTA's list is complete
  const int c = (int)cluster.num_blocks();
  if (threadIdx.x == 0) {
    int b = 0;
    for (int q = 0; q < c; ++q) { gbase[q] = b; b += *cluster.map_shared_rank(list, q); }
    gbase[c] = b;  // == in_bin
  }
  __syncthreads();
  if (threadIdx.x < in_bin) {
    const int j = threadIdx.x;
    int q = 0;
    while (j >= gbase[q + 1]) ++q;
    const int* rl = cluster.map_shared_rank(list, q);
    gkey[j] = rl[1 + j - gbase[q]];
    gtok[j] = rl[1 + PICK_CAP + j - gbase[q]];
  }
  __syncthreads();
  if (threadIdx.x < in_bin) {  // the candidate of rank need - 1 is kstar
    const int j = threadIdx.x;
    const uint32_t kj = (uint32_t)gkey[j];
    const int tj = gtok[j];
    int r = 0;
    for (int i = 0; i < in_bin; ++i) {
      const uint32_t ki = (uint32_t)gkey[i];
      r += ki > kj || (ki == kj && gtok[i] < tj);
    }
    if (r == need - 1) kst[0] = (int)kj;
  }
  __syncthreads();
  const uint32_t kstar = (uint32_t)kst[0];
  if (threadIdx.x < in_bin) {
    const uint32_t kj = (uint32_t)gkey[threadIdx.x];
    const bool before = (int)threadIdx.x < gbase[rank];
    if (kj > kstar) {
      atomicAdd(&cnt[0], 1);
      if (before) atomicAdd(&cnt[1], 1);
    } else if (kj == kstar && before) {
      atomicAdd(&cnt[2], 1);
    }
  }
  __syncthreads();
  prefix = kstar;
  shift = 0;
  need -= cnt[0];
  above_before += cnt[1];
  tie_before = cnt[2];
  __syncthreads();
#endif
}

// WU: label rows a thread loads before using them (1 or 4), as in ds_keys_kernel (raw rows: 4 fit the 64 registers
// of a 1024-thread CTA, except 4 fp32 rows: that build takes at most 512 threads, launch_cluster_lt).
template <int LT, bool VEC, int WU>
__global__ void __launch_bounds__(WU == 4 && LT == F32 ? SELECT_THREADS / 2 : SELECT_THREADS, 1)
    ds_cluster_kernel(KeysParams p, SelectParams sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  constexpr bool QUANT = LT == U8;
  extern __shared__ uint4 dyn[];
  uint32_t* sk = reinterpret_cast<uint32_t*>(dyn);
  __shared__ int hists[2][BINS];  // digit d's histogram in hists[d % 2] (cluster_find)
  __shared__ int gsums[2][BINS / 32];  // their 32-bin group sums (cluster_find)
  __shared__ int comb[BINS];
  __shared__ int combb[BINS];  // comb over the CTAs before this one
  int buf = 0;  // the current digit's hists / gsums
  __shared__ float qv[1][RMAX];
  __shared__ float qsum;
  __shared__ int st[3];
  __shared__ int2 tile_tot;
#ifdef DS_PHASES
  phase_put(0, phase_timer());
  phase_put(1, phase_smid());
#endif
  DS_PHASE(3);
  const int rank = (int)cluster.block_rank();
  const long long row = blockIdx.y;  // b * HQ + hq
  const long long b = row / p.HQ, hq = row % p.HQ, h = hq / p.G;
  const int r = (int)(p.W * p.per);
  const long long t0 = (long long)rank * p.chunk;
  const long long t1 = max(t0, min(t0 + p.chunk, p.T));
  const long long n = t1 - t0;
  const long long lbase = b * p.sl_b + h * p.sl_h;
  for (int i = threadIdx.x; i < BINS0; i += blockDim.x) hists[0][i] = 0;
  for (int c = threadIdx.x; c < r; c += blockDim.x)
    qv[0][c] = query_value(p, b, hq, p.ch[h * p.sch_h + c]);
  __syncthreads();
  if (QUANT && threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < p.W; ++w)
      for (int j = 0; j < p.per; ++j) s += qv[0][j * p.W + w];
    qsum = s;
  }
  __syncthreads();
  DS_PHASE(4);
  for (long long tb = t0 + (long long)threadIdx.x * TPT; tb < t1; tb += (long long)blockDim.x * TPT) {
    float acc[1][TPT];
    score_tokens<LT, VEC, WU, 1>(p, qv, lbase, tb, t1, acc);
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      const long long t = tb + i;
      if (t < t1) {
        float v = acc[0][i];
        if (QUANT) {
          float sv = __half2float(p.sc[b * p.sz_b + h * p.sz_h + t]);
          sv = sv == 0.f ? 1.f : sv;
          v = fmaf(v, sv, qsum * __half2float(p.ze[b * p.sz_b + h * p.sz_h + t]));
        }
        if (p.has_valid && p.va[b * p.sva_b + t] == 0) v = -INFINITY;
        const uint32_t key = orderable(v);
        sk[t - t0] = key;
        atomicAdd(&hists[0][key >> (32 - BITS0)], 1);
      }
    }
  }
  __syncthreads();
  DS_PHASE(5);
  long long* out = sp.out + row * sp.K;
  int need = (int)sp.K;
  cluster_find<true>(hists[0], gsums[0], comb, combb, BINS0, need, st);
  int above_before = st[2];  // keys above the prefix in the CTAs before this one
  DS_PHASE(6);
  [[maybe_unused]] int passes = 0;
  uint32_t prefix = (uint32_t)st[0];
  need -= st[1];
  int shift = 32 - BITS0;
  int in_bin = comb[st[0]];
  __syncthreads();
  int tie_before = -1;  // set by the exact pick; else the last digit's combb below
  while (in_bin != need && shift > 0) {
    if (in_bin <= PICK_CAP) {  // few keys left at the prefix: pick among them exactly - one round, no histogram
      pick_exact(sk, n, t0, rank, hists[buf ^ 1], comb, in_bin, prefix, shift, need, above_before, tie_before);
#ifdef DS_PHASES
      passes += 100;  // (the phase record: an exact pick)
#endif
      break;
    }
    const int nb = shift >= BITS ? BITS : shift;
    const int low = shift - nb;
    buf ^= 1;
    int* hist = hists[buf];
    for (int i = threadIdx.x; i < BINS; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (long long t = threadIdx.x; t < n; t += blockDim.x) {
      const uint32_t k = sk[t];
      if ((k >> shift) == prefix) atomicAdd(&hist[(k >> low) & ((1u << nb) - 1u)], 1);
    }
    __syncthreads();
    cluster_find(hist, gsums[buf], comb, combb, 1 << nb, need, st);
    above_before += st[2];
    prefix = (prefix << nb) | (uint32_t)st[0];
    need -= st[1];
    shift = low;
    in_bin = comb[st[0]];
    __syncthreads();
    ++passes;
  }
  DS_PHASE(7);
#ifdef DS_PHASES
  phase_put(2, passes);
#endif
  // the counts of the CTAs before this one came with the digits (cluster_find's combb): keys above the prefix, the
  // sum over the digits of those in higher digit values; ties, the last digit's own bin
  if (tie_before < 0) tie_before = combb[st[0]];
  // the last barrier: arrive now (this CTA reads no other CTA's shared memory from here), wait before leaving (no
  // CTA's shared memory goes while another may read it).  Relaxed: it orders no memory, only execution - every
  // remote read before it has been consumed (its value is in st / comb / this CTA's own shared memory), so it is
  // complete, and no CTA writes another's shared memory; a release arrive costs a MEMBAR.ALL.GPU (sm_90a SASS;
  // session 47's phases: 0.64 us between the last digit and the emit)
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  DS_PHASE(8);
  emit_chosen<false>(sk, n, t0, prefix, shift, need, above_before, tie_before, out, &tile_tot, sp.emit_vecs);
  DS_PHASE(9);
#ifdef DS_PHASES
  phase_put(10, phase_timer());
#endif
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

constexpr long long SMEM_KEYS = 48 * 1024;  // keys a select CTA holds in shared memory (192 KB)

struct KeysLaunch {
  dim3 grid;
  int threads, wu;
  bool vec;
};

template <int LT, int GN>
int launch_keys(const KeysParams& p, const KeysLaunch& l, cudaStream_t s) {
  if (l.wu == 4) {
    if (l.vec) ds_keys_kernel<LT, GN, true, 4><<<l.grid, l.threads, 0, s>>>(p);
    else ds_keys_kernel<LT, GN, false, 4><<<l.grid, l.threads, 0, s>>>(p);
  } else {
    if (l.vec) ds_keys_kernel<LT, GN, true, 1><<<l.grid, l.threads, 0, s>>>(p);
    else ds_keys_kernel<LT, GN, false, 1><<<l.grid, l.threads, 0, s>>>(p);
  }
  return (int)cudaGetLastError();
}

template <int LT>
int launch_keys_lt(const KeysParams& p, int gn, const KeysLaunch& l, cudaStream_t s) {
  switch (gn) {
    case 1: return launch_keys<LT, 1>(p, l, s);
    case 2: return launch_keys<LT, 2>(p, l, s);
    case 4: return launch_keys<LT, 4>(p, l, s);
    case 8: return launch_keys<LT, 8>(p, l, s);
  }
  return (int)cudaErrorInvalidValue;
}

// the dynamic shared memory the shared-memory select may use, per device: raised (cudaFuncSetAttribute) when a
// launch needs more (internal linkage: not shared across libraries)
namespace {
int smem_set[64];
int cluster_smem_set[64][16];  // per device and label format x vector loads x rows in flight

template <int LT, bool VEC, int WU>
int launch_cluster(const KeysParams& p, const SelectParams& sp, int c, int threads, int device, cudaStream_t s,
                   long long rows) {
  const int bytes = (int)(p.chunk * 4);
  int& set = cluster_smem_set[device][LT * 4 + (VEC ? 2 : 0) + (WU == 4 ? 1 : 0)];
  if (bytes > set) {
    cudaError_t e = cudaFuncSetAttribute(ds_cluster_kernel<LT, VEC, WU>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes);
    if (e != cudaSuccess) return (int)e;
    set = bytes;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)c, (unsigned)rows, 1);
  cfg.blockDim = dim3((unsigned)threads, 1, 1);
  cfg.dynamicSmemBytes = (size_t)bytes;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)c;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, ds_cluster_kernel<LT, VEC, WU>, p, sp);
}

template <int LT>
int launch_cluster_lt(const KeysParams& p, const SelectParams& sp, bool vec, int wu, int c, int threads, int device,
                      cudaStream_t s, long long rows) {
  if (LT == F32 && threads > SELECT_THREADS / 2) wu = 1;  // 4 fp32 rows in flight need more than 64 registers
  if (wu == 4)
    return vec ? launch_cluster<LT, true, 4>(p, sp, c, threads, device, s, rows)
               : launch_cluster<LT, false, 4>(p, sp, c, threads, device, s, rows);
  return vec ? launch_cluster<LT, true, 1>(p, sp, c, threads, device, s, rows)
             : launch_cluster<LT, false, 1>(p, sp, c, threads, device, s, rows);
}
}

}  // namespace ds_radix

extern "C" {

DS_EXPORT int ds_radix_bins0() { return ds_radix::BINS0; }
DS_EXPORT int ds_radix_gmax() { return ds_radix::GMAX; }
DS_EXPORT int ds_radix_rmax() { return ds_radix::RMAX; }
DS_EXPORT const char* ds_radix_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

// a (int64): q, sq_b, sq_h, ch, sch_h, lab, sl_b, sl_h, sl_c, sc, ze, sz_b, sz_h, va, sva_b, keys, hist,
//            T, HQ, HKV, G, W, per, bits, chunk, gblocks, B, q dtype, label dtype, has_valid, K, out, heads per CTA,
//            vector label loads (0/1), keys row stride KS (a multiple of 8), shared-memory select (0/1), keys CTA
//            threads (128 / 256), label rows in flight (1 / 4), select CTA threads (256 / 512 / 1024), query rows
//            summed per select row (1: none; HQ and G count select rows), their stride, 16-byte key reads per thread
//            per emit tile (1 - EMIT_VECS) (dtype codes: DType)
DS_EXPORT int ds_radix_select_launch(const long long* a, int device, void* stream) {
  using namespace ds_radix;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  KeysParams p;
  p.q = reinterpret_cast<const void*>(a[0]); p.sq_b = a[1]; p.sq_h = a[2];
  p.ch = reinterpret_cast<const long long*>(a[3]); p.sch_h = a[4];
  p.lab = reinterpret_cast<const void*>(a[5]); p.sl_b = a[6]; p.sl_h = a[7]; p.sl_c = a[8];
  p.sc = reinterpret_cast<const __half*>(a[9]); p.ze = reinterpret_cast<const __half*>(a[10]);
  p.sz_b = a[11]; p.sz_h = a[12];
  p.va = reinterpret_cast<const uint8_t*>(a[13]); p.sva_b = a[14];
  p.keys = reinterpret_cast<uint32_t*>(a[15]); p.hist = reinterpret_cast<int*>(a[16]);
  p.T = a[17]; p.HQ = a[18]; p.HKV = a[19]; p.G = a[20]; p.W = a[21]; p.per = a[22]; p.bits = a[23];
  p.chunk = a[24]; p.gblocks = a[25];
  const long long B = a[26];
  p.qt = (int)a[27];
  const int lt = (int)a[28];
  p.has_valid = a[29] != 0;
  const int gn = (int)a[32];
  const bool vec = a[33] != 0;
  p.KS = a[34];
  const bool smem = a[35] != 0;
  const int kthreads = (int)a[36], wu = (int)a[37], sthreads = (int)a[38];
  p.qg = a[39]; p.sq_g = a[40];
  if (p.qg < 1 || (kthreads != 128 && kthreads != 256) || (wu != 1 && wu != 4) || a[41] < 1 || a[41] > EMIT_VECS
      || (sthreads != 256 && sthreads != 512 && sthreads != 1024) || p.chunk % (TPT * kthreads))
    return (int)cudaErrorInvalidValue;
  if (p.T < 1 || p.chunk < 1 || p.chunk % TPT || p.W * p.per > RMAX || a[30] < 1 || a[30] > p.T
      || p.T > 0x7fffffffLL || p.qt < F16 || p.qt > F32 || gn * p.gblocks < p.G || p.KS < p.T || p.KS % TPT
      || (smem && p.KS > SMEM_KEYS) || device < 0 || device >= 64)
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const long long chunks = (p.T + p.chunk - 1) / p.chunk;
  KeysLaunch l;
  l.grid = dim3((unsigned)chunks, (unsigned)(B * p.HKV * p.gblocks));
  l.threads = kthreads; l.wu = wu; l.vec = vec;
  int rc;
  switch (lt) {
    case F16: rc = launch_keys_lt<F16>(p, gn, l, s); break;
    case BF16: rc = launch_keys_lt<BF16>(p, gn, l, s); break;
    case F32: rc = launch_keys_lt<F32>(p, gn, l, s); break;
    case U8: rc = launch_keys_lt<U8>(p, gn, l, s); break;
    default: return (int)cudaErrorInvalidValue;
  }
  if (rc) return rc;
  SelectParams sp;
  sp.keys = p.keys; sp.hist = p.hist; sp.out = reinterpret_cast<long long*>(a[31]);
  sp.T = p.T; sp.K = a[30]; sp.KS = p.KS; sp.emit_vecs = (int)a[41];
  if (smem) {
    const int bytes = (int)(p.KS * 4);
    if (bytes > smem_set[device]) {
      e = cudaFuncSetAttribute(ds_select_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (e != cudaSuccess) return (int)e;
      smem_set[device] = bytes;
    }
    ds_select_kernel<true><<<(unsigned)(B * p.HQ), sthreads, (size_t)bytes, s>>>(sp);
  } else {
    ds_select_kernel<false><<<(unsigned)(B * p.HQ), sthreads, 0, s>>>(sp);
  }
  return (int)cudaGetLastError();
}

DS_EXPORT long long ds_radix_smem_keys() { return ds_radix::SMEM_KEYS; }
DS_EXPORT int ds_radix_pick_cap() { return ds_radix::PICK_CAP; }

// The phase clocks of the last cluster selects (a build with -DDS_PHASES; -1 otherwise): n int64 into dst (host).
DS_EXPORT int ds_radix_phases(long long* dst, long long n) {
#ifdef DS_PHASES
  if (n < 0 || n > ds_radix::PH_CTAS * ds_radix::PH_SLOTS) return (int)cudaErrorInvalidValue;
  return (int)cudaMemcpyFromSymbol(dst, ds_radix::ds_phase_buf, (size_t)n * sizeof(long long));
#else
  (void)dst; (void)n;
  return -1;
#endif
}

// The cluster select (sm_90): a as for ds_radix_select_launch (keys, hist, gn, KS, smem and keys threads unused;
// label rows in flight 1 or 4; chunk = tokens per CTA, a multiple of 8, at most SMEM_KEYS), c = CTAs per head (1, 2, 4 or 8:
// 1 is one CTA per head scoring and selecting alone, a cluster of one), threads
// per CTA (256, 512 or 1024).
DS_EXPORT int ds_radix_cluster_launch(const long long* a, int c, int threads, int device, void* stream) {
  using namespace ds_radix;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  KeysParams p;
  p.q = reinterpret_cast<const void*>(a[0]); p.sq_b = a[1]; p.sq_h = a[2];
  p.ch = reinterpret_cast<const long long*>(a[3]); p.sch_h = a[4];
  p.lab = reinterpret_cast<const void*>(a[5]); p.sl_b = a[6]; p.sl_h = a[7]; p.sl_c = a[8];
  p.sc = reinterpret_cast<const __half*>(a[9]); p.ze = reinterpret_cast<const __half*>(a[10]);
  p.sz_b = a[11]; p.sz_h = a[12];
  p.va = reinterpret_cast<const uint8_t*>(a[13]); p.sva_b = a[14];
  p.keys = nullptr; p.hist = nullptr;
  p.T = a[17]; p.HQ = a[18]; p.HKV = a[19]; p.G = a[20]; p.W = a[21]; p.per = a[22]; p.bits = a[23];
  p.chunk = a[24]; p.gblocks = 1; p.KS = 0;
  p.qg = a[39]; p.sq_g = a[40];
  const long long B = a[26];
  p.qt = (int)a[27];
  const int lt = (int)a[28];
  p.has_valid = a[29] != 0;
  const bool vec = a[33] != 0;
  SelectParams sp;
  sp.keys = nullptr; sp.hist = nullptr; sp.out = reinterpret_cast<long long*>(a[31]);
  sp.T = p.T; sp.K = a[30]; sp.KS = 0; sp.emit_vecs = (int)a[41];
  if (p.T < 1 || p.chunk < TPT || p.chunk % TPT || p.chunk > SMEM_KEYS || p.chunk * c < p.T || p.W * p.per > RMAX
      || sp.K < 1 || sp.K > p.T || p.T > 0x7fffffffLL || p.qt < F16 || p.qt > F32 || (c != 1 && c != 2 && c != 4 && c != 8)
      || sp.emit_vecs < 1 || sp.emit_vecs > EMIT_VECS
      || (threads != 256 && threads != 512 && threads != 1024) || device < 0 || device >= 64 || p.qg < 1)
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const long long rows = B * p.HQ;
  const int wu = a[37] == 4 ? 4 : 1;
  switch (lt) {
    case F16: return launch_cluster_lt<F16>(p, sp, vec, wu, c, threads, device, s, rows);
    case BF16: return launch_cluster_lt<BF16>(p, sp, vec, wu, c, threads, device, s, rows);
    case F32: return launch_cluster_lt<F32>(p, sp, vec, wu, c, threads, device, s, rows);
    case U8: return launch_cluster_lt<U8>(p, sp, vec, wu, c, threads, device, s, rows);
  }
  return (int)cudaErrorInvalidValue;
}

}  // extern "C"
