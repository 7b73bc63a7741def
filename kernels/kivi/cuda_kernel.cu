// Fused KIVI-2/4 decode attention, hand-written CUDA C++ ("v3").  See cuda_kernel.py for the design notes
// (fragment mapping, pipeline); this file holds the device code and an extern "C" launcher that takes raw
// pointers, so it builds with plain nvcc (no torch headers) and is bound from Python with ctypes.
//
// KIVI: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024, arXiv 2402.02750.
//
// Build (one shared library per (bits, Dk, Dv); every row-tile / pipeline-depth variant is instantiated):
//   nvcc -O3 --use_fast_math -lineinfo -std=c++17 -shared -Xcompiler -fPIC \
//        -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
//        -DKIVI_BITS=2 -DKIVI_DK=128 -DKIVI_DV=128 -o libkivi.so cuda_kernel.cu
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef KIVI_BITS
#define KIVI_BITS 2
#endif
#ifndef KIVI_DK
#define KIVI_DK 128
#endif
#ifndef KIVI_DV
#define KIVI_DV 128
#endif

namespace kivi_v3 {

constexpr int TILE = 32;       // tokens per warp iteration (4 n8 score tiles, 2 k16 steps of P.V)
constexpr int KROW = TILE * 4 + 16;  // bytes of one key word row of a tile in shared memory (padded: no conflicts)
constexpr int MAX_NW = 4;
#ifndef KIVI_MIN_BLOCKS
#define KIVI_MIN_BLOCKS 1  // >1 caps registers (65536 / (128 * N)); a build option, swept by the benchmark
#endif

struct Params {
  const __half* q;
  const int* kc;
  const __half* ks;
  const __half* kz;
  const int* vc;
  const __half* vs;
  const __half* vz;
  const uint8_t* valid;
  float* po;  // [nsplit, BH, M, DV] normalised partial outputs
  float* pl;  // [nsplit, BH, M] natural-log LSE
  long long q_sb, q_sh, q_sm;
  long long kc_sb, kc_sh, kc_sg;
  long long ks_sb, ks_sh, ks_sg;
  long long kz_sb, kz_sh, kz_sg;
  long long vc_sb, vc_sh, vc_st;
  long long vs_sb, vs_sh;  // value scales / zeros: [T, NGV] rows dense
  long long vz_sb, vz_sh;
  long long va_sb;
  int M, H, NT, gshift, tps, nsplit, ngv, gv, BH;
  float qk_scale;  // softmax scale * log2(e)
};

template <int BITS, int DK, int DV>
struct Cfg {
  static constexpr int PER = 32 / BITS;          // codes per int32 word
  static constexpr int HP = PER / 2;              // code pairs (fields) per word
  static constexpr int KW = DK / PER;             // key words per token
  static constexpr int KWT = KW / 4;              // key words per token a quad lane owns
  static constexpr int VW = DV / PER;             // value words per token
  static constexpr int NVW = VW >= 8 ? VW / 8 : 1;  // value words per token a lane column (g) owns
  static constexpr int NU = VW >= 8 ? 2 * NVW : 1;  // (word, half) units per token a lane column owns
  static constexpr int NKS = DK / 16;             // k16 slices of the score product
  static constexpr int NTV = DV / 8;              // n8 tiles of the output
  static constexpr int DIRECT = 10 / BITS;        // fields that sit inside the 10-bit mantissa unshifted
  static constexpr int NGV_MAX = DV / 16;
  // shared-memory layout of one pipeline stage (bytes, every region 16-byte aligned)
  static constexpr int OFF_K = 0;
  static constexpr int OFF_KS = OFF_K + KW * KROW;
  static constexpr int OFF_KZ = OFF_KS + DK * 2;
  static constexpr int OFF_V = OFF_KZ + DK * 2;
  static constexpr int VROW = VW * 4;
  static constexpr int OFF_VS = OFF_V + TILE * VROW;
  static constexpr int OFF_VZ = OFF_VS + TILE * NGV_MAX * 2;
  static constexpr int OFF_VA = OFF_VZ + TILE * NGV_MAX * 2;
  static constexpr int STAGE = OFF_VA + TILE;
  static_assert(DK % 64 == 0 || (BITS == 4 && DK % 32 == 0), "key words must split evenly over 4 quad lanes");
  static_assert(VW >= 4, "value words per token");
  static_assert(STAGE % 16 == 0, "stage alignment");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Field at bit P of both 16-bit halves of src -> exact codes as an fp16 pair, then * scale + zero (fp16x2).
// OR-ing the exponent of E = 2^(10-P) over the masked field gives E + code exactly (one LOP3); the same
// constant read as an fp16 pair is (E, E), so one HSUB2 leaves the codes; one HFMA2 applies scale and zero.
template <int BITS, int P>
__device__ __forceinline__ uint32_t deq(uint32_t src, uint32_t s, uint32_t z) {
  constexpr uint32_t MASK = ((((1u << BITS) - 1u) << P) * 0x10001u);
  constexpr uint32_t EXPB = ((uint32_t)(25 - P) << 10) * 0x10001u;
  uint32_t r, m = MASK, e = EXPB;
  asm("{\n .reg .b32 t;\n lop3.b32 t, %1, %2, %3, 0xea;\n sub.f16x2 t, t, %3;\n fma.rn.f16x2 %0, t, %4, %5;\n}\n"
      : "=r"(r)
      : "r"(src), "r"(m), "r"(e), "r"(s), "r"(z));
  return r;
}

// field i (0 .. PER/2-1) of a word whose high fields were pre-shifted into `hi`
template <int BITS, int I>
__device__ __forceinline__ uint32_t field(uint32_t w, uint32_t hi, uint32_t s, uint32_t z) {
  constexpr int DIRECT = 10 / BITS;
  if constexpr (I < DIRECT) {
    return deq<BITS, BITS * I>(w, s, z);
  } else {
    return deq<BITS, BITS * (I - DIRECT)>(hi, s, z);
  }
}

template <int BITS>
__device__ __forceinline__ uint32_t hi_fields(uint32_t w) {
  return w >> (BITS * (10 / BITS));
}

// D = A.B + C, m16n8k16, fp16 in, fp32 accumulate, C and D in the same registers.  With 8 GQA rows
// (ROWS16 off) rows 8..15 of A are copies of rows 0..7 (no zero registers to materialise around every HMMA)
// and rows 8..15 of D are never read.
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// smem row of token `tok` (0..31) of a value tile: lane (g, t) reads tokens 8t..8t+7, so rows are stored
// transposed (row = 4*(tok%8) + tok/8) to spread the four t's over the banks
__device__ __forceinline__ int vrow(int tok) { return (tok & 7) * 4 + (tok >> 3); }

// Issue the cp.async copies of one 32-token tile (keys, key scales / zeros, values, value scales / zeros, valid).
template <int BITS, int DK, int DV>
__device__ __forceinline__ void load_tile(uint8_t* stage, const Params& p, const int* kc, const __half* ks,
                                          const __half* kz, const int* vc, const __half* vs, const __half* vz,
                                          const uint8_t* va, int tok0, int lane) {
  using C = Cfg<BITS, DK, DV>;
  const int grp = tok0 >> p.gshift;
  const int toff = tok0 & ((1 << p.gshift) - 1);
  const uint32_t base = smem_addr(stage);
  const int* kg = kc + grp * p.kc_sg + toff;
  static_assert((C::KW * 8) % 32 == 0 && (TILE * C::VW / 4) % 32 == 0 && DK / 8 <= 32, "chunk counts");
#pragma unroll
  for (int it = 0; it < C::KW * 8 / 32; ++it) {
    const int c = lane + 32 * it;
    const int w = c >> 3, k = c & 7;
    cp16(base + C::OFF_K + w * KROW + 16 * k, kg + ((long long)w << p.gshift) + 4 * k);
  }
  if (lane < DK / 8) {
    cp16(base + C::OFF_KS + 16 * lane, ks + grp * p.ks_sg + 8 * lane);
    cp16(base + C::OFF_KZ + 16 * lane, kz + grp * p.kz_sg + 8 * lane);
  }
  constexpr int VCH = C::VW / 4;  // 16-byte chunks per token row
#pragma unroll
  for (int it = 0; it < TILE * VCH / 32; ++it) {
    const int c = lane + 32 * it;
    const int tok = c / VCH, part = c % VCH;
    cp16(base + C::OFF_V + vrow(tok) * C::VROW + 16 * part, vc + (long long)(tok0 + tok) * p.vc_st + 4 * part);
  }
  if (lane < 4 * p.ngv) {  // TILE * ngv halves, 8 per chunk
    cp16(base + C::OFF_VS + 16 * lane, vs + (long long)tok0 * p.ngv + 8 * lane);
    cp16(base + C::OFF_VZ + 16 * lane, vz + (long long)tok0 * p.ngv + 8 * lane);
  }
  if (lane < 2) cp16(base + C::OFF_VA + 16 * lane, va + tok0 + 16 * lane);
}

// grid (nsplit, B*H, row blocks), block NW warps.  Each warp walks its own 32-token tiles of the split
// (tiles w, w + NW, ...) through a ST-deep cp.async pipeline, keeps an online softmax in registers, and the
// warps are merged through shared memory at the end.
template <int BITS, int DK, int DV, bool ROWS16, int ST>
__global__ void __launch_bounds__(MAX_NW * 32, KIVI_MIN_BLOCKS) kivi_v3_kernel(const Params p) {
  using C = Cfg<BITS, DK, DV>;
  constexpr int MT = ROWS16 ? 16 : 8;
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, bh = blockIdx.y, rb = blockIdx.z;
  const int b = bh / p.H, h = bh - b * p.H;

  const int* kc = p.kc + b * p.kc_sb + h * p.kc_sh;
  const __half* ks = p.ks + b * p.ks_sb + h * p.ks_sh;
  const __half* kz = p.kz + b * p.kz_sb + h * p.kz_sh;
  const int* vc = p.vc + b * p.vc_sb + h * p.vc_sh;
  const __half* vs = p.vs + b * p.vs_sb + h * p.vs_sh;
  const __half* vz = p.vz + b * p.vz_sb + h * p.vz_sh;
  const uint8_t* va = p.valid + b * p.va_sb;

  // ---- query A fragments, pre-scaled by softmax scale * log2(e).  Lane (g, t) owns the channels
  // [t*DK/4, (t+1)*DK/4): its local pair l = 2s + r is k-pair (2t, 2t+1) (r = 0) or (2t+8, 2t+9) (r = 1) of
  // k16 slice s.  The same permutation of the channels is used for the keys below, so S is unchanged.
  uint32_t qa[C::NKS][4];
  {
    const int r0 = rb * MT + g, r1 = r0 + 8;
    const __half* q0 = p.q + b * p.q_sb + h * p.q_sh + (long long)r0 * p.q_sm + t * (DK / 4);
    const __half* q1 = p.q + b * p.q_sb + h * p.q_sh + (long long)r1 * p.q_sm + t * (DK / 4);
#pragma unroll
    for (int l = 0; l < DK / 8; ++l) {
      uint32_t x0 = 0u, x1 = 0u;
      if (r0 < p.M) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(q0 + 2 * l));
        x0 = pack_f16x2(f.x * p.qk_scale, f.y * p.qk_scale);
      }
      if (ROWS16 && r1 < p.M) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(q1 + 2 * l));
        x1 = pack_f16x2(f.x * p.qk_scale, f.y * p.qk_scale);
      }
      qa[l >> 1][(l & 1) ? 2 : 0] = x0;
      qa[l >> 1][(l & 1) ? 3 : 1] = ROWS16 ? x1 : x0;
    }
  }

  float acc[C::NTV][4];
#pragma unroll
  for (int n = 0; n < C::NTV; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};

  // tiles of this split owned by this warp
  const int t_begin = split * p.tps;
  const int t_end = min(t_begin + p.tps, p.NT);
  const int ntiles = (t_end - t_begin) / TILE;
  const int nmine = ntiles > warp ? (ntiles - warp + nw - 1) / nw : 0;
  uint8_t* wsm = smem + warp * (ST * C::STAGE);

#pragma unroll
  for (int i = 0; i < ST - 1; ++i) {
    if (i < nmine) load_tile<BITS, DK, DV>(wsm + i * C::STAGE, p, kc, ks, kz, vc, vs, vz, va,
                                           t_begin + (warp + i * nw) * TILE, lane);
    cp_commit();
  }

  // value column constants of this lane: (word, half) units, value group
  int vgrp;
  uint32_t vsel = 0x5410u;
  if constexpr (C::VW >= 8) {
    vgrp = (g * C::NVW * C::PER) / p.gv;
  } else {
    vgrp = ((g >> 1) * C::PER) / p.gv;
    vsel = (g & 1) ? 0x7632u : 0x5410u;
  }

  for (int it = 0; it < nmine; ++it) {
    {
      const int nx = it + ST - 1;
      if (nx < nmine) load_tile<BITS, DK, DV>(wsm + (nx % ST) * C::STAGE, p, kc, ks, kz, vc, vs, vz, va,
                                              t_begin + (warp + nx * nw) * TILE, lane);
      cp_commit();
    }
    cp_wait<ST - 1>();
    __syncwarp();
    const uint8_t* sb = wsm + (it % ST) * C::STAGE;

    // ---- S = Q K^T over the tile: n8 tile j holds tokens 4*g' + j for column g' (lane g loads tokens
    // 4g..4g+3 of each of its key words as one 16-byte vector), so lane (g, t)'s accumulators c0/c1 of tile j
    // are tokens 8t + j and 8t + 4 + j.
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    {
#pragma unroll
      for (int jw = 0; jw < C::KWT; ++jw) {
        // scale / zero pairs of this word's HP channel pairs (local pairs jw*HP ..)
        uint32_t ksc[C::HP], kzr[C::HP];
#pragma unroll
        for (int c = 0; c < C::HP / 4; ++c) {
          const int off = t * (DK / 2) + jw * C::HP * 4 + 16 * c;
          const uint4 a = *reinterpret_cast<const uint4*>(sb + C::OFF_KS + off);
          const uint4 z = *reinterpret_cast<const uint4*>(sb + C::OFF_KZ + off);
          ksc[4 * c] = a.x; ksc[4 * c + 1] = a.y; ksc[4 * c + 2] = a.z; ksc[4 * c + 3] = a.w;
          kzr[4 * c] = z.x; kzr[4 * c + 1] = z.y; kzr[4 * c + 2] = z.z; kzr[4 * c + 3] = z.w;
        }
        const uint4 wv = *reinterpret_cast<const uint4*>(sb + C::OFF_K + (t * C::KWT + jw) * KROW + 16 * g);
        const uint32_t wt[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t w = wt[j];
          const uint32_t hi = hi_fields<BITS>(w);
          uint32_t kb[C::HP];
#pragma unroll
          for (int i = 0; i < C::HP; ++i) {
            const int l = i;
            // unrolled constant dispatch of the field index
            if constexpr (BITS == 2) {
              switch (i) {
                case 0: kb[i] = field<2, 0>(w, hi, ksc[l], kzr[l]); break;
                case 1: kb[i] = field<2, 1>(w, hi, ksc[l], kzr[l]); break;
                case 2: kb[i] = field<2, 2>(w, hi, ksc[l], kzr[l]); break;
                case 3: kb[i] = field<2, 3>(w, hi, ksc[l], kzr[l]); break;
                case 4: kb[i] = field<2, 4>(w, hi, ksc[l], kzr[l]); break;
                case 5: kb[i] = field<2, 5>(w, hi, ksc[l], kzr[l]); break;
                case 6: kb[i] = field<2, 6>(w, hi, ksc[l], kzr[l]); break;
                default: kb[i] = field<2, 7>(w, hi, ksc[l], kzr[l]); break;
              }
            } else {
              switch (i) {
                case 0: kb[i] = field<4, 0>(w, hi, ksc[l], kzr[l]); break;
                case 1: kb[i] = field<4, 1>(w, hi, ksc[l], kzr[l]); break;
                case 2: kb[i] = field<4, 2>(w, hi, ksc[l], kzr[l]); break;
                default: kb[i] = field<4, 3>(w, hi, ksc[l], kzr[l]); break;
              }
            }
          }
          // local pairs l = jw*HP + i; slice l/2, register l%2 (HP is even)
#pragma unroll
          for (int i = 0; i < C::HP; i += 2) {
            const int sl = (jw * C::HP + i) >> 1;
            mma(s[j], qa[sl][0], qa[sl][1], qa[sl][2], qa[sl][3], kb[i], kb[i + 1]);
          }
        }
      }
    }

    // ---- mask + online softmax (base 2); lane-local row sums, reduced over the quad at the end
    const uint2 vb = *reinterpret_cast<const uint2*>(sb + C::OFF_VA + 8 * t);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok0 = ((j < 4 ? (vb.x >> (8 * j)) : 0u) & 0xffu) != 0u;  // token 8t + j
      const bool ok1 = ((vb.y >> (8 * j)) & 0xffu) != 0u;                // token 8t + 4 + j
      s[j][0] = ok0 ? s[j][0] : -INFINITY;
      s[j][1] = ok1 ? s[j][1] : -INFINITY;
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      if (ROWS16) {
        s[j][2] = ok0 ? s[j][2] : -INFINITY;
        s[j][3] = ok1 ? s[j][3] : -INFINITY;
        mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
      }
    }
#pragma unroll
    for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    const bool grow = mx[0] > m_run[0] || (ROWS16 && mx[1] > m_run[1]);
    if (__any_sync(0xffffffffu, grow)) {  // lazy rescale: only when some row maximum grew
#pragma unroll
      for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
        const float mn = fmaxf(m_run[r], mx[r]);
        const float alpha = mn == -INFINITY ? 1.f : exp2f(m_run[r] - mn);
        l_run[r] *= alpha;
#pragma unroll
        for (int n = 0; n < C::NTV; ++n) {
          acc[n][2 * r] *= alpha;
          acc[n][2 * r + 1] *= alpha;
        }
        m_run[r] = mn;
      }
    }
    uint32_t pa[2][4];
    {
      const float ms0 = m_run[0] == -INFINITY ? 0.f : m_run[0];
      const float ms1 = m_run[1] == -INFINITY ? 0.f : m_run[1];
      float pr[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pr[j][0] = exp2f(s[j][0] - ms0);
        pr[j][1] = exp2f(s[j][1] - ms0);
        l_run[0] += pr[j][0] + pr[j][1];
        if (ROWS16) {
          pr[j][2] = exp2f(s[j][2] - ms1);
          pr[j][3] = exp2f(s[j][3] - ms1);
          l_run[1] += pr[j][2] + pr[j][3];
        } else {
          pr[j][2] = pr[j][3] = 0.f;
        }
      }
      // A fragments of P.V (FlashAttention-2 register reuse): k16 step kk = score tiles 2kk, 2kk+1;
      // a0 = row g, tokens (8t+2kk, 8t+4+2kk); a2 = row g, tokens (8t+2kk+1, 8t+5+2kk); a1/a3 rows g+8.
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        pa[kk][0] = pack_f16x2(pr[2 * kk][0], pr[2 * kk][1]);
        pa[kk][1] = ROWS16 ? pack_f16x2(pr[2 * kk][2], pr[2 * kk][3]) : pa[kk][0];
        pa[kk][2] = pack_f16x2(pr[2 * kk + 1][0], pr[2 * kk + 1][1]);
        pa[kk][3] = ROWS16 ? pack_f16x2(pr[2 * kk + 1][2], pr[2 * kk + 1][3]) : pa[kk][2];
      }
    }

    // ---- O += P V.  B fragment of k16 step kk, n8 tile nt: column g = one value channel of this lane,
    // rows (tokens) as above.  A PRMT puts the same 16-bit half of two tokens' words into one register, so
    // every field of it is a (token a, token b) pair of one channel: one LOP3 + HSUB2 + HFMA2 per pair, with the
    // per-token value scale / zero pair built the same way.
    {
      const __half* vss = reinterpret_cast<const __half*>(sb + C::OFF_VS);
      const __half* vzs = reinterpret_cast<const __half*>(sb + C::OFF_VZ);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t bw[2][C::NU];   // [b0/b1][unit]: merged words
        uint32_t bs[2], bz[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int ia = 2 * kk + r, ib = ia + 4;  // tokens 8t + ia, 8t + ib
          const int ta = 8 * t + ia, tb = 8 * t + ib;
          const __half sa = vss[ta * p.ngv + vgrp], sbv = vss[tb * p.ngv + vgrp];
          const __half za = vzs[ta * p.ngv + vgrp], zb = vzs[tb * p.ngv + vgrp];
          bs[r] = (uint32_t)__half_as_ushort(sa) | ((uint32_t)__half_as_ushort(sbv) << 16);
          bz[r] = (uint32_t)__half_as_ushort(za) | ((uint32_t)__half_as_ushort(zb) << 16);
          const uint8_t* ra = sb + C::OFF_V + vrow(ta) * C::VROW;
          const uint8_t* rbp = sb + C::OFF_V + vrow(tb) * C::VROW;
          if constexpr (C::VW >= 8) {
#pragma unroll
            for (int w = 0; w < C::NVW; ++w) {
              const uint32_t wa = *reinterpret_cast<const uint32_t*>(ra + 4 * (g * C::NVW + w));
              const uint32_t wb = *reinterpret_cast<const uint32_t*>(rbp + 4 * (g * C::NVW + w));
              bw[r][2 * w] = prmt(wa, wb, 0x5410u);
              bw[r][2 * w + 1] = prmt(wa, wb, 0x7632u);
            }
          } else {
            const uint32_t wa = *reinterpret_cast<const uint32_t*>(ra + 4 * (g >> 1));
            const uint32_t wb = *reinterpret_cast<const uint32_t*>(rbp + 4 * (g >> 1));
            bw[r][0] = prmt(wa, wb, vsel);
          }
        }
#pragma unroll
        for (int u = 0; u < C::NU; ++u) {
          const uint32_t w0 = bw[0][u], w1 = bw[1][u];
          const uint32_t h0 = hi_fields<BITS>(w0), h1 = hi_fields<BITS>(w1);
#pragma unroll
          for (int i = 0; i < C::HP; ++i) {
            uint32_t b0, b1;
            if constexpr (BITS == 2) {
              switch (i) {
                case 0: b0 = field<2, 0>(w0, h0, bs[0], bz[0]); b1 = field<2, 0>(w1, h1, bs[1], bz[1]); break;
                case 1: b0 = field<2, 1>(w0, h0, bs[0], bz[0]); b1 = field<2, 1>(w1, h1, bs[1], bz[1]); break;
                case 2: b0 = field<2, 2>(w0, h0, bs[0], bz[0]); b1 = field<2, 2>(w1, h1, bs[1], bz[1]); break;
                case 3: b0 = field<2, 3>(w0, h0, bs[0], bz[0]); b1 = field<2, 3>(w1, h1, bs[1], bz[1]); break;
                case 4: b0 = field<2, 4>(w0, h0, bs[0], bz[0]); b1 = field<2, 4>(w1, h1, bs[1], bz[1]); break;
                case 5: b0 = field<2, 5>(w0, h0, bs[0], bz[0]); b1 = field<2, 5>(w1, h1, bs[1], bz[1]); break;
                case 6: b0 = field<2, 6>(w0, h0, bs[0], bz[0]); b1 = field<2, 6>(w1, h1, bs[1], bz[1]); break;
                default: b0 = field<2, 7>(w0, h0, bs[0], bz[0]); b1 = field<2, 7>(w1, h1, bs[1], bz[1]); break;
              }
            } else {
              switch (i) {
                case 0: b0 = field<4, 0>(w0, h0, bs[0], bz[0]); b1 = field<4, 0>(w1, h1, bs[1], bz[1]); break;
                case 1: b0 = field<4, 1>(w0, h0, bs[0], bz[0]); b1 = field<4, 1>(w1, h1, bs[1], bz[1]); break;
                case 2: b0 = field<4, 2>(w0, h0, bs[0], bz[0]); b1 = field<4, 2>(w1, h1, bs[1], bz[1]); break;
                default: b0 = field<4, 3>(w0, h0, bs[0], bz[0]); b1 = field<4, 3>(w1, h1, bs[1], bz[1]); break;
              }
            }
            const int nt = u * C::HP + i;
            mma(acc[nt], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0, b1);
          }
        }
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_wait<0>();

  // ---- merge the warps (shared memory), normalise, write the split partial
  __syncthreads();
  float* om = reinterpret_cast<float*>(smem);                 // [nw][MT][DV]
  float* mm = om + nw * MT * DV;                                // [nw][MT]
  float* lm = mm + nw * MT;                                     // [nw][MT]
#pragma unroll
  for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = g + 8 * r;
    if (t == 0) {
      mm[warp * MT + row] = m_run[r];
      lm[warp * MT + row] = l;
    }
    // output column of n8 tile nt, lane column c: channel rho(nt, c)
#pragma unroll
    for (int nt = 0; nt < C::NTV; ++nt) {
      const int u = nt / C::HP, i = nt % C::HP;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * t + e;
        int ch;
        if constexpr (C::VW >= 8) {
          ch = (c * C::NVW + (u >> 1)) * C::PER + 2 * i + (u & 1);
        } else {
          ch = (c >> 1) * C::PER + 2 * i + (c & 1);
        }
        om[(warp * MT + row) * DV + ch] = acc[nt][2 * r + e];
      }
    }
  }
  __syncthreads();
  const int rows = min(MT, p.M - rb * MT);
  for (int idx = threadIdx.x; idx < rows * DV; idx += blockDim.x) {
    const int row = idx / DV, ch = idx - row * DV;
    float top = -INFINITY;
    for (int w = 0; w < nw; ++w) top = fmaxf(top, mm[w * MT + row]);
    const long long orow = ((long long)split * p.BH + bh) * p.M + rb * MT + row;
    if (top == -INFINITY) {
      p.po[orow * DV + ch] = 0.f;
      if (ch == 0) p.pl[orow] = -INFINITY;
      continue;
    }
    float num = 0.f, den = 0.f;
    for (int w = 0; w < nw; ++w) {
      const float f = exp2f(mm[w * MT + row] - top);
      num += f * om[(w * MT + row) * DV + ch];
      den += f * lm[w * MT + row];
    }
    p.po[orow * DV + ch] = num / den;
    if (ch == 0) p.pl[orow] = (top + log2f(den)) * 0.69314718055994531f;
  }
}

// Merge nsplit partials [S, R, DV] / [S, R] (R = B*H*M rows) into out [R, DV] / lse [R] by log-sum-exp.
__global__ void kivi_v3_combine(const float* __restrict__ po, const float* __restrict__ pl, float* __restrict__ out,
                                float* __restrict__ lse, int nsplit, long long R, int DV) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= R * DV) return;
  const long long row = idx / DV;
  const int ch = (int)(idx - row * DV);
  float top = -INFINITY;
  for (int s = 0; s < nsplit; ++s) top = fmaxf(top, pl[s * R + row]);
  if (top == -INFINITY) {
    out[idx] = 0.f;
    if (ch == 0) lse[row] = -INFINITY;
    return;
  }
  float num = 0.f, den = 0.f;
  for (int s = 0; s < nsplit; ++s) {
    const float f = __expf(pl[s * R + row] - top);
    num += f * po[(s * R + row) * DV + ch];
    den += f;
  }
  out[idx] = num / den;
  if (ch == 0) lse[row] = top + __logf(den);
}

template <int BITS, int DK, int DV>
constexpr int stage_bytes() {
  return Cfg<BITS, DK, DV>::STAGE;
}

template <bool ROWS16, int ST>
int launch_variant(const Params& p, int nw, dim3 grid, size_t smem, cudaStream_t stream) {
  auto kern = kivi_v3_kernel<KIVI_BITS, KIVI_DK, KIVI_DV, ROWS16, ST>;
  static size_t configured = 0;  // per instantiation: dynamic shared-memory limit raised once
  if (smem > 48 * 1024 && smem > configured) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
    configured = smem;
  }
  kern<<<grid, nw * 32, smem, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace kivi_v3

extern "C" {

// Shared-memory bytes of one pipeline stage of one warp (the Python side sizes launches with it).
int kivi_v3_stage_bytes() { return kivi_v3::stage_bytes<KIVI_BITS, KIVI_DK, KIVI_DV>(); }
int kivi_v3_bits() { return KIVI_BITS; }
int kivi_v3_dk() { return KIVI_DK; }
int kivi_v3_dv() { return KIVI_DV; }

// a: pointers and int64 sizes/strides in the order of kivi_v3::Params (see cuda_kernel.py::_ARGS).
int kivi_v3_launch(const long long* a, double qk_scale, int rows16, int nw, int stages, int row_blocks,
                   int device, void* stream) {
  using namespace kivi_v3;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  Params p;
  int i = 0;
  p.q = reinterpret_cast<const __half*>(a[i++]);
  p.kc = reinterpret_cast<const int*>(a[i++]);
  p.ks = reinterpret_cast<const __half*>(a[i++]);
  p.kz = reinterpret_cast<const __half*>(a[i++]);
  p.vc = reinterpret_cast<const int*>(a[i++]);
  p.vs = reinterpret_cast<const __half*>(a[i++]);
  p.vz = reinterpret_cast<const __half*>(a[i++]);
  p.valid = reinterpret_cast<const uint8_t*>(a[i++]);
  p.po = reinterpret_cast<float*>(a[i++]);
  p.pl = reinterpret_cast<float*>(a[i++]);
  p.q_sb = a[i++]; p.q_sh = a[i++]; p.q_sm = a[i++];
  p.kc_sb = a[i++]; p.kc_sh = a[i++]; p.kc_sg = a[i++];
  p.ks_sb = a[i++]; p.ks_sh = a[i++]; p.ks_sg = a[i++];
  p.kz_sb = a[i++]; p.kz_sh = a[i++]; p.kz_sg = a[i++];
  p.vc_sb = a[i++]; p.vc_sh = a[i++]; p.vc_st = a[i++];
  p.vs_sb = a[i++]; p.vs_sh = a[i++];
  p.vz_sb = a[i++]; p.vz_sh = a[i++];
  p.va_sb = a[i++];
  p.M = (int)a[i++]; p.H = (int)a[i++]; p.NT = (int)a[i++]; p.gshift = (int)a[i++]; p.tps = (int)a[i++];
  p.nsplit = (int)a[i++]; p.ngv = (int)a[i++]; p.gv = (int)a[i++]; p.BH = (int)a[i++];
  p.qk_scale = (float)qk_scale;
  if (nw < 1 || nw > MAX_NW) return (int)cudaErrorInvalidValue;
  const int mt = rows16 ? 16 : 8;
  size_t pipe = (size_t)nw * stages * stage_bytes<KIVI_BITS, KIVI_DK, KIVI_DV>();
  size_t merge = (size_t)nw * mt * (KIVI_DV + 2) * sizeof(float);
  size_t smem = pipe > merge ? pipe : merge;
  dim3 grid(p.nsplit, p.BH, row_blocks);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (rows16) {
    if (stages == 2) return launch_variant<true, 2>(p, nw, grid, smem, s);
    if (stages == 3) return launch_variant<true, 3>(p, nw, grid, smem, s);
    if (stages == 4) return launch_variant<true, 4>(p, nw, grid, smem, s);
  } else {
    if (stages == 2) return launch_variant<false, 2>(p, nw, grid, smem, s);
    if (stages == 3) return launch_variant<false, 3>(p, nw, grid, smem, s);
    if (stages == 4) return launch_variant<false, 4>(p, nw, grid, smem, s);
  }
  return (int)cudaErrorInvalidValue;
}

int kivi_v3_combine_launch(long long po, long long pl, long long out, long long lse, int nsplit, long long rows,
                           int dv, int device, void* stream) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  const long long n = rows * dv;
  const int threads = 256;
  const unsigned blocks = (unsigned)((n + threads - 1) / threads);
  kivi_v3::kivi_v3_combine<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const float*>(po), reinterpret_cast<const float*>(pl), reinterpret_cast<float*>(out),
      reinterpret_cast<float*>(lse), nsplit, rows, dv);
  return (int)cudaGetLastError();
}

const char* kivi_v3_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
