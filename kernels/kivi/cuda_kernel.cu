// Fused KIVI-2/4 decode attention, hand-written CUDA C++ ("v3").  See cuda_kernel.py for the design notes
// (fragment mapping, pipeline); this file holds the device code and extern "C" launchers that take raw
// pointers, so it builds with plain nvcc (no torch headers) and is bound from Python with ctypes.  The copy
// and shared-memory addressing (TileCopier, Layout) is also compiled for the host: kivi_v3_layout_probe
// replays it on the CPU for the tests.
//
// KIVI: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024, arXiv 2402.02750.
//
// Build (one shared library per (bits, Dk, Dv); every row-tile / pipeline-depth variant is instantiated):
//   nvcc -O3 --use_fast_math -lineinfo -std=c++17 -shared -Xcompiler -fPIC \
//        -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
//        -DKIVI_BITS=2 -DKIVI_DK=128 -DKIVI_DV=128 -o libkivi.so cuda_kernel.cu
// The lanes build (a stacked LeanK + KIVI layer's lanes in one launch, lanes_cuda.py) adds -DKIVI_LANES=1 and the
// lanes' kept-channel counts -DKIVI_LANE_DK0=32 -DKIVI_LANE_DK1=64 ..., with KIVI_DK the largest of them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

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
#ifndef KIVI_VFOLD
#define KIVI_VFOLD 0  // 1: value fields as code * s in one HFMA2 (x * s - E * s), the zero point through 1 MMA per k-step
#endif
#ifndef KIVI_PROBE
#define KIVI_PROBE 0  // timing probes (benchmarks/gpu_kivi_profile.py), wrong results: 1 copies only, 2 no P.V,
                      // 3 dequantization as the LOP3 alone
#endif
#ifndef KIVI_PHASES
#define KIVI_PHASES 0  // 1: per-warp phase clocks (benchmarks/gpu_kivi_phases.py); results unchanged, a separate build
#endif
#ifndef KIVI_SOFTCAP
#define KIVI_SOFTCAP 0  // 1: scores are soft-capped (Params::softcap, log2 units) before masking; a separate build,
                        // so the default kernel's code is unchanged
#endif
#ifndef KIVI_QDIM
#define KIVI_QDIM 0  // a lanes build: the query's (and a full-precision buffer's key) head dim, for buffer CTAs in the
                     // lanes launch (kivi_v3_lanes_kernel<ST, true>); 0: the lanes launch reads no buffer
#endif
#ifndef KIVI_LANES
#define KIVI_LANES 0  // 1: also build kivi_v3_lanes_kernel for lanes of KIVI_LANE_DK0 .. KIVI_LANE_DK7 kept channels
#endif
#ifndef KIVI_KFOLD
#define KIVI_KFOLD 0  // 1: key scale folded into the query, offsets / zero points through 2 correction MMAs per slice;
                      // 2: the same, codes centred on the middle code (error like the default, 16 HFMA2 per tile more)
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
  // the live length (0-dim int64 device tensor; nullptr: none): slots at or after min(*len, NT) are neither read nor
  // attended - a split past it writes an empty partial at once (the grid never depends on it: CUDA-graph safe)
  const long long* len;
  int interleave;  // 1: tile j to warp j mod (nsplit * warps); 0: contiguous runs per split (tps tiles) and warp
  // A full-precision buffer read in the same launch (a static layer's sinks + recent ring, kivi_v3_kernel only):
  // CTAs blockIdx.x in [nsplit, nsplit + bsplit) read btps of its bNT slots each and write their partials as splits
  // nsplit.. of po / pl, merged by the same combine.  bk / bv [B, H, bNT, DK / DV] fp16 or bf16 (bbf16), channels
  // dense; bva [B, bNT] bool; blen: its live length (0-dim int64, nullptr: none).  bsplit 0: no buffer.
  const void* bk;
  const void* bv;
  const uint8_t* bva;
  const long long* blen;
  long long bk_sb, bk_sh, bk_st, bv_sb, bv_sh, bv_st, bva_sb;
  int bNT, bsplit, btps, bbf16;
  float qk_scale;  // softmax scale * log2(e)
  float softcap;   // logit soft-cap (Gemma 2) in log2 units: softcap * log2(e); 0 = none
};

// Logit soft-capping (Gemma 2): cap * tanh(x / cap), tanh from one ex2 of -2|x / cap| (exact sign, no overflow).
__device__ __forceinline__ float soft_cap(float x, float cap) {
  const float y = x / cap;
  const float e = exp2f(-2.885390081777927f * fabsf(y));
  return copysignf(cap * ((1.f - e) / (1.f + e)), y);
}

// Slots a read covers: min(*len, NT) with a live length (a 0-dim int64 tensor, read once per CTA), else NT.
__host__ __device__ __forceinline__ int live_slots(const Params& p) {
  if (p.len == nullptr) return p.NT;
  const long long n = *p.len;
  return n <= 0 ? 0 : (n >= p.NT ? p.NT : (int)n);
}

// Pointers of one (batch, kv head) slice.
struct Slice {
  const int* kc;
  const __half* ks;
  const __half* kz;
  const int* vc;
  const __half* vs;
  const __half* vz;
  const uint8_t* va;
  __host__ __device__ __forceinline__ Slice(const Params& p, int b, int h)
      : kc(p.kc + b * p.kc_sb + h * p.kc_sh), ks(p.ks + b * p.ks_sb + h * p.ks_sh),
        kz(p.kz + b * p.kz_sb + h * p.kz_sh), vc(p.vc + b * p.vc_sb + h * p.vc_sh),
        vs(p.vs + b * p.vs_sb + h * p.vs_sh), vz(p.vz + b * p.vz_sb + h * p.vz_sh), va(p.valid + b * p.va_sb) {}
};

template <int BITS, int DK, int DV>
struct Cfg {
  static constexpr int PER = 32 / BITS;          // codes per int32 word
  static constexpr int HP = PER / 2;              // code pairs (fields) per word
  static constexpr int KW = DK / PER;             // key words per token
  static constexpr int KWT = KW / 4;              // whole key words per token a quad lane owns
  // DK not a multiple of 4 words (lanes of a stacked LeanK + KIVI layer: 16, 32, 48, 96 kept channels at 2 bits,
  // 16, 48 at 4): the last RW words are shared by the 4 quad lanes, lane t taking quarter t of each (QP pairs)
  static constexpr int RW = KW % 4;
  static constexpr int QP = HP / 4;               // pairs of a quarter word: 2 at 2 bits, 1 at 4
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
  static_assert(DK % 16 == 0 && DK <= 128, "key channels: a multiple of 16 (k16 slices), at most 128");
  static_assert(RW % 2 == 0 || QP == 2, "4-bit quarter words come in pairs (one k16 slice per two)");
  static_assert(VW >= 4, "value words per token");
  static_assert(STAGE % 16 == 0, "stage alignment");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// one 16-byte copy of which only the first n bytes are read, the rest of the destination zero-filled (n in 0..16)
__device__ __forceinline__ void cp16z(uint32_t dst, const void* src, int n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
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
#if KIVI_PROBE == 3
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(src), "r"(m), "r"(e));
  (void)s; (void)z;
#else
  asm("{\n .reg .b32 t;\n lop3.b32 t, %1, %2, %3, 0xea;\n sub.f16x2 t, t, %3;\n fma.rn.f16x2 %0, t, %4, %5;\n}\n"
      : "=r"(r)
      : "r"(src), "r"(m), "r"(e), "r"(s), "r"(z));
#endif
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

// ---- key-scale fold (KIVI_KFOLD = 1).  A key code field is brought (at most one shift per word and "version") to
// bit KPOS(I) in {4, 6, 8} (2 bits: versions w << 4, w, w >> 6) / 4 (4 bits: w << 4, w, w >> 4, w >> 8), and one LOP3
// (mask | exponent) makes it the exact fp16 E + code with E = 2^(10 - KPOS) <= 64: no HSUB2, no HFMA2.  The
// per-channel scale moves into the B operand (q' = q * s, one HMUL2 per channel pair and tile, the exact product
// rounded once), and
//   S = sum_c q'_c (E_c + code_c) - sum_c q'_c E_c + sum_c q_c z_c,
// the two last terms (the same for every token of the tile) come from 2 MMAs per k16 slice with A = -E constants /
// the zero pairs and B = q' / q, added once to the score accumulators.  E <= 64 keeps the cancelled part small for
// the fp32 accumulation.
template <int BITS>
struct KFold {
  // right shift (negative: left) of field I's version; bit of field I in it
  __host__ __device__ static constexpr int shift(int i) {
    return BITS == 2 ? (i < 2 ? -4 : (i < 5 ? 0 : 6)) : 4 * i - 4;
  }
  __host__ __device__ static constexpr int pos(int i) { return BITS * i - shift(i); }
  // fp16 bits of -E_I = -2^(10 - pos) in both halves
  __host__ __device__ static constexpr uint32_t neg_e2(int i) { return (0x8000u | ((uint32_t)(25 - pos(i)) << 10)) * 0x10001u; }
  // KIVI_KFOLD = 2: -(E_I + MID) with MID = (2^BITS - 1) / 2 (65.5, 17.5, 5.5 / 71.5: exact in fp16), and the zero
  // pairs become z + MID * s, so the rounding of q' multiplies code - MID instead of code (as large as the
  // default's rounding of code * s + z, at 16 HFMA2 per tile)
  static constexpr float MID = ((1 << BITS) - 1) * 0.5f;
  __host__ __device__ static constexpr uint32_t f16_exact(float v) {  // fp16 bits of an exactly representable normal v
    uint32_t sign = v < 0.f ? 0x8000u : 0u;
    float a = v < 0.f ? -v : v;
    int e = 0;
    while (a >= 2.f) { a *= 0.5f; ++e; }
    while (a < 1.f) { a *= 2.f; --e; }
    return sign | ((uint32_t)(e + 15) << 10) | (uint32_t)((a - 1.f) * 1024.f);
  }
  __host__ __device__ static constexpr uint32_t neg_e2_mid(int i) {
    return f16_exact(-((float)(1 << (10 - pos(i))) + MID)) * 0x10001u;
  }
};

// f(c) for the field index I in FIRST, FIRST + STEP, ... equal to i, c a std::integral_constant<int, I> (a field's
// constants are template arguments: decltype(c)::value); the last index takes every other value, as a switch's
// default.  Every caller passes an index of an unrolled loop, so the chain folds away at compile time.
template <int FIRST, int LAST, int STEP = 1, typename F>
__device__ __forceinline__ auto with_field(int i, F&& f) {
  if constexpr (FIRST + STEP > LAST) {
    return f(std::integral_constant<int, FIRST>{});
  } else {
    if (i == FIRST) return f(std::integral_constant<int, FIRST>{});
    return with_field<FIRST + STEP, LAST, STEP>(i, f);
  }
}

// the last field index of a 32-bit word of BITS-bit codes, in pairs (16 / BITS - 1)
template <int BITS>
constexpr int LAST_FIELD = 16 / BITS - 1;

template <int S>
__device__ __forceinline__ uint32_t shifted(uint32_t w) {
  if constexpr (S >= 0) {
    return w >> S;
  } else {
    return w << (-S);
  }
}

// E + code of field I (both halves) in one LOP3
template <int BITS, int I>
__device__ __forceinline__ uint32_t kfield(uint32_t w) {
  using K = KFold<BITS>;
  constexpr int P = K::pos(I);
  constexpr uint32_t MASK = ((((1u << BITS) - 1u) << P) * 0x10001u);
  constexpr uint32_t EXPB = ((uint32_t)(25 - P) << 10) * 0x10001u;
  const uint32_t x = shifted<K::shift(I)>(w);
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(x), "n"(MASK), "n"(EXPB));
  return r;
}

template <int BITS>
__device__ __forceinline__ void kfield2(int i, uint32_t w0, uint32_t w1, uint32_t& r0, uint32_t& r1) {
  with_field<0, LAST_FIELD<BITS>>(i, [&](auto c) {
    constexpr int I = decltype(c)::value;
    r0 = kfield<BITS, I>(w0);
    r1 = kfield<BITS, I>(w1);
  });
}

template <int BITS>
__device__ __forceinline__ uint32_t kneg_e1(int i) {
  return with_field<0, LAST_FIELD<BITS>>(i, [](auto c) { return KFold<BITS>::neg_e2(decltype(c)::value); });
}

template <int BITS>
__device__ __forceinline__ uint32_t kneg_e2m(int i) {
  return with_field<0, LAST_FIELD<BITS>>(i, [](auto c) { return KFold<BITS>::neg_e2_mid(decltype(c)::value); });
}

template <int BITS>
__device__ __forceinline__ uint32_t kneg_e(int i) {
  return KIVI_KFOLD == 2 ? kneg_e2m<BITS>(i) : kneg_e1<BITS>(i);
}

__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// ---- value fold (KIVI_VFOLD = 1).  A value field at its KFold bit gives x = E + code (one LOP3); one HFMA2 with the
// per-token scale pair s and c = -E * s (exact: E is a power of two) gives fp16(code * s) rounded once, so the HSUB2
// goes away.  The zero points are summed by one MMA per P.V k-step (A row g = the lane column's zero pairs, B = P^T)
// into a per-lane accumulator that is added to the output channels of the lane column at the end.
template <int BITS>
__device__ __forceinline__ void vfield2v(int i, uint32_t w, uint32_t s, const uint32_t (&ne)[3], uint32_t& r0,
                                         uint32_t& r1) {
  with_field<0, LAST_FIELD<BITS> - 1, 2>(i, [&](auto c) {
    constexpr int I = decltype(c)::value;
    r0 = hfma2(kfield<BITS, I>(w), s, ne[(KFold<BITS>::pos(I) - 4) / 2]);
    r1 = hfma2(kfield<BITS, I + 1>(w), s, ne[(KFold<BITS>::pos(I + 1) - 4) / 2]);
  });
}

template <int BITS>
__device__ __forceinline__ uint32_t hi_fields(uint32_t w) {
  return w >> (BITS * (10 / BITS));
}

// keys: field I of two tokens' words (A rows g / g+8) with the same scale / zero pair
template <int BITS>
__device__ __forceinline__ void field2(int i, uint32_t w0, uint32_t h0, uint32_t w1, uint32_t h1, uint32_t s,
                                       uint32_t z, uint32_t& r0, uint32_t& r1) {
  with_field<0, LAST_FIELD<BITS>>(i, [&](auto c) {
    constexpr int I = decltype(c)::value;
    r0 = field<BITS, I>(w0, h0, s, z);
    r1 = field<BITS, I>(w1, h1, s, z);
  });
}

// values: fields I and I+1 of one merged (token a, token b) word (A rows g / g+8: n-indices I, I+1)
template <int BITS>
__device__ __forceinline__ void field2v(int i, uint32_t w, uint32_t hw, uint32_t s, uint32_t z, uint32_t& r0,
                                        uint32_t& r1) {
  with_field<0, LAST_FIELD<BITS> - 1, 2>(i, [&](auto c) {
    constexpr int I = decltype(c)::value;
    r0 = field<BITS, I>(w, hw, s, z);
    r1 = field<BITS, I + 1>(w, hw, s, z);
  });
}

// 8x8 b16 transpose across the warp: lane (g, t) gets elements (2t, g), (2t+1, g) of the matrix whose
// (g, 2t..2t+1) it held
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// D = A.B + C, m16n8k16, fp16 in, fp32 accumulate, C and D in the same registers.
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
__host__ __device__ __forceinline__ int vrow(int tok) { return (tok & 7) * 4 + (tok >> 3); }

// Where the compute loop reads a stage (byte offsets from the stage base).  Shared by the kernel and the host
// probe kivi_v3_layout_probe, which replays the copies and these reads on the CPU for the tests.
template <int BITS, int DK, int DV>
struct Layout {
  using C = Cfg<BITS, DK, DV>;
  // 16 bytes: key word t*KWT + jw of tokens 4g .. 4g+3
  __host__ __device__ static int k_words(int g, int t, int jw) { return C::OFF_K + (t * C::KWT + jw) * KROW + 16 * g; }
  // 16 bytes: scale (or zero) pairs 4c .. 4c+3 of key word t*KWT + jw (channel pairs (t*KWT + jw)*HP + ..)
  __host__ __device__ static int k_scales(int t, int jw, int c) { return C::OFF_KS + t * (C::KWT * C::HP * 4) + jw * C::HP * 4 + 16 * c; }
  __host__ __device__ static int k_zeros(int t, int jw, int c) { return C::OFF_KZ + t * (C::KWT * C::HP * 4) + jw * C::HP * 4 + 16 * c; }
  // quarter words (C::RW > 0): 16 bytes of shared key word 4*KWT + q (tokens 4g .. 4g+3); QP * 4 bytes: the scale
  // (zero) pairs of its quarter t, channel pairs (4*KWT + q)*HP + t*QP + ..
  __host__ __device__ static int k_qwords(int g, int q) { return C::OFF_K + (4 * C::KWT + q) * KROW + 16 * g; }
  __host__ __device__ static int k_qscales(int t, int q) { return C::OFF_KS + ((4 * C::KWT + q) * C::HP + t * C::QP) * 4; }
  __host__ __device__ static int k_qzeros(int t, int q) { return C::OFF_KZ + ((4 * C::KWT + q) * C::HP + t * C::QP) * 4; }
  // channel pair of local pair l (0 .. DK/8-1) of quad lane t: the lane's whole words first, then its quarters
  __host__ __device__ static constexpr int key_pair(int t, int l) {
    return l < C::KWT * C::HP ? t * C::KWT * C::HP + l
                              : (4 * C::KWT + (l - C::KWT * C::HP) / C::QP) * C::HP + t * C::QP + (l - C::KWT * C::HP) % C::QP;
  }
  // 4 bytes: valid flags of tokens 4g .. 4g+3
  __host__ __device__ static int valid4(int g) { return C::OFF_VA + 4 * g; }
  // value word `word` of token `tok`
  __host__ __device__ static int v_word(int tok, int word) { return C::OFF_V + vrow(tok) * C::VROW + 4 * word; }
  // first value word of lane column g (NVW words when a token has >= 8, else word g/2 of which half g%2)
  __host__ __device__ static int v_first_word(int g) { return C::VW >= 8 ? g * C::NVW : (g >> 1); }
  __host__ __device__ static int v_group(int g, int gv) { return (v_first_word(g) * C::PER) / gv; }
  // 2 bytes: value scale (zero) of token tok, value group grp
  __host__ __device__ static int v_scale(int tok, int ngv, int grp) { return C::OFF_VS + 2 * (tok * ngv + grp); }
  __host__ __device__ static int v_zero(int tok, int ngv, int grp) { return C::OFF_VZ + 2 * (tok * ngv + grp); }
};

// Issues the cp.async copies of one 32-token tile (keys, key scales / zeros, values, value scales / zeros,
// valid flags) into one pipeline stage.  Chunk `it` of a lane is chunk `lane + 32*it` of a region, so the
// lane's part of every offset is computed once and the rest is a compile-time destination offset plus a
// uniform source stride; all offsets inside one (batch, head) slice are 32-bit.
template <int BITS, int DK, int DV>
struct TileCopier {
  using C = Cfg<BITS, DK, DV>;
  static constexpr int NK = C::KW * 8 / 32;  // key chunks per lane (KW word rows of 8 chunks)
  static constexpr int NK_REM = C::KW * 8 % 32;  // lanes that copy one chunk more (KW not a multiple of 4)
  static constexpr int VCH = C::VW / 4;      // value chunks per token row
  static constexpr int NV = TILE * VCH / 32;  // value chunks per lane
  static_assert((TILE * VCH) % 32 == 0 && DK / 8 <= 32, "chunk counts");
  static_assert((32 / VCH) % 8 == 0, "value chunk rows advance by whole vrow blocks");
  const int* kc;
  const __half* ks;
  const __half* kz;
  const int* vc;
  const __half* vs;
  const __half* vz;
  const uint8_t* va;
  int kc_sg, ks_sg, kz_sg, vc_st, gshift, ngv, lane;
  int live;  // live slots (Params::len bounded by NT): the valid flags of later slots are copied as zeros
  int k_src, k_step, k_dst, v_src, v_step, v_dst;

  __host__ __device__ __forceinline__ TileCopier(const Params& p, const Slice& sp, int lane_)
      : TileCopier(p, sp, (int)p.kc_sg, (int)p.ks_sg, (int)p.kz_sg, (int)p.vc_st, lane_, live_slots(p)) {}
  // a slice with its own group / token strides (a lane of kivi_v3_lanes_kernel)
  __host__ __device__ __forceinline__ TileCopier(const Params& p, const Slice& sp, int kc_sg_, int ks_sg_,
                                                 int kz_sg_, int vc_st_, int lane_, int live_)
      : kc(sp.kc), ks(sp.ks), kz(sp.kz), vc(sp.vc), vs(sp.vs), vz(sp.vz), va(sp.va), kc_sg(kc_sg_), ks_sg(ks_sg_),
        kz_sg(kz_sg_), vc_st(vc_st_), gshift(p.gshift), ngv(p.ngv), lane(lane_), live(live_) {
    k_src = ((lane >> 3) << gshift) + 4 * (lane & 7);  // word row lane/8 (rows are G ints apart), chunk lane%8
    k_step = 4 << gshift;                              // + 4 word rows per chunk round
    k_dst = C::OFF_K + (lane >> 3) * KROW + 16 * (lane & 7);
    v_src = (lane / VCH) * vc_st + 4 * (lane % VCH);
    v_step = (32 / VCH) * vc_st;
    v_dst = C::OFF_V + vrow(lane / VCH) * C::VROW + 16 * (lane % VCH);
  }

  // cp(dst byte offset in the stage, src pointer): one 16-byte copy; cpz(dst, src, n): the same, reading only the
  // first n bytes and zero-filling the rest (the valid flags of the tile holding the last live slot)
  template <class CP, class CPZ>
  __host__ __device__ __forceinline__ void issue(CP&& cp, CPZ&& cpz, int tok0) const {
    const int grp = tok0 >> gshift;
    const int* kt = kc + (grp * kc_sg + (tok0 & ((1 << gshift) - 1)) + k_src);
#pragma unroll
    for (int it = 0; it < NK; ++it) cp(k_dst + it * 4 * KROW, kt + it * k_step);
    if (NK_REM > 0 && lane < NK_REM) cp(k_dst + NK * 4 * KROW, kt + NK * k_step);
    if (lane < DK / 8) {
      cp(C::OFF_KS + 16 * lane, ks + (grp * ks_sg + 8 * lane));
      cp(C::OFF_KZ + 16 * lane, kz + (grp * kz_sg + 8 * lane));
    }
    const int* vt = vc + (tok0 * vc_st + v_src);
#pragma unroll
    for (int it = 0; it < NV; ++it) cp(v_dst + it * (4 / VCH) * C::VROW, vt + it * v_step);
    if (lane < 4 * ngv) {  // TILE * ngv halves, 8 per chunk
      const int o = tok0 * ngv + 8 * lane;
      cp(C::OFF_VS + 16 * lane, vs + o);
      cp(C::OFF_VZ + 16 * lane, vz + o);
    }
    if (lane < 2) {
      const int tok = tok0 + 16 * lane;
      const int n = live - tok;
      cpz(C::OFF_VA + 16 * lane, va + tok, n <= 0 ? 0 : (n >= 16 ? 16 : n));
    }
  }

#ifdef __CUDA_ARCH__
  __device__ __forceinline__ void operator()(uint32_t stage, int tok0) const {
    issue([stage](int dst, const void* src) { cp16(stage + dst, src); },
          [stage](int dst, const void* src, int n) { cp16z(stage + dst, src, n); }, tok0);
  }
#endif
};

// The body of both kernels (kivi_v3_kernel, kivi_v3_lanes_kernel: grid (nsplit, B*H, row blocks of 8), block NW
// warps).  Each warp walks its 32-token tiles (interleaved over the grid's warps, or a contiguous run of the split:
// Params::interleave) through a ST-deep cp.async pipeline, keeps an online softmax in registers, and the warps are
// merged through shared memory at the end.
//
// Transposed products (the GQA rows are the N = 8 side of m16n8k16, tokens / channels the M = 16 side):
//   S^T = K Q^T   A = K [16 tokens x 16 channels], B = Q^T [16 channels x 8 rows], C = S^T [16 tokens x 8 rows]
//   O^T += V^T P^T  A = V^T [16 channels x 16 tokens], B = P^T [16 tokens x 8 rows] (movmatrix of the S^T C
//                   fragment), C = O^T [16 channels x 8 rows]
//
// One CTA: (split blockIdx.x, row block blockIdx.z) of one (batch, kv head) slice `sp`, its query head at
// `qh` (channel c of query row r at qh[r * q_sm + c]), its partial written to output row `bh` (batch * H + head).
// GATHER (kivi_v3_lanes_kernel): the slice keeps DK of the head's channels, `ch` lists them (int64; nullptr: the
// first DK), and the query is gathered here.  `strides`: the slice's key-code group, key-scale group, key-zero group
// and value-code token strides (elements).
// The warp merge's last step, shared by attend() and attend_buffer(): each warp's unnormalised output rows om
// [nw][8][DV], running max mm [nw][8] (log2 units) and sum lm [nw][8] in shared memory become the CTA's normalised
// partial po and natural-log LSE pl of split `split` (a row no warp saw: zeros and -inf).  mm is overwritten (with the
// warps' merge weights) and lm[0][*] (with each row's "has output" flag); every thread of the CTA calls it (it has a
// __syncthreads).
template <int DV>
__device__ __forceinline__ void write_partial(const Params& p, const float* om, float* mm, float* lm, int nw,
                                              int rows, int split, int bh, int rb) {
  constexpr int MT = 8, V4 = DV / 4;
  // one thread per row: its warps' weights exp2(m_w - top) / den replace mm[w][row] in place, and its LSE is written
  // (session 51's phase clocks: recomputing them for every output element took 1.9 us per warp at batch 1)
  if (threadIdx.x < rows) {
    const int row = threadIdx.x;
    float top = -INFINITY;
    for (int w = 0; w < nw; ++w) top = fmaxf(top, mm[w * MT + row]);
    const long long orow = ((long long)split * p.BH + bh) * p.M + rb * MT + row;
    if (top == -INFINITY) {  // no warp saw a valid slot of this row: a zero output (whatever om holds) and LSE -inf
      lm[row] = 0.f;         // warp 0's sum, read above by this thread only: now the row's "has output" flag
      p.pl[orow] = -INFINITY;
    } else {
      float den = 0.f;
      for (int w = 0; w < nw; ++w) {
        const float f = exp2f(mm[w * MT + row] - top);
        mm[w * MT + row] = f;
        den += f * lm[w * MT + row];
      }
      const float inv = 1.f / den;
      for (int w = 0; w < nw; ++w) mm[w * MT + row] *= inv;
      lm[row] = 1.f;
      p.pl[orow] = (top + log2f(den)) * 0.69314718055994531f;
    }
  }
  __syncthreads();
  // four consecutive channels per thread: 16-byte shared-memory reads and global stores
  for (int idx = threadIdx.x; idx < rows * V4; idx += blockDim.x) {
    const int row = idx / V4, c4 = idx - row * V4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int w = 0; w < nw && lm[row] != 0.f; ++w) {
      const float f = mm[w * MT + row];
      const float4 x = *reinterpret_cast<const float4*>(om + (w * MT + row) * DV + 4 * c4);
      o.x += f * x.x; o.y += f * x.y; o.z += f * x.z; o.w += f * x.w;
    }
    const long long orow = ((long long)split * p.BH + bh) * p.M + rb * MT + row;
    *reinterpret_cast<float4*>(p.po + orow * DV + 4 * c4) = o;
  }
}

// Phase clocks, only in a build with -DKIVI_PHASES=1 (benchmarks/gpu_kivi_phases.py; the default build has none of
// this).  Lane 0 of each warp of a region CTA writes, per warp (((z * gridDim.y + y) * gridDim.x + x) * nw + warp):
// slot 0 the global timer at entry, 1 its SM, 2 its tile count, then clock64() at 3 entry, 4 the prologue's copies
// issued, 5 query fragments built, 6 the first tile's copies landed (0 for a warp without tiles), 7 the last tile
// done, 8 the warps merged, 9 the partial written, and slot 10 the global timer at the end.
#if KIVI_PHASES
constexpr int PH_SLOTS = 16;
constexpr long long PH_WARPS = 32768;
__device__ long long kivi_phase_buf[PH_WARPS * PH_SLOTS];
__device__ __forceinline__ void phase_put(int slot, long long v) {
  const long long i = (((long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (blockDim.x >> 5) +
                      (threadIdx.x >> 5);
  if ((threadIdx.x & 31) == 0 && i < PH_WARPS) kivi_phase_buf[i * PH_SLOTS + slot] = v;
}
__device__ __forceinline__ long long phase_timer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ long long phase_smid() {
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return (long long)sm;
}
#define KIVI_PHASE_SET(slot, v) phase_put((slot), (v))
#else
#define KIVI_PHASE_SET(slot, v) do {} while (0)
#endif
#define KIVI_PHASE(slot) KIVI_PHASE_SET((slot), clock64())

// One warp's rows staged in shared memory from row `base` on: o [rows][DV] its unnormalised output (channels in the
// kernel's order), m [rows] its row maxima (log2 units), l [rows] its row sums (reduced over the lanes holding a row);
// lane (g, t) holds rows 2t and 2t + 1 of the warp's 8.  The CTA merge stages every warp's rows this way.
template <typename C, int DV>
__device__ __forceinline__ void stage_warp_rows(const float (&acc)[DV / 16][4], const float (&m_run)[2],
                                                const float (&l_run)[2], int g, int t, float* o, float* m,
                                                float* l, int base) {
  constexpr int NCT = DV / 16;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l_run[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 4);
    lr += __shfl_xor_sync(0xffffffffu, lr, 8);
    lr += __shfl_xor_sync(0xffffffffu, lr, 16);
    const int row = 2 * t + r;
    if (g == 0) {
      m[base + row] = m_run[r];
      l[base + row] = lr;
    }
#pragma unroll
    for (int ct = 0; ct < NCT; ++ct) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {  // channel row g (n-index 2ct) / g+8 (2ct+1)
        const int nt = 2 * ct + hr, u = nt / C::HP, i = nt % C::HP;
        int ch;
        if constexpr (C::VW >= 8) {
          ch = (g * C::NVW + (u >> 1)) * C::PER + 2 * i + (u & 1);
        } else {
          ch = (g >> 1) * C::PER + 2 * i + (g & 1);
        }
        o[(base + row) * DV + ch] = acc[ct][2 * hr + r];
      }
    }
  }
}

template <int BITS, int DK, int DV, int ST, bool GATHER>
// nsplit / tps: the splits sharing the slice's tiles and the tokens of each (the launch's p.nsplit / p.tps; a lane of
// the lanes kernel passes its own, see LaneParams::nsplit).
__device__ __forceinline__ void attend(const Params& p, const Slice& sp, const int (&strides)[4], const __half* qh,
                                       const long long* ch, int bh, int nsplit, int tps) {
  using C = Cfg<BITS, DK, DV>;
  using L = Layout<BITS, DK, DV>;
  constexpr int MT = 8;
  constexpr int NCT = DV / 16;  // output m16 tiles
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, rb = blockIdx.z;
  KIVI_PHASE_SET(0, phase_timer());
  KIVI_PHASE_SET(1, phase_smid());
  KIVI_PHASE_SET(6, 0);
  KIVI_PHASE(3);

  // O^T accumulators: acc[ct][0/1] = (channel row g of m-tile ct, query rows 2t / 2t+1), [2/3] channel row g+8
  float acc[NCT][4];
#pragma unroll
  for (int n = 0; n < NCT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#if KIVI_VFOLD
  float zacc[4] = {0.f, 0.f, 0.f, 0.f};  // [0/1]: sum_t P z (lane column g's value group), query rows 2t / 2t+1
#endif
  float m_run[2] = {-INFINITY, -INFINITY};  // query rows 2t, 2t+1 (log2 units)
  float l_run[2] = {0.f, 0.f};              // lane-local partial sums, reduced over g at the end

  // tiles of this split owned by this warp, up to the tile holding the last live slot (whose later slots' valid
  // flags the copy zero-fills: nothing in the compute loop)
  const int live = live_slots(p);
  const int live_tiles = (live + TILE - 1) / TILE;
  int nmine, tok_next, tstride;  // this warp's tile count, first token, tokens between two of its tiles
  if (p.interleave) {
    // tile j goes to warp j mod W of the grid's W = nsplit * nw warps (warp w of split s is warp s * nw + w):
    // every warp gets its share of the LIVE tiles whatever the live length, so a store read early in a long
    // generation keeps the whole grid busy (contiguous runs sized for the capacity would leave most splits empty)
    const int nwarps = nsplit * nw, r = split * nw + warp;
    nmine = live_tiles > r ? (live_tiles - 1 - r) / nwarps + 1 : 0;
    tok_next = r * TILE;
    tstride = nwarps * TILE;
  } else {  // a contiguous run of the split's tiles per warp, the split's run sized for the capacity
    const int t_begin = split * tps;
    const int ntiles = max(0, min(t_begin + tps, live_tiles * TILE) - t_begin) / TILE;
    const int wbeg = (ntiles * warp) / nw;
    nmine = (ntiles * (warp + 1)) / nw - wbeg;
    tok_next = t_begin + wbeg * TILE;
    tstride = TILE;
  }
  uint8_t* wsm = smem + warp * (ST * C::STAGE);
  const uint32_t wsm_addr = smem_addr(wsm);
  const TileCopier<BITS, DK, DV> copy(p, sp, strides[0], strides[1], strides[2], strides[3], lane, live);

#pragma unroll
  for (int i = 0; i < ST - 1; ++i) {
    if (i < nmine) copy(wsm_addr + i * C::STAGE, tok_next);
    tok_next += tstride;
    cp_commit();
  }
  KIVI_PHASE_SET(2, nmine);
  KIVI_PHASE(4);

  // ---- Q^T B fragments (column g = query row rb*8 + g), pre-scaled by softmax scale * log2(e).  Lane (g, t)
  // owns the channel pairs L::key_pair(t, l) (with DK a multiple of 64 at 2 bits / 32 at 4 bits: channels
  // [t*DK/4, (t+1)*DK/4)): its local pair l = 2s + r is k-pair (2t, 2t+1) (r = 0) or (2t+8, 2t+9) (r = 1) of k16
  // slice s.  The keys use the same channel permutation, so S is unchanged.  Built after the prologue's copies are
  // issued: its global loads wait out the first tile's latency instead of delaying the copies (session 51's phase
  // clocks: 0.8 us per warp at batch 1, before any copy was in flight).
  uint32_t qb[C::NKS][2];
  {
    const int r0 = rb * MT + g;
    const __half* q0 = qh + (long long)r0 * p.q_sm;
    const __half* qt = q0 + t * (DK / 4);  // whole words only: the lane's channels are contiguous
#pragma unroll
    for (int l = 0; l < DK / 8; ++l) {
      uint32_t x0 = 0u;
      if (r0 < p.M) {
        float2 f;
        if constexpr (GATHER) {
          const int c = 2 * L::key_pair(t, l);
          const int c0 = ch ? (int)ch[c] : c, c1 = ch ? (int)ch[c + 1] : c + 1;
          f = make_float2(__half2float(q0[c0]), __half2float(q0[c1]));
        } else if constexpr (C::RW > 0) {
          f = __half22float2(*reinterpret_cast<const __half2*>(q0 + 2 * L::key_pair(t, l)));
        } else {
          f = __half22float2(*reinterpret_cast<const __half2*>(qt + 2 * l));
        }
        x0 = pack_f16x2(f.x * p.qk_scale, f.y * p.qk_scale);
      }
#if KIVI_KFOLD
      qb[2 * (l >> 2) + (l & 1)][(l >> 1) & 1] = x0;  // slice 2c + j, r: local pair 4c + 2r + j
#else
      qb[l >> 1][l & 1] = x0;
#endif
    }
  }

  KIVI_PHASE(5);

  // value constants of this lane column: value group, half selector when a token has 4 value words
  const int vgrp = L::v_group(g, p.gv);
  const uint32_t vsel = (C::VW >= 8 || (g & 1) == 0) ? 0x5410u : 0x7632u;

#if KIVI_KFOLD
  // -E constants of fields 4c .. 4c+3 (the A quads of the correction MMAs).  Equal constants in one quad (e.g.
  // -64, -16, -4, -64) would be one register that ptxas copies into a fresh aligned quad before every MMA (4 MOVs);
  // OR-ing in a different value it cannot prove zero per slot (BH, M, H, NT >= 1, so x >> 31 is 0) makes 8 distinct
  // registers that stay in place
  uint32_t nequad[C::HP / 4][4];
  const uint32_t oz[4] = {(uint32_t)p.BH >> 31, (uint32_t)p.M >> 31, (uint32_t)p.H >> 31, (uint32_t)p.NT >> 31};
#pragma unroll
  for (int c = 0; c < C::HP / 4; ++c) {
#pragma unroll
    for (int j = 0; j < 4; ++j) nequad[c][j] = kneg_e<BITS>(4 * c + j) | oz[j];
  }
#endif
  int st_load = ST - 1, st_use = 0;  // ring positions of the stage being filled / consumed
  for (int it = 0; it < nmine; ++it) {
    if (it + ST - 1 < nmine) copy(wsm_addr + st_load * C::STAGE, tok_next);
    tok_next += tstride;
    st_load = st_load == ST - 1 ? 0 : st_load + 1;
    cp_commit();
    cp_wait<ST - 1>();
    __syncwarp();
    if (it == 0) KIVI_PHASE(6);
    const uint8_t* sb = wsm + st_use * C::STAGE;
    st_use = st_use == ST - 1 ? 0 : st_use + 1;
#if KIVI_PROBE == 1
    __syncwarp();
    continue;
#endif

    // ---- S^T = K Q^T.  m-tile mt: A row g is token 4g + 2mt, row g+8 token 4g + 2mt + 1, so lane g reads
    // tokens 4g..4g+3 of each of its key words as one 16-byte vector.  C: s[mt][0/1] = (token 4g+2mt, query
    // rows 2t / 2t+1), s[mt][2/3] = (token 4g+2mt+1, rows 2t / 2t+1).
    float s[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.f;
#if KIVI_KFOLD
    static_assert(C::RW == 0, "the key-scale fold builds need DK a multiple of 4 key words");
    // corrections: rows g of ca (slices j = 0) / rows g+8 of cb (j = 1) hold -sum q' E + sum q z over the lane's
    // slices of that parity (the other rows: unused cross terms); query rows 2t / 2t+1
    float ca[4] = {0.f, 0.f, 0.f, 0.f}, cb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int jw = 0; jw < C::KWT; ++jw) {
      const uint4 wv = *reinterpret_cast<const uint4*>(sb + L::k_words(g, t, jw));
      const uint32_t wt[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int c = 0; c < C::HP / 4; ++c) {  // scale / zero pairs 4c .. 4c+3 of word jw: slices 2c, 2c+1 of it
        const uint4 ks4 = *reinterpret_cast<const uint4*>(sb + L::k_scales(t, jw, c));
        const uint4 kz4 = *reinterpret_cast<const uint4*>(sb + L::k_zeros(t, jw, c));
        const uint32_t ksc[4] = {ks4.x, ks4.y, ks4.z, ks4.w};
#if KIVI_KFOLD == 2
        constexpr uint32_t MID2 = KFold<BITS>::f16_exact(KFold<BITS>::MID) * 0x10001u;
        const uint32_t zq[4] = {hfma2(ks4.x, MID2, kz4.x), hfma2(ks4.y, MID2, kz4.y), hfma2(ks4.z, MID2, kz4.z),
                                hfma2(ks4.w, MID2, kz4.w)};
#endif
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // slice sl: fields i0 = 4c + j (r = 0), i1 = 4c + 2 + j (r = 1)
          const int sl = (jw * C::HP) / 2 + 2 * c + j, i0 = 4 * c + j, i1 = i0 + 2;
          const uint32_t q0 = hmul2(qb[sl][0], ksc[j]), q1 = hmul2(qb[sl][1], ksc[2 + j]);
          float(&cx)[4] = j == 0 ? ca : cb;
          mma(cx, nequad[c][0], nequad[c][1], nequad[c][2], nequad[c][3], q0, q1);  // - sum q' E
#if KIVI_KFOLD == 2
          mma(cx, zq[0], zq[1], zq[2], zq[3], qb[sl][0], qb[sl][1]);  // + sum q (z + MID s)
#else
          mma(cx, kz4.x, kz4.y, kz4.z, kz4.w, qb[sl][0], qb[sl][1]);  // + sum q z
#endif
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            uint32_t a0, a1, a2, a3;
            kfield2<BITS>(i0, wt[2 * mt], wt[2 * mt + 1], a0, a1);
            kfield2<BITS>(i1, wt[2 * mt], wt[2 * mt + 1], a2, a3);
            mma(s[mt], a0, a1, a2, a3, q0, q1);
          }
        }
      }
    }
    {
      const float c0 = ca[0] + cb[2], c1 = ca[1] + cb[3];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        s[mt][0] += c0; s[mt][1] += c1; s[mt][2] += c0; s[mt][3] += c1;
      }
    }
#else
#pragma unroll
    for (int jw = 0; jw < C::KWT; ++jw) {
      uint32_t ksc[C::HP], kzr[C::HP];  // scale / zero pairs of this word's channel pairs
#pragma unroll
      for (int c = 0; c < C::HP / 4; ++c) {
        const uint4 a = *reinterpret_cast<const uint4*>(sb + L::k_scales(t, jw, c));
        const uint4 z = *reinterpret_cast<const uint4*>(sb + L::k_zeros(t, jw, c));
        ksc[4 * c] = a.x; ksc[4 * c + 1] = a.y; ksc[4 * c + 2] = a.z; ksc[4 * c + 3] = a.w;
        kzr[4 * c] = z.x; kzr[4 * c + 1] = z.y; kzr[4 * c + 2] = z.z; kzr[4 * c + 3] = z.w;
      }
      const uint4 wv = *reinterpret_cast<const uint4*>(sb + L::k_words(g, t, jw));
      const uint32_t wt[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t w0 = wt[2 * mt], w1 = wt[2 * mt + 1];
        const uint32_t h0 = hi_fields<BITS>(w0), h1 = hi_fields<BITS>(w1);
#pragma unroll
        for (int i = 0; i < C::HP; i += 2) {  // local pairs jw*HP + i (r = 0) and + i + 1 (r = 1) of one slice
          const int sl = (jw * C::HP + i) >> 1;
          uint32_t a0, a1, a2, a3;
          field2<BITS>(i, w0, h0, w1, h1, ksc[i], kzr[i], a0, a1);
          field2<BITS>(i + 1, w0, h0, w1, h1, ksc[i + 1], kzr[i + 1], a2, a3);
          mma(s[mt], a0, a1, a2, a3, qb[sl][0], qb[sl][1]);
        }
      }
    }
    if constexpr (C::RW > 0) {  // shared words: quarter t of each, brought to fields 0 .. QP-1 by one shift
      const int qsh = BITS * C::QP * t;  // 4t bits at 2 and 4 bits
#pragma unroll
      for (int q = 0; q < C::RW; q += (C::QP == 2 ? 1 : 2)) {
        // 2 bits: quarter word q = one k16 slice (its pairs 0 / 1 = r 0 / 1); 4 bits: words q, q+1 (r 0 / 1)
        constexpr int NQ = C::QP == 2 ? 1 : 2;
        uint32_t wq[NQ][4], sq[2], zq[2];
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
          const uint4 wv = *reinterpret_cast<const uint4*>(sb + L::k_qwords(g, q + j));
          wq[j][0] = wv.x >> qsh; wq[j][1] = wv.y >> qsh; wq[j][2] = wv.z >> qsh; wq[j][3] = wv.w >> qsh;
        }
        if constexpr (C::QP == 2) {
          const uint2 a = *reinterpret_cast<const uint2*>(sb + L::k_qscales(t, q));
          const uint2 z = *reinterpret_cast<const uint2*>(sb + L::k_qzeros(t, q));
          sq[0] = a.x; sq[1] = a.y; zq[0] = z.x; zq[1] = z.y;
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            sq[j] = *reinterpret_cast<const uint32_t*>(sb + L::k_qscales(t, q + j));
            zq[j] = *reinterpret_cast<const uint32_t*>(sb + L::k_qzeros(t, q + j));
          }
        }
        const int sl = (C::KWT * C::HP + q * C::QP) >> 1;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t a0, a1, a2, a3;
          if constexpr (C::QP == 2) {  // fields 0 (r = 0) and 1 (r = 1) of the shifted word
            a0 = deq<BITS, 0>(wq[0][2 * mt], sq[0], zq[0]);
            a1 = deq<BITS, 0>(wq[0][2 * mt + 1], sq[0], zq[0]);
            a2 = deq<BITS, BITS>(wq[0][2 * mt], sq[1], zq[1]);
            a3 = deq<BITS, BITS>(wq[0][2 * mt + 1], sq[1], zq[1]);
          } else {  // field 0 of word q (r = 0) and of word q+1 (r = 1)
            a0 = deq<BITS, 0>(wq[0][2 * mt], sq[0], zq[0]);
            a1 = deq<BITS, 0>(wq[0][2 * mt + 1], sq[0], zq[0]);
            a2 = deq<BITS, 0>(wq[1][2 * mt], sq[1], zq[1]);
            a3 = deq<BITS, 0>(wq[1][2 * mt + 1], sq[1], zq[1]);
          }
          mma(s[mt], a0, a1, a2, a3, qb[sl][0], qb[sl][1]);
        }
      }
    }
#endif

    // ---- (logit soft-cap) + mask + online softmax (base 2) per query row (2t, 2t+1); lane-local sums
    const uint32_t vb = *reinterpret_cast<const uint32_t*>(sb + L::valid4(g));  // tokens 4g..4g+3
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // e: token 4g + 2mt + e
        const bool ok = ((vb >> (8 * (2 * mt + e))) & 0xffu) != 0u;
#if KIVI_SOFTCAP  // a build for models with logit soft-capping (Gemma 2): s = cap * tanh(s / cap) in log2 units
        s[mt][2 * e] = soft_cap(s[mt][2 * e], p.softcap);
        s[mt][2 * e + 1] = soft_cap(s[mt][2 * e + 1], p.softcap);
#endif
        s[mt][2 * e] = ok ? s[mt][2 * e] : -INFINITY;
        s[mt][2 * e + 1] = ok ? s[mt][2 * e + 1] : -INFINITY;
        mx[0] = fmaxf(mx[0], s[mt][2 * e]);
        mx[1] = fmaxf(mx[1], s[mt][2 * e + 1]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 4));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 8));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 16));
    }
    if (__any_sync(0xffffffffu, mx[0] > m_run[0] || mx[1] > m_run[1])) {  // lazy rescale
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float mn = fmaxf(m_run[r], mx[r]);
        const float alpha = mn == -INFINITY ? 1.f : exp2f(m_run[r] - mn);
        l_run[r] *= alpha;
#pragma unroll
        for (int n = 0; n < NCT; ++n) {
          acc[n][r] *= alpha;
          acc[n][r + 2] *= alpha;
        }
#if KIVI_VFOLD
        zacc[r] *= alpha;
#endif
        m_run[r] = mn;
      }
    }
    // P^T B fragments of P.V step kk (= score m-tile kk): movmatrix.trans of the two 8x8 blocks of the S^T C
    // fragment gives lane (g, t): b0 = (tokens 8t+2kk, 8t+4+2kk; query row g), b1 = (8t+2kk+1, 8t+5+2kk; row g)
    uint32_t pb[2][2];
    {
      const float ms0 = m_run[0] == -INFINITY ? 0.f : m_run[0];
      const float ms1 = m_run[1] == -INFINITY ? 0.f : m_run[1];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p0 = exp2f(s[mt][2 * e] - ms0), p1 = exp2f(s[mt][2 * e + 1] - ms1);
          l_run[0] += p0;
          l_run[1] += p1;
          pb[mt][e] = movmatrix_trans(pack_f16x2(p0, p1));
        }
      }
    }

    // ---- O^T += V^T P^T.  A row g / g+8 of m-tile ct = value channels of n-index 2ct / 2ct+1 of this lane
    // column; A k-pairs (2t, 2t+1) / (2t+8, 2t+9) = tokens (8t+2kk, 8t+4+2kk) / (8t+2kk+1, 8t+5+2kk).  A PRMT
    // puts the same 16-bit half of two tokens' words into one register, so every field of it is a
    // (token a, token b) pair of one channel: LOP3 + HSUB2 + HFMA2 with the per-token scale / zero pair.
#if KIVI_PROBE != 2
    {
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t bw[2][C::NU];  // [token pair r][unit]: merged words
        uint32_t bs[2], bz[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int ta = 8 * t + 2 * kk + r, tb = ta + 4;
          const uint32_t sa = *reinterpret_cast<const uint16_t*>(sb + L::v_scale(ta, p.ngv, vgrp));
          const uint32_t sbv = *reinterpret_cast<const uint16_t*>(sb + L::v_scale(tb, p.ngv, vgrp));
          const uint32_t za = *reinterpret_cast<const uint16_t*>(sb + L::v_zero(ta, p.ngv, vgrp));
          const uint32_t zb = *reinterpret_cast<const uint16_t*>(sb + L::v_zero(tb, p.ngv, vgrp));
          bs[r] = sa | (sbv << 16);
          bz[r] = za | (zb << 16);
          const int w0 = L::v_first_word(g);
          if constexpr (C::VW >= 8) {
            uint32_t wa[C::NVW], wb[C::NVW];
            if constexpr (C::NVW == 2) {
              const uint2 xa = *reinterpret_cast<const uint2*>(sb + L::v_word(ta, w0));
              const uint2 xb = *reinterpret_cast<const uint2*>(sb + L::v_word(tb, w0));
              wa[0] = xa.x; wa[1] = xa.y; wb[0] = xb.x; wb[1] = xb.y;
            } else {
#pragma unroll
              for (int w = 0; w < C::NVW; ++w) {
                wa[w] = *reinterpret_cast<const uint32_t*>(sb + L::v_word(ta, w0 + w));
                wb[w] = *reinterpret_cast<const uint32_t*>(sb + L::v_word(tb, w0 + w));
              }
            }
#pragma unroll
            for (int w = 0; w < C::NVW; ++w) {
              bw[r][2 * w] = prmt(wa[w], wb[w], 0x5410u);
              bw[r][2 * w + 1] = prmt(wa[w], wb[w], 0x7632u);
            }
          } else {
            const uint32_t wa = *reinterpret_cast<const uint32_t*>(sb + L::v_word(ta, w0));
            const uint32_t wb = *reinterpret_cast<const uint32_t*>(sb + L::v_word(tb, w0));
            bw[r][0] = prmt(wa, wb, vsel);
          }
        }
#if KIVI_VFOLD
        // -E * s per distinct field position (2 bits: E = 64, 16, 4; 4 bits: 64) and token pair
        uint32_t ne[2][3];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int k = 0; k < (BITS == 2 ? 3 : 1); ++k) {  // fp16 -2^(10 - pos), pos = 4 + 2k, in both halves
            ne[r][k] = hmul2(bs[r], (0x8000u | ((uint32_t)(25 - (4 + 2 * k)) << 10)) * 0x10001u);
          }
          if constexpr (BITS != 2) ne[r][1] = ne[r][2] = ne[r][0];
        }
        mma(zacc, bz[0], bs[0], bz[1], bs[1], pb[kk][0], pb[kk][1]);  // row g: sum_t P z; row g+8 (unused): sum P s
#pragma unroll
        for (int u = 0; u < C::NU; ++u) {
          const uint32_t w0 = bw[0][u], w1 = bw[1][u];
#pragma unroll
          for (int i = 0; i < C::HP; i += 2) {  // n-index u*HP + i -> m-tile (u*HP + i) / 2, rows g / g+8
            uint32_t a0, a1, a2, a3;
            vfield2v<BITS>(i, w0, bs[0], ne[0], a0, a1);
            vfield2v<BITS>(i, w1, bs[1], ne[1], a2, a3);
            mma(acc[(u * C::HP + i) >> 1], a0, a1, a2, a3, pb[kk][0], pb[kk][1]);
          }
        }
#else
#pragma unroll
        for (int u = 0; u < C::NU; ++u) {
          const uint32_t w0 = bw[0][u], w1 = bw[1][u];
          const uint32_t h0 = hi_fields<BITS>(w0), h1 = hi_fields<BITS>(w1);
#pragma unroll
          for (int i = 0; i < C::HP; i += 2) {  // n-index u*HP + i -> m-tile (u*HP + i) / 2, rows g / g+8
            uint32_t a0, a1, a2, a3;
            field2v<BITS>(i, w0, h0, bs[0], bz[0], a0, a1);  // token pair r = 0: n-index i (row g), i+1 (g+8)
            field2v<BITS>(i, w1, h1, bs[1], bz[1], a2, a3);  // token pair r = 1
            mma(acc[(u * C::HP + i) >> 1], a0, a1, a2, a3, pb[kk][0], pb[kk][1]);
          }
        }
#endif
      }
    }
#else
    acc[0][0] += __uint_as_float(pb[0][0] ^ pb[1][1]);
#endif
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_wait<0>();
  KIVI_PHASE(7);

#if KIVI_VFOLD
#pragma unroll
  for (int n = 0; n < NCT; ++n) {  // rows g and g+8 of every output m-tile are channels of lane column g's group
    acc[n][0] += zacc[0]; acc[n][2] += zacc[0];
    acc[n][1] += zacc[1]; acc[n][3] += zacc[1];
  }
#endif
  // ---- merge the warps (shared memory), normalise, write the split partial
  __syncthreads();
  float* om = reinterpret_cast<float*>(smem);  // [nw][MT][DV]
  float* mm = om + nw * MT * DV;               // [nw][MT]
  float* lm = mm + nw * MT;                    // [nw][MT]
  stage_warp_rows<C, DV>(acc, m_run, l_run, g, t, om, mm, lm, warp * MT);
  __syncthreads();
  KIVI_PHASE(8);
  const int rows = min(MT, p.M - rb * MT);
  write_partial<DV>(p, om, mm, lm, nw, rows, split, bh, rb);
  KIVI_PHASE(9);
  KIVI_PHASE_SET(10, phase_timer());
}

// The 16 bits of an fp16 / bf16 element, and their float value: a value loaded ahead is kept as its bits, so no
// instruction uses it - and the warp does not wait for it - until it is converted.
__device__ __forceinline__ unsigned short load_bits(const void* base, long long i) {
  return reinterpret_cast<const unsigned short*>(base)[i];
}
__device__ __forceinline__ float bits_f(unsigned short x, int bf16) {
  return bf16 ? __uint_as_float((unsigned)x << 16) : __half2float(__ushort_as_half(x));
}

// One CTA of the full-precision buffer (Params::bk): slots [j * btps, (j + 1) * btps) of slice (b, h), row block
// blockIdx.z, written as split blockIdx.x.  SIMT: a buffer is a few hundred slots (sinks + the recent window), read
// once per step; the launch it shares is what counts.  Lane l holds channels [l * DK / 32, (l + 1) * DK / 32) of the
// query rows and [l * DV / 32, ...) of the output; warp w takes slots w, w + nw, ... (the valid ones, each loaded one
// slot ahead) and scores the block's live query rows (3 of the 8 at SmolLM2's 9 / 3 heads, 4 at Llama's 32 / 8); the
// warps merge through shared memory as attend() does (same buffers: launch_smem covers them).
template <int DK, int DV>
__device__ __forceinline__ void attend_buffer(const Params& p, int b, int h, int bh, int j) {
  constexpr int MT = 8, CK = DK / 32, CV = DV / 32;
  static_assert(DK % 64 == 0 && DV % 32 == 0, "buffer read: key dims a multiple of 64, value dims of 32");
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int split = blockIdx.x, rb = blockIdx.z;
  const int rows = min(MT, p.M - rb * MT);
  int n = p.bNT;
  if (p.blen != nullptr) {
    const long long live = *p.blen;
    n = live <= 0 ? 0 : (live >= n ? n : (int)live);
  }
  const int t0 = j * p.btps, t1 = min(t0 + p.btps, n);
  // the query rows pre-scaled by scale * log2(e) and held as fp16 pairs (as the region's MMA operands are): half
  // the registers of fp32, so the buffer path fits the register caps of the min_blocks builds without spilling
  __half2 q[MT][CK / 2];
  const __half* qh = p.q + b * p.q_sb + h * p.q_sh;
#pragma unroll
  for (int r = 0; r < MT; ++r) {
#pragma unroll
    for (int c = 0; c < CK / 2; ++c) {
      float2 f = make_float2(0.f, 0.f);
      if (r < rows) {
        f = __half22float2(*reinterpret_cast<const __half2*>(qh + (long long)(rb * MT + r) * p.q_sm + lane * CK + 2 * c));
      }
      q[r][c] = __floats2half2_rn(f.x * p.qk_scale, f.y * p.qk_scale);
    }
  }
  float m[MT], l[MT], acc[MT][CV];
#pragma unroll
  for (int r = 0; r < MT; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < CV; ++c) acc[r][c] = 0.f;
  }
  const uint8_t* va = p.bva + b * p.bva_sb;
  const long long kb = b * p.bk_sb + h * p.bk_sh + lane * CK, vb = b * p.bv_sb + h * p.bv_sh + lane * CV;
  float kf[CK], vf[CV];
  unsigned short kn[CK], vn[CV];  // the next slot's key and value, as loaded (converted once they are needed)
  auto load_slot = [&](int t) {
#pragma unroll
    for (int c = 0; c < CK; ++c) kn[c] = load_bits(p.bk, kb + t * p.bk_st + c);
#pragma unroll
    for (int c = 0; c < CV; ++c) vn[c] = load_bits(p.bv, vb + t * p.bv_st + c);
  };
  auto take_slot = [&]() {
#pragma unroll
    for (int c = 0; c < CK; ++c) kf[c] = bits_f(kn[c], p.bbf16);
#pragma unroll
    for (int c = 0; c < CV; ++c) vf[c] = bits_f(vn[c], p.bbf16);
  };
  // Warp w reads slots t0 + w, t0 + w + nw, ... in order, 32 at a time: one load per lane gives the valid flags of
  // 32 of them (a ballot: the same mask in every lane, so every branch below is uniform), and the next valid slot's
  // key and value are loaded before the current one is scored - one memory round trip per slot overlapped with the
  // previous slot's arithmetic, where each slot used to wait for its flag, then for its key and value.  The slots are
  // taken in the same order with the same arithmetic: the partial is the same bit for bit.
  for (int base = t0 + warp; base < t1; base += 32 * nw) {
    const int mine = base + lane * nw;
    unsigned left = __ballot_sync(0xffffffffu, mine < t1 && va[mine] != 0);
    if (left == 0) continue;
    load_slot(base + (__ffs(left) - 1) * nw);
    left &= left - 1;
    while (true) {
      take_slot();
      const bool more = left != 0;
      if (more) {
        load_slot(base + (__ffs(left) - 1) * nw);
        left &= left - 1;
      }
#pragma unroll
      for (int r = 0; r < MT; ++r) {
        if (r >= rows) continue;  // the block's live query rows only (uniform: write_partial reads no other row)
        float sc = 0.f;
#pragma unroll
        for (int c = 0; c < CK / 2; ++c) {
          const float2 qf = __half22float2(q[r][c]);
          sc = fmaf(qf.x, kf[2 * c], fmaf(qf.y, kf[2 * c + 1], sc));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
#if KIVI_SOFTCAP
        sc = soft_cap(sc, p.softcap);
#endif
        const float mn = fmaxf(m[r], sc), a = exp2f(m[r] - mn), pr = exp2f(sc - mn);
        l[r] = l[r] * a + pr;
#pragma unroll
        for (int c = 0; c < CV; ++c) acc[r][c] = fmaf(acc[r][c], a, pr * vf[c]);
        m[r] = mn;
      }
      if (!more) break;
    }
  }
  float* om = reinterpret_cast<float*>(smem);  // [nw][MT][DV]
  float* mm = om + nw * MT * DV;               // [nw][MT]
  float* lm = mm + nw * MT;                    // [nw][MT]
#pragma unroll
  for (int r = 0; r < MT; ++r) {
#pragma unroll
    for (int c = 0; c < CV; ++c) om[(warp * MT + r) * DV + lane * CV + c] = acc[r][c];
    if (lane == 0) {
      mm[warp * MT + r] = m[r];
      lm[warp * MT + r] = l[r];
    }
  }
  __syncthreads();
  write_partial<DV>(p, om, mm, lm, nw, rows, split, bh, rb);
}

// grid (nsplit + bsplit, B*H, row blocks of 8), block NW warps: one (batch, kv head) slice of one packed region per
// CTA row; with BUF (a separate instantiation, so the plain kernel's code and registers are unchanged) the last
// bsplit CTAs of a row read the full-precision buffer (Params::bk) instead.
// Programmatic dependent launch (sm_90+): a split kernel's CTAs let the combine after it (launched with the PDL
// attribute) start as they start; the combine waits for the split kernel before it touches memory.  Both are no-ops
// without PDL, and compile to nothing below sm_90.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <int BITS, int DK, int DV, int ST, bool BUF>
__global__ void __launch_bounds__(MAX_NW * 32, KIVI_MIN_BLOCKS) kivi_v3_kernel(const Params p) {
  pdl_trigger();
  const int bh = blockIdx.y;
  const int b = bh / p.H, h = bh - b * p.H;
  // (the launcher refuses a buffer for other widths, and under the register cap of min_blocks > 4, where the buffer
  // path would spill)
  if constexpr (BUF && DK % 64 == 0 && DV % 32 == 0 && KIVI_MIN_BLOCKS <= 4) {
    if ((int)blockIdx.x >= p.nsplit) {
      attend_buffer<DK, DV>(p, b, h, bh, blockIdx.x - p.nsplit);
      return;
    }
  }
  const Slice sp(p, b, h);
  const int strides[4] = {(int)p.kc_sg, (int)p.ks_sg, (int)p.kz_sg, (int)p.vc_st};
  attend<BITS, DK, DV, ST, false>(p, sp, strides, p.q + b * p.q_sb + h * p.q_sh, nullptr, bh, p.nsplit, p.tps);
}

#if KIVI_LANES
// ---- KIVI lanes (a stacked LeanK + KIVI layer, kvcompress.kernels.kivi.lanes_reference): every lane holds some of
// the region's kv heads with DK of their channels kept (its own packed payload), all lanes share the token slots.
// One launch reads all of them: grid (nsplit, B*H, row blocks of 8) over the REGION's heads; the CTA of head h finds
// its lane and row in the lanes' head lists and runs the body specialised for that lane's DK (the DKs this library
// was built for: KIVI_LANE_DK0..7); a head no lane holds writes LSE -inf and zeros, so the split merge needs nothing
// else.  The lanes hold disjoint heads (the host checks it once per region).
constexpr int MAX_LANES = 8;

struct LaneParams {
  const int* kc;
  const __half* ks;
  const __half* kz;
  const int* vc;
  const __half* vs;
  const __half* vz;
  const long long* ch;  // [heads of the lane, ch_sh] kept query channels (int64); nullptr: the first dk
  long long ch_sh;
  const long long* heads;  // [nheads] the region heads the lane holds (int64); nullptr: heads 0 .. nheads-1
  long long nheads;
  long long kc_sb, kc_sh, kc_sg, ks_sb, ks_sh, ks_sg, kz_sb, kz_sh, kz_sg, vc_sb, vc_sh, vc_st, vs_sb, vs_sh, vz_sb,
      vz_sh;
  int dk;
  // the region's splits this lane's heads use (1 .. Params::nsplit; the CTAs of its heads after them write empty
  // partials) and the tokens of each: a lane of fewer kept channels costs less per tile, so the host can give it
  // fewer, longer splits and the wider lanes more (lanes_cuda._plan, configuration lane_balance) - without it every
  // lane has the launch's nsplit / tps and the CTAs of a narrow lane finish early while the widest set the span
  int nsplit, tps;
};

struct LanesParams {
  Params p;  // the region: query, valid, outputs, M, H (region heads), NT, group, splits, value groups, BH = B*H
  LaneParams lane[MAX_LANES];
  int nlanes;
};

__device__ __forceinline__ void write_empty(const Params& p, int bh) {
  const int rows = min(8, p.M - (int)blockIdx.z * 8);
  const long long orow = ((long long)blockIdx.x * p.BH + bh) * p.M + blockIdx.z * 8;
  for (int i = threadIdx.x; i < rows * KIVI_DV; i += blockDim.x) p.po[orow * KIVI_DV + i] = 0.f;
  for (int i = threadIdx.x; i < rows; i += blockDim.x) p.pl[orow + i] = -INFINITY;
}

template <int DK, int ST>
__device__ __forceinline__ void attend_lane(const LanesParams& lp, const LaneParams& ln, int b, int row, int h,
                                            int bh) {
  const Params& p = lp.p;
  Slice sp(p, b, 0);  // the region's valid row; the payload pointers are the lane's
  sp.kc = ln.kc + b * ln.kc_sb + row * ln.kc_sh;
  sp.ks = ln.ks + b * ln.ks_sb + row * ln.ks_sh;
  sp.kz = ln.kz + b * ln.kz_sb + row * ln.kz_sh;
  sp.vc = ln.vc + b * ln.vc_sb + row * ln.vc_sh;
  sp.vs = ln.vs + b * ln.vs_sb + row * ln.vs_sh;
  sp.vz = ln.vz + b * ln.vz_sb + row * ln.vz_sh;
  const int strides[4] = {(int)ln.kc_sg, (int)ln.ks_sg, (int)ln.kz_sg, (int)ln.vc_st};
  attend<KIVI_BITS, DK, KIVI_DV, ST, true>(p, sp, strides, p.q + b * p.q_sb + h * p.q_sh,
                                           ln.ch ? ln.ch + row * ln.ch_sh : nullptr, bh, ln.nsplit, ln.tps);
}

// With BUF (a separate instantiation: the lanes kernel without a buffer keeps its code and registers) the last
// bsplit CTAs of a row read the full-precision buffer (Params::bk, all KIVI_QDIM channels of every region head), as
// kivi_v3_kernel<..., true> does, and write their partials as splits nsplit.. for the same combine.
constexpr bool lanes_buffer_ok = KIVI_QDIM > 0 && KIVI_QDIM % 64 == 0 && KIVI_DV % 32 == 0 && KIVI_MIN_BLOCKS <= 4;

template <int ST, bool BUF>
__global__ void __launch_bounds__(MAX_NW * 32, KIVI_MIN_BLOCKS) kivi_v3_lanes_kernel(
    const __grid_constant__ LanesParams lp) {
  pdl_trigger();
  const int bh = blockIdx.y;
  const int b = bh / lp.p.H, h = bh - b * lp.p.H;
  if constexpr (BUF && lanes_buffer_ok) {
    if ((int)blockIdx.x >= lp.p.nsplit) {
      attend_buffer<(lanes_buffer_ok ? KIVI_QDIM : 64), KIVI_DV>(lp.p, b, h, bh, blockIdx.x - lp.p.nsplit);
      return;
    }
  }
  // the lane holding head h and its row there, looked up on the device (the head lists stay device tensors: nothing
  // is read on the host per call, so a call captured into a CUDA graph with copied inputs needs no host read)
  __shared__ int found[2];
  if (threadIdx.x == 0) found[0] = -1;
  __syncthreads();
  for (int l = 0; l < lp.nlanes; ++l) {
    const LaneParams& cand = lp.lane[l];
    if (cand.heads == nullptr) {
      if (threadIdx.x == 0 && h < cand.nheads) { found[0] = l; found[1] = h; }
    } else {
      for (int i = threadIdx.x; i < cand.nheads; i += blockDim.x) {
        if (cand.heads[i] == h) { found[0] = l; found[1] = i; }
      }
    }
  }
  __syncthreads();
  const int li = found[0], row = found[1];
  if (li < 0) {
    write_empty(lp.p, bh);
    return;
  }
  const LaneParams& ln = lp.lane[li];
  if ((int)blockIdx.x >= ln.nsplit) {  // a split this lane does not use
    write_empty(lp.p, bh);
    return;
  }
#define KIVI_LANE_CASE(D) \
  case D:                 \
    attend_lane<D, ST>(lp, ln, b, row, h, bh); \
    return;
  switch (ln.dk) {
#ifdef KIVI_LANE_DK0
    KIVI_LANE_CASE(KIVI_LANE_DK0)
#endif
#ifdef KIVI_LANE_DK1
    KIVI_LANE_CASE(KIVI_LANE_DK1)
#endif
#ifdef KIVI_LANE_DK2
    KIVI_LANE_CASE(KIVI_LANE_DK2)
#endif
#ifdef KIVI_LANE_DK3
    KIVI_LANE_CASE(KIVI_LANE_DK3)
#endif
#ifdef KIVI_LANE_DK4
    KIVI_LANE_CASE(KIVI_LANE_DK4)
#endif
#ifdef KIVI_LANE_DK5
    KIVI_LANE_CASE(KIVI_LANE_DK5)
#endif
#ifdef KIVI_LANE_DK6
    KIVI_LANE_CASE(KIVI_LANE_DK6)
#endif
#ifdef KIVI_LANE_DK7
    KIVI_LANE_CASE(KIVI_LANE_DK7)
#endif
    default:
      write_empty(lp.p, bh);  // not reached: the host checks every lane's dk against the build
  }
#undef KIVI_LANE_CASE
}
#endif  // KIVI_LANES

// The merged output stored as OutT: float, or rounded once to the read's fp16 / bf16 (a read whose only part this is
// needs no cast launch after it).
__device__ __forceinline__ void store_out(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_out(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// Merge nsplit partials [S, R, DV] / [S, R] (R = B*H*M rows) into out [R, DV] (OutT) / lse [R] by log-sum-exp.
// One CTA of 8 warps per row: the warps stride over the splits (one coalesced DV-float row per split and warp),
// so a long split list is read with 8-way parallelism instead of one serial loop per output element.
template <int DV, typename OutT>
__global__ void __launch_bounds__(256) kivi_v3_combine(const float* __restrict__ po, const float* __restrict__ pl,
                                                       OutT* __restrict__ out, float* __restrict__ lse, int nsplit,
                                                       long long R) {
  constexpr int NWC = 8, PERL = DV / 32;
  static_assert(PERL == 2 || PERL == 4, "DV 64 or 128");
  __shared__ float red[NWC];
  __shared__ float part[NWC][DV];
  const long long row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  pdl_wait();  // launched with PDL: the split kernel may still run; nothing is read or written before it is done
  float top = -INFINITY;
  for (int s = tid; s < nsplit; s += NWC * 32) top = fmaxf(top, pl[s * R + row]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  if (lane == 0) red[warp] = top;
  __syncthreads();
  top = red[0];
#pragma unroll
  for (int w = 1; w < NWC; ++w) top = fmaxf(top, red[w]);
  if (top == -INFINITY) {  // no valid key in any split
    if (tid < DV) store_out(out + row * DV + tid, 0.f);
    if (tid == 0) lse[row] = -INFINITY;
    return;
  }
  __syncthreads();  // everyone has read red[] before it is reused
  float acc[PERL];
#pragma unroll
  for (int i = 0; i < PERL; ++i) acc[i] = 0.f;
  float den = 0.f;
#pragma unroll 4
  for (int s = warp; s < nsplit; s += NWC) {
    const float w = __expf(pl[s * R + row] - top);
    den += w;
    const float* src = po + (s * R + row) * DV + lane * PERL;
    if constexpr (PERL == 4) {
      const float4 v = *reinterpret_cast<const float4*>(src);
      acc[0] += w * v.x; acc[1] += w * v.y; acc[2] += w * v.z; acc[3] += w * v.w;
    } else {
      const float2 v = *reinterpret_cast<const float2*>(src);
      acc[0] += w * v.x; acc[1] += w * v.y;
    }
  }
#pragma unroll
  for (int i = 0; i < PERL; ++i) part[warp][lane * PERL + i] = acc[i];
  if (lane == 0) red[warp] = den;
  __syncthreads();
  float d = 0.f;
#pragma unroll
  for (int w = 0; w < NWC; ++w) d += red[w];
  if (tid < DV) {
    float num = 0.f;
#pragma unroll
    for (int w = 0; w < NWC; ++w) num += part[w][tid];
    store_out(out + row * DV + tid, num / d);
  }
  if (tid == 0) lse[row] = top + __logf(d);
}

template <int BITS, int DK, int DV>
constexpr int stage_bytes() {
  return Cfg<BITS, DK, DV>::STAGE;
}

// Dynamic shared memory the launcher requests for nw warps x stages: the pipeline buffers, or the warp-merge
// buffers reusing them at the end, whichever is larger (cuda_kernel.py::launch_smem mirrors this).
inline size_t launch_smem(int nw, int stages) {
  const size_t pipe = (size_t)nw * stages * stage_bytes<KIVI_BITS, KIVI_DK, KIVI_DV>();
  const size_t merge = (size_t)nw * 8 * (KIVI_DV + 2) * sizeof(float);
  return pipe > merge ? pipe : merge;
}

constexpr int MAX_DEVICES = 64;
constexpr size_t DEFAULT_SMEM = 48 * 1024;  // above this a kernel needs cudaFuncAttributeMaxDynamicSharedMemorySize

// Per (pipeline depth, device): the dynamic shared-memory limit already raised for this library's kernel.
// Internal linkage on purpose.  The first version kept this in a function-local `static` of the template
// launch_variant<ST>: g++ emits such a variable as an STB_GNU_UNIQUE symbol, which the dynamic linker binds
// to ONE instance across every loaded library even with RTLD_LOCAL, so after the (4-bit, 128, 128) library
// raised its kernel's limit to 71040 bytes every other library skipped cudaFuncSetAttribute for requests
// below that and its launch failed with "invalid argument" (the H200 run's (4, 128, 64) M = 12, 4-bit
// dk 64 / dv 128 and min_blocks = 1 failures).  The libraries are also built with -fvisibility=hidden.
namespace {
size_t g_smem_set[4][3][MAX_DEVICES];  // [kivi_v3_kernel / kivi_v3_lanes_kernel / each with a buffer][stages - 2][device]
}

// nw / stages in range and their dynamic shared memory (`*smem`) within the device's opt-in limit: 0, else the error.
inline int check_launch(int nw, int stages, int device, size_t* smem) {
  if (nw < 1 || nw > MAX_NW || stages < 2 || stages > 4) return (int)cudaErrorInvalidValue;
  *smem = launch_smem(nw, stages);
  int limit = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return (int)e;
  return *smem > (size_t)limit ? (int)cudaErrorInvalidConfiguration : 0;  // the Python side never asks for more
}

// Launches `kern` (kernel kind `kind`, pipeline depth `st`) with `smem` bytes of dynamic shared memory, raising the
// kernel's limit first when that is above 48 KB (once per library, kind, depth and device).
template <class P>
int launch_variant(void (*kern)(P), const P& params, int kind, int st, int nw, dim3 grid, size_t smem, int device,
                   cudaStream_t stream) {
  if (smem > DEFAULT_SMEM) {
    size_t* done = device >= 0 && device < MAX_DEVICES ? &g_smem_set[kind][st - 2][device] : nullptr;
    if (done == nullptr || smem > *done) {
      cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (e != cudaSuccess) return (int)e;
      if (done) *done = smem;
    }
  }
  kern<<<grid, nw * 32, smem, stream>>>(params);
  return (int)cudaGetLastError();
}

}  // namespace kivi_v3

#include <string.h>

#define KIVI_PARAMS_INTS 56  // int64 entries parse_params reads (pointers, strides, sizes): cuda_kernel.py::_args
static kivi_v3::Params parse_params(const long long* a, double qk_scale, double softcap = 0.0) {
  using namespace kivi_v3;
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
  p.len = reinterpret_cast<const long long*>(a[i++]);
  p.interleave = (int)a[i++];
  p.bk = reinterpret_cast<const void*>(a[i++]);
  p.bv = reinterpret_cast<const void*>(a[i++]);
  p.bva = reinterpret_cast<const uint8_t*>(a[i++]);
  p.blen = reinterpret_cast<const long long*>(a[i++]);
  p.bk_sb = a[i++]; p.bk_sh = a[i++]; p.bk_st = a[i++];
  p.bv_sb = a[i++]; p.bv_sh = a[i++]; p.bv_st = a[i++];
  p.bva_sb = a[i++];
  p.bNT = (int)a[i++]; p.bsplit = (int)a[i++]; p.btps = (int)a[i++]; p.bbf16 = (int)a[i++];
  // i == KIVI_PARAMS_INTS here
  p.qk_scale = (float)qk_scale;
  p.softcap = (float)softcap;
  return p;
}

// Only the extern "C" entry points are exported (built with -fvisibility=hidden).
#define KIVI_EXPORT __attribute__((visibility("default")))

extern "C" {

// Shared-memory bytes of one pipeline stage of one warp (the Python side sizes launches with it).
KIVI_EXPORT int kivi_v3_stage_bytes() { return kivi_v3::stage_bytes<KIVI_BITS, KIVI_DK, KIVI_DV>(); }
KIVI_EXPORT int kivi_v3_bits() { return KIVI_BITS; }
KIVI_EXPORT int kivi_v3_dk() { return KIVI_DK; }
KIVI_EXPORT int kivi_v3_dv() { return KIVI_DV; }
KIVI_EXPORT int kivi_v3_softcap() { return KIVI_SOFTCAP; }
// The phase clocks of the last launches (a build with -DKIVI_PHASES=1; -1 otherwise): n int64 into dst (host).
KIVI_EXPORT int kivi_v3_phases(long long* dst, long long n) {
#if KIVI_PHASES
  if (n < 0 || n > kivi_v3::PH_WARPS * kivi_v3::PH_SLOTS) return (int)cudaErrorInvalidValue;
  return (int)cudaMemcpyFromSymbol(dst, kivi_v3::kivi_phase_buf, (size_t)n * sizeof(long long));
#else
  (void)dst;
  (void)n;
  return -1;
#endif
}
// Dynamic shared-memory bytes kivi_v3_launch requests for (nw, stages); whether it raises the kernel's limit
// (> 48 KB) through cudaFuncSetAttribute.
KIVI_EXPORT long long kivi_v3_launch_smem(int nw, int stages) { return (long long)kivi_v3::launch_smem(nw, stages); }
KIVI_EXPORT int kivi_v3_needs_smem_optin(int nw, int stages) {
  return kivi_v3::launch_smem(nw, stages) > kivi_v3::DEFAULT_SMEM ? 1 : 0;
}

// a: pointers and int64 sizes/strides in the order of kivi_v3::Params (see cuda_kernel.py::_ARGS).  softcap: the
// logit soft-cap in log2 units (softcap * log2(e)); read by a KIVI_SOFTCAP build only, which needs it > 0.
KIVI_EXPORT int kivi_v3_launch(const long long* a, double qk_scale, double softcap, int nw, int stages, int row_blocks,
                   int device, void* stream) {
  using namespace kivi_v3;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  Params p = parse_params(a, qk_scale, softcap);
  size_t smem = 0;
  const int rc = check_launch(nw, stages, device, &smem);
  if (rc) return rc;
  if (p.bsplit < 0 || (p.bsplit > 0 && (p.btps < 1 || p.bNT < 1))) return (int)cudaErrorInvalidValue;
  dim3 grid(p.nsplit + p.bsplit, p.BH, row_blocks);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (p.bsplit > 0) {
    if constexpr (KIVI_DK % 64 != 0 || KIVI_DV % 32 != 0 || KIVI_MIN_BLOCKS > 4) return (int)cudaErrorInvalidValue;
    if (stages == 2) return launch_variant(kivi_v3_kernel<KIVI_BITS, KIVI_DK, KIVI_DV, 2, true>, p, 2, 2, nw, grid,
                                           smem, device, s);
    if (stages == 3) return launch_variant(kivi_v3_kernel<KIVI_BITS, KIVI_DK, KIVI_DV, 3, true>, p, 2, 3, nw, grid,
                                           smem, device, s);
    return launch_variant(kivi_v3_kernel<KIVI_BITS, KIVI_DK, KIVI_DV, 4, true>, p, 2, 4, nw, grid, smem, device, s);
  }
  if (stages == 2) return launch_variant(kivi_v3_kernel<KIVI_BITS, KIVI_DK, KIVI_DV, 2, false>, p, 0, 2, nw, grid,
                                         smem, device, s);
  if (stages == 3) return launch_variant(kivi_v3_kernel<KIVI_BITS, KIVI_DK, KIVI_DV, 3, false>, p, 0, 3, nw, grid,
                                         smem, device, s);
  return launch_variant(kivi_v3_kernel<KIVI_BITS, KIVI_DK, KIVI_DV, 4, false>, p, 0, 4, nw, grid, smem, device, s);
}

#if KIVI_LANES
// a: the region's Params (as kivi_v3_launch) followed by nlanes, then per lane: kc, ks, kz, vc, vs, vz, ch pointers,
// ch_sh, heads pointer, nheads, the 16 strides of LaneParams in order, dk, the lane's splits and tokens per split
// (LaneParams::nsplit / tps).  The library's KIVI_DK is the largest lane dk (it sizes the shared memory).
KIVI_EXPORT int kivi_v3_lanes_launch(const long long* a, double qk_scale, double softcap, int nw, int stages,
                                     int row_blocks, int device, void* stream) {
  using namespace kivi_v3;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  static LanesParams lp;  // large: not on the stack; filled and copied into the launch under the caller's lock
  memset(&lp, 0, sizeof(lp));
  lp.p = parse_params(a, qk_scale, softcap);
  int i = KIVI_PARAMS_INTS;
  lp.nlanes = (int)a[i++];
  if (lp.nlanes < 1 || lp.nlanes > MAX_LANES) return (int)cudaErrorInvalidValue;
  for (int l = 0; l < lp.nlanes; ++l) {
    LaneParams& ln = lp.lane[l];
    ln.kc = reinterpret_cast<const int*>(a[i++]);
    ln.ks = reinterpret_cast<const __half*>(a[i++]);
    ln.kz = reinterpret_cast<const __half*>(a[i++]);
    ln.vc = reinterpret_cast<const int*>(a[i++]);
    ln.vs = reinterpret_cast<const __half*>(a[i++]);
    ln.vz = reinterpret_cast<const __half*>(a[i++]);
    ln.ch = reinterpret_cast<const long long*>(a[i++]);
    ln.ch_sh = a[i++];
    ln.heads = reinterpret_cast<const long long*>(a[i++]);
    ln.nheads = a[i++];
    ln.kc_sb = a[i++]; ln.kc_sh = a[i++]; ln.kc_sg = a[i++];
    ln.ks_sb = a[i++]; ln.ks_sh = a[i++]; ln.ks_sg = a[i++];
    ln.kz_sb = a[i++]; ln.kz_sh = a[i++]; ln.kz_sg = a[i++];
    ln.vc_sb = a[i++]; ln.vc_sh = a[i++]; ln.vc_st = a[i++];
    ln.vs_sb = a[i++]; ln.vs_sh = a[i++];
    ln.vz_sb = a[i++]; ln.vz_sh = a[i++];
    ln.dk = (int)a[i++];
    ln.nsplit = (int)a[i++];
    ln.tps = (int)a[i++];
  }
  size_t smem = 0;
  const int rc = check_launch(nw, stages, device, &smem);
  if (rc) return rc;
  const Params& p = lp.p;
  if (p.bsplit < 0 || (p.bsplit > 0 && (p.btps < 1 || p.bNT < 1))) return (int)cudaErrorInvalidValue;
  for (int l = 0; l < lp.nlanes; ++l) {  // a lane's splits: some of the launch's, together covering its capacity
    const LaneParams& ln = lp.lane[l];
    if (ln.nsplit < 1 || ln.nsplit > p.nsplit || ln.tps < 1 || ln.tps % TILE || (long long)ln.nsplit * ln.tps < p.NT)
      return (int)cudaErrorInvalidValue;
  }
  dim3 grid(p.nsplit + p.bsplit, p.BH, row_blocks);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (p.bsplit > 0) {  // buffer CTAs: a build with KIVI_QDIM (the buffer's key dim) only (lanes_buffer_ok)
#if KIVI_QDIM > 0 && KIVI_QDIM % 64 == 0 && KIVI_DV % 32 == 0 && KIVI_MIN_BLOCKS <= 4
    if (stages == 2) return launch_variant(kivi_v3_lanes_kernel<2, true>, lp, 3, 2, nw, grid, smem, device, s);
    if (stages == 3) return launch_variant(kivi_v3_lanes_kernel<3, true>, lp, 3, 3, nw, grid, smem, device, s);
    return launch_variant(kivi_v3_lanes_kernel<4, true>, lp, 3, 4, nw, grid, smem, device, s);
#else
    return (int)cudaErrorInvalidValue;
#endif
  }
  if (stages == 2) return launch_variant(kivi_v3_lanes_kernel<2, false>, lp, 1, 2, nw, grid, smem, device, s);
  if (stages == 3) return launch_variant(kivi_v3_lanes_kernel<3, false>, lp, 1, 3, nw, grid, smem, device, s);
  return launch_variant(kivi_v3_lanes_kernel<4, false>, lp, 1, 4, nw, grid, smem, device, s);
}
KIVI_EXPORT int kivi_v3_qdim() { return KIVI_QDIM; }
// Host check of the argument array's layout (no GPU): parses `a` as kivi_v3_lanes_launch does and writes back, in
// order, M, H, NT, BH, nsplit, the length pointer, interleave, nlanes, then per lane dk, ch_sh, nheads, vz_sh and its kc pointer;
// returns the entries used.
KIVI_EXPORT int kivi_v3_lanes_parse_probe(const long long* a, long long* out) {
  using namespace kivi_v3;
  const Params p = parse_params(a, 1.0);
  int i = KIVI_PARAMS_INTS, o = 0;
  const int n = (int)a[i++];
  out[o++] = p.M; out[o++] = p.H; out[o++] = p.NT; out[o++] = p.BH; out[o++] = p.nsplit;
  out[o++] = reinterpret_cast<long long>(p.len); out[o++] = p.interleave; out[o++] = n;
  constexpr int LANE_INTS = 29;  // entries per lane (lanes_cuda.LANE_INTS), as kivi_v3_lanes_launch reads them
  for (int l = 0; l < n && l < MAX_LANES; ++l) {
    const long long* e = a + i + l * LANE_INTS;
    out[o++] = e[26]; out[o++] = e[7]; out[o++] = e[9]; out[o++] = e[25]; out[o++] = e[0];
    out[o++] = e[27]; out[o++] = e[28];  // the lane's splits and tokens per split
  }
  return i + n * LANE_INTS;
}
KIVI_EXPORT int kivi_v3_params_ints() { return KIVI_PARAMS_INTS; }
#endif

// Host replay of one tile's copies and of the compute loop's shared-memory reads, for every lane, with the
// same TileCopier / Layout code as the kernel (no GPU involved; `a` holds host pointers).  Outputs, per lane
// (g, t) = (lane / 4, lane % 4):
//   kwords [32][KWT + RW][4]: key word t*KWT + jw of tokens 4g .. 4g+3, then the shared words 4*KWT + q (raw)
//   kscale, kzero [32][DK/8]: scale / zero pairs of the lane's local pairs (Layout::key_pair order)
//   valid4 [32]: valid flags of tokens 4g .. 4g+3
//   vwords [32][2 kk][2 r][2 (token a, b)][NVW]: value words of tokens (8t+2kk+r, +4) from the lane column's first
//   vscale, vzero [32][2][2][2]: their value scale / zero (bits) for the lane column's value group
// Returns 0, or 1 if a read touched a byte no copy wrote (the stage is pre-filled with a marker).
KIVI_EXPORT int kivi_v3_layout_probe(const long long* a, int b, int h, int tok0, uint32_t* kwords, uint32_t* kscale,
                         uint32_t* kzero, uint32_t* valid4, uint32_t* vwords, uint16_t* vscale, uint16_t* vzero) {
  using namespace kivi_v3;
  using C = Cfg<KIVI_BITS, KIVI_DK, KIVI_DV>;
  using L = Layout<KIVI_BITS, KIVI_DK, KIVI_DV>;
  const Params p = parse_params(a, 1.0);
  const Slice sl(p, b, h);
  static uint8_t stage[C::STAGE], written[C::STAGE];
  memset(stage, 0xAB, sizeof(stage));
  memset(written, 0, sizeof(written));
  for (int lane = 0; lane < 32; ++lane) {
    const TileCopier<KIVI_BITS, KIVI_DK, KIVI_DV> copy(p, sl, lane);
    copy.issue([](int dst, const void* src) {
      memcpy(stage + dst, src, 16);
      memset(written + dst, 1, 16);
    }, [](int dst, const void* src, int n) {  // cp.async with a source size: the rest zero-filled
      memset(stage + dst, 0, 16);
      memcpy(stage + dst, src, n);
      memset(written + dst, 1, 16);
    }, tok0);
  }
  int missing = 0;
  auto rd = [&](int off, void* dst, int n) {
    for (int k = 0; k < n; ++k) missing |= written[off + k] == 0;
    memcpy(dst, stage + off, n);
  };
  constexpr int NVWR = C::VW >= 8 ? C::NVW : 1;
  constexpr int DK_PAIRS_PER_LANE = KIVI_DK / 8;
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    constexpr int NW = C::KWT + C::RW, NP = DK_PAIRS_PER_LANE;
    for (int jw = 0; jw < C::KWT; ++jw) {
      rd(L::k_words(g, t, jw), kwords + (lane * NW + jw) * 4, 16);
      for (int c = 0; c < C::HP / 4; ++c) {
        rd(L::k_scales(t, jw, c), kscale + lane * NP + jw * C::HP + 4 * c, 16);
        rd(L::k_zeros(t, jw, c), kzero + lane * NP + jw * C::HP + 4 * c, 16);
      }
    }
    for (int q = 0; q < C::RW; ++q) {  // shared words: the raw words (the kernel shifts them by 4t), quarter t's pairs
      rd(L::k_qwords(g, q), kwords + (lane * NW + C::KWT + q) * 4, 16);
      rd(L::k_qscales(t, q), kscale + lane * NP + C::KWT * C::HP + q * C::QP, 4 * C::QP);
      rd(L::k_qzeros(t, q), kzero + lane * NP + C::KWT * C::HP + q * C::QP, 4 * C::QP);
    }
    rd(L::valid4(g), valid4 + lane, 4);
    const int grp = L::v_group(g, p.gv), w0 = L::v_first_word(g);
    for (int kk = 0; kk < 2; ++kk) {
      for (int r = 0; r < 2; ++r) {
        const int tok[2] = {8 * t + 2 * kk + r, 8 * t + 2 * kk + r + 4};
        for (int e = 0; e < 2; ++e) {
          const int o = ((lane * 2 + kk) * 2 + r) * 2 + e;
          for (int w = 0; w < NVWR; ++w) rd(L::v_word(tok[e], w0 + w), vwords + o * NVWR + w, 4);
          rd(L::v_scale(tok[e], p.ngv, grp), vscale + o, 2);
          rd(L::v_zero(tok[e], p.ngv, grp), vzero + o, 2);
        }
      }
    }
  }
  return missing;
}

// One combine launch: 256 threads per output row; pdl != 0: with programmatic stream serialization (the kernel waits
// for the split kernel on the device, griddepcontrol.wait).  (A template: C++ linkage inside this extern "C" block.)
extern "C++" template <typename OutT>
cudaError_t launch_combine(const float* p, const float* l, OutT* o, float* ls, int nsplit, long long rows,
                                  cudaStream_t st, int pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)rows);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kivi_v3::kivi_v3_combine<KIVI_DV, OutT>, p, l, o, ls, nsplit, rows);
}

// out_kind: the output's element type, 0 float, 1 fp16, 2 bf16 (the lse stays float).  pdl: launch it with programmatic
// dependent launch (sm_90+ only: the caller checks the device).
KIVI_EXPORT int kivi_v3_combine_launch(long long po, long long pl, long long out, long long lse, int nsplit, long long rows,
                           int dv, int out_kind, int pdl, int device, void* stream) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  if (dv != KIVI_DV || rows <= 0 || rows > 0x7fffffffLL || out_kind < 0 || out_kind > 2)
    return (int)cudaErrorInvalidValue;
  const float* p = reinterpret_cast<const float*>(po);
  const float* l = reinterpret_cast<const float*>(pl);
  float* ls = reinterpret_cast<float*>(lse);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (out_kind == 1)
    e = launch_combine(p, l, reinterpret_cast<__half*>(out), ls, nsplit, rows, st, pdl);
  else if (out_kind == 2)
    e = launch_combine(p, l, reinterpret_cast<__nv_bfloat16*>(out), ls, nsplit, rows, st, pdl);
  else
    e = launch_combine(p, l, reinterpret_cast<float*>(out), ls, nsplit, rows, st, pdl);
  if (e != cudaSuccess) return (int)e;
  return (int)cudaGetLastError();
}

KIVI_EXPORT const char* kivi_v3_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
