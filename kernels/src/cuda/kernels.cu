// kiln's CUDA kernels, compiled at run time by NVRTC (no CUDA headers needed). Each kernel
// is the CPU reference's arithmetic step for step (IEEE division, no FTZ, no FMA contraction:
// compile with --fmad=false), so its output equals `kiln_kernels::ops` bit for bit.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- element loads and rounding ----
struct Bf16 { u16 v; };
struct F16 { u16 v; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(Bf16 x) { return __uint_as_float(((u32)x.v) << 16); }
__device__ __forceinline__ float to_f32(F16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.v));
    return f;
}

__device__ __forceinline__ float round_as(float x, float) { return x; }
__device__ __forceinline__ float round_as(float x, Bf16) {
#if __CUDA_ARCH__ >= 800
    // One instruction; only a NaN's payload can differ, and every NaN becomes 0x7F later.
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return __uint_as_float(((u32)h) << 16);
#endif
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((b | 0x00400000u) & 0xffff0000u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return __uint_as_float(b & 0xffff0000u);
}
__device__ __forceinline__ float round_as(float x, F16) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// ---- formats ----
// f32 -> E4M3FN, round to nearest even, non-saturating, every NaN written 0x7F.
__device__ __forceinline__ u8 e4m3_out(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = (bits >> 24) & 0x80u;
    u32 a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;
    u32 code;
    if (a >= 0x43e80000u) {
        code = (a == 0x43e80000u) ? 0x7eu : 0x7fu;
    } else if (a < 0x3c800000u) {
        float f = __fadd_rn(__uint_as_float(a), __uint_as_float(141u << 23));
        code = __float_as_uint(f) - (141u << 23);
    } else {
        u32 odd = (a >> 20) & 1u;
        code = (a + (u32)((7 - 127) << 23) + 0x7ffffu + odd) >> 20;
    }
    return code == 0x7fu ? (u8)0x7f : (u8)(code | sign);
}

// e4m3_out through the hardware conversion where it gives the same byte: Ada/Hopper's
// cvt.rn.satfinite.e4m3x2 rounds to nearest even like e4m3_out, and differs only where it
// saturates (|x| > 464, which e4m3_out sends to NaN) and in NaN's sign; those, and older
// GPUs, take e4m3_out.
__device__ __forceinline__ u8 e4m3_fast(float x) {
#if __CUDA_ARCH__ >= 890
    if (fabsf(x) < 464.0f) {
        unsigned short r;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
        return (u8)(r & 0xffu);
    }
#endif
    return e4m3_out(x);
}

__device__ __forceinline__ float e4m3_to_f32(u8 c) {
    u32 exp = (c >> 3) & 0xfu, man = c & 7u, sign = ((u32)c & 0x80u) << 24;
    float m;
    if ((c & 0x7f) == 0x7f) m = __uint_as_float(0x7fc00000u);
    else if (exp == 0) m = (float)man * (1.0f / 512.0f);
    else m = __uint_as_float(((exp + 120u) << 23) | (man << 20));
    return __uint_as_float(__float_as_uint(m) | sign);
}

// E2M1, NVFP4 rule: half to even on the grid, saturate at 6, sign bit = x < 0, NaN -> 7.
__device__ __forceinline__ u32 e2m1_nvfp4(float x) {
    float a = fabsf(x);
    u32 idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    if (a != a) idx = 7;
    return ((x < 0.0f) ? 8u : 0u) | idx;
}

// E2M1, MX rule: #(bounds < |x|) (ties toward zero), sign bit unless x > 0.
__device__ __forceinline__ u32 e2m1_mx(float x) {
    float a = fabsf(x);
    u32 idx = (a > 0.25f) + (a > 0.75f) + (a > 1.25f) + (a > 1.75f) + (a > 2.5f) + (a > 3.5f) + (a > 5.0f);
    return ((x > 0.0f) ? 0u : 8u) | idx;
}

__device__ __forceinline__ float nan_max(float m, float v) {
    float a = fabsf(v);
    if (m != m || a != a) return __uint_as_float(0x7fc00000u);
    return fmaxf(m, a);
}

// ---- vector loads and stores ----
// Device buffers are 256-byte aligned and every vector access below starts at a multiple of
// its own size, so each is one 16-byte (or 8-byte) memory transaction per thread.
struct __attribute__((aligned(16))) V16 { u32 x, y, z, w; };

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float f16_bits(u32 h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

// Eight consecutive elements starting at p (p 16-byte aligned for 2-byte types, 32 for f32).
__device__ __forceinline__ void load8(const Bf16* p, float v[8]) {
    V16 u = *reinterpret_cast<const V16*>(p);
    u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) { v[2 * k] = bf16_lo(w[k]); v[2 * k + 1] = bf16_hi(w[k]); }
}
__device__ __forceinline__ void load8(const F16* p, float v[8]) {
    V16 u = *reinterpret_cast<const V16*>(p);
    u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) { v[2 * k] = f16_bits(w[k] & 0xffffu); v[2 * k + 1] = f16_bits(w[k] >> 16); }
}
__device__ __forceinline__ void load8(const float* p, float v[8]) {
    V16 a = *reinterpret_cast<const V16*>(p);
    V16 b = *reinterpret_cast<const V16*>(p + 4);
    v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y); v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
    v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y); v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
}

__device__ __forceinline__ u64 pack8(const u32 b[8]) {
    u64 r = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) r |= (u64)(b[k] & 0xffu) << (8 * k);
    return r;
}

// ---- kernels (templates, instantiated below with C names) ----

// amax over n elements into *out (zeroed by the caller). |x| as bits orders like |x| as a
// float, and every NaN's bits exceed +Inf's, so one atomicMax per block is a NaN-propagating
// max; the host turns any NaN result into the canonical NaN.
template <typename T>
__device__ void amax_atomic(const T* x, u64 n, u32* out) {
    __shared__ float shm[256];
    float m = 0.0f;
    u64 chunks = n / 8;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    for (u64 c = tid; c < chunks; c += stride) {
        float v[8];
        load8(x + c * 8, v);
#pragma unroll
        for (int k = 0; k < 8; k++) m = nan_max(m, v[k]);
    }
    if (tid == 0)
        for (u64 i = chunks * 8; i < n; i++) m = nan_max(m, to_f32(x[i]));
    shm[threadIdx.x] = m;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shm[threadIdx.x] = nan_max(shm[threadIdx.x], shm[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicMax(out, __float_as_uint(shm[0]) & 0x7fffffffu);
}

// FP8 of w / scale: one thread per 8 elements (one 8-byte store); the thread past the last
// whole chunk does the tail.
template <typename T, bool ROUND>
__device__ void fp8_scaled(const T* w, u8* out, u64 n, float scale) {
    u64 c = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u64 chunks = n / 8;
    if (c < chunks) {
        float v[8];
        load8(w + c * 8, v);
        u32 b[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float q = __fdiv_rn(v[k], scale);
            b[k] = e4m3_fast(ROUND ? round_as(q, T()) : q);
        }
        *reinterpret_cast<u64*>(out + c * 8) = pack8(b);
    } else if (c == chunks) {
        for (u64 i = chunks * 8; i < n; i++) {
            float q = __fdiv_rn(to_f32(w[i]), scale);
            out[i] = e4m3_out(ROUND ? round_as(q, T()) : q);
        }
    }
}

// NVFP4: one thread per 16-block (two vector loads, one 8-byte store, one scale byte).
template <typename T>
__device__ void nvfp4_blocks(const T* w, u8* packed, u8* scales, u64 nblocks, float ws2) {
    u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    float v[16];
    load8(w + b * 16, v);
    load8(w + b * 16 + 8, v + 8);
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) m = nan_max(m, v[i]);
    float s = __fdiv_rn(m, __fmul_rn(6.0f, ws2));
    if (s == 0.0f) s = 1.0f;
    if (!(s != s)) s = fminf(fmaxf(s, 1.0f / 512.0f), 448.0f);
    u8 sc = e4m3_out(s);
    scales[b] = sc;
    float d = __fmul_rn(e4m3_to_f32(sc), ws2);
    u32 p[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        p[i] = e2m1_nvfp4(__fdiv_rn(v[2 * i], d)) | (e2m1_nvfp4(__fdiv_rn(v[2 * i + 1], d)) << 4);
    *reinterpret_cast<u64*>(packed + b * 8) = pack8(p);
}

// log2 rounded to f32 once, as `formats::e8m0::log2_f32`: f32(e + log2_f64(m)) for a normal
// x = m * 2^e, else through double log2.
__device__ __forceinline__ float log2_f32(float x) {
    u32 b = __float_as_uint(x);
    u32 ef = (b >> 23) & 0xffu;
    if (x <= 0.0f || ef == 0 || ef == 0xff) return (float)log2((double)x);
    float m = __uint_as_float((b & 0x7fffffu) | (127u << 23));
    return (float)__dadd_rn((double)((int)ef - 127), log2((double)m));
}

// MXFP8 exponent: ceil(log2_f32(bmax / 448)), -127 for zero and NaN, clamped to [-127, 127].
__device__ __forceinline__ int mxfp8_exponent(float bmax) {
    float d = __fdiv_rn(bmax, 448.0f);
    float l = d > 0.0f ? log2_f32(d) : -127.0f;
    return (int)fminf(fmaxf(ceilf(l), -127.0f), 127.0f);
}

template <typename T>
__device__ void mxfp8_blocks(const T* w, u8* q, u8* scales, u64 nblocks) {
    u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    float v[32];
#pragma unroll
    for (int j = 0; j < 4; j++) load8(w + b * 32 + 8 * j, v + 8 * j);
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) m = nan_max(m, v[i]);
    int k = mxfp8_exponent(m);
    scales[b] = (u8)(k + 127);
    float f = (float)ldexp(1.0, -k);
    u32 o[8];
    u64 words[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float x = __fmul_rn(v[8 * j + i], f);
            if (!(x != x)) x = fminf(fmaxf(x, -448.0f), 448.0f);
            o[i] = e4m3_fast(x);
        }
        words[j] = pack8(o);
    }
    V16* dst = reinterpret_cast<V16*>(q + b * 32);
    dst[0] = V16{(u32)words[0], (u32)(words[0] >> 32), (u32)words[1], (u32)(words[1] >> 32)};
    dst[1] = V16{(u32)words[2], (u32)(words[2] >> 32), (u32)words[3], (u32)(words[3] >> 32)};
}

template <typename T>
__device__ void mxfp4_blocks(const T* w, u8* packed, u8* scales, u64 nblocks) {
    u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    float v[32];
#pragma unroll
    for (int j = 0; j < 4; j++) load8(w + b * 32 + 8 * j, v + 8 * j);
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) m = nan_max(m, v[i]);
    float l = log2_f32(__fdiv_rn(m, 6.0f));
    float divisor;
    if (l != l) {
        scales[b] = 0xff;
        divisor = __uint_as_float(0x7fc00000u);
    } else {
        int k = (int)fminf(ceilf(fmaxf(l, -127.0f)), 127.0f);
        scales[b] = (u8)(k + 127);
        divisor = (float)ldexp(1.0, k);
    }
    u32 p[16];
#pragma unroll
    for (int i = 0; i < 16; i++)
        p[i] = e2m1_mx(__fdiv_rn(v[2 * i], divisor)) | (e2m1_mx(__fdiv_rn(v[2 * i + 1], divisor)) << 4);
    u64 lo = pack8(p), hi = pack8(p + 8);
    *reinterpret_cast<V16*>(packed + b * 16) = V16{(u32)lo, (u32)(lo >> 32), (u32)hi, (u32)(hi >> 32)};
}

__device__ __forceinline__ int to_int(float x, float lo, float hi) {
    if (x != x) return 0;
    return (int)fminf(fmaxf(rintf(x), lo), hi);
}

__device__ __forceinline__ u32 int4_pair(float a, float sa, float b, float sb) {
    int q0 = to_int(__fdiv_rn(a, sa), -8.0f, 7.0f);
    int q1 = to_int(__fdiv_rn(b, sb), -8.0f, 7.0f);
    return (u32)((q0 & 0xf) | ((q1 & 0xf) << 4));
}

// INT4 groups, any column count: one thread per packed byte (row pair r, column c).
template <typename T>
__device__ void int4_groups(const T* w, u8* out, const float* scales, u64 rows, u64 cols, u64 group) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= rows / 2 * cols) return;
    u64 r = i / cols, c = i % cols, groups = cols / group;
    out[i] = (u8)int4_pair(to_f32(w[(2 * r) * cols + c]), scales[(2 * r) * groups + c / group],
                           to_f32(w[(2 * r + 1) * cols + c]), scales[(2 * r + 1) * groups + c / group]);
}

// INT4 groups when cols % 8 == 0: one thread per 8 packed bytes (two vector loads, one store).
template <typename T>
__device__ void int4_groups_v8(const T* w, u8* out, const float* scales, u64 rows, u64 cols, u64 group) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u64 per_row = cols / 8;
    if (i >= rows / 2 * per_row) return;
    u64 r = i / per_row, c = (i % per_row) * 8, groups = cols / group;
    float a[8], b[8];
    load8(w + (2 * r) * cols + c, a);
    load8(w + (2 * r + 1) * cols + c, b);
    u32 p[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
        p[k] = int4_pair(a[k], scales[(2 * r) * groups + (c + k) / group], b[k], scales[(2 * r + 1) * groups + (c + k) / group]);
    *reinterpret_cast<u64*>(out + r * cols + c) = pack8(p);
}

#define KILN_INSTANTIATE(T, S)                                                                       \
    extern "C" __global__ void amax_##S(const T* x, u64 n, u32* out) { amax_atomic(x, n, out); } \
    extern "C" __global__ void fp8_round_##S(const T* w, u8* out, u64 n, float s) { fp8_scaled<T, true>(w, out, n, s); } \
    extern "C" __global__ void fp8_f32div_##S(const T* w, u8* out, u64 n, float s) { fp8_scaled<T, false>(w, out, n, s); } \
    extern "C" __global__ void nvfp4_##S(const T* w, u8* p, u8* sc, u64 nb, float ws2) { nvfp4_blocks(w, p, sc, nb, ws2); } \
    extern "C" __global__ void mxfp8_##S(const T* w, u8* q, u8* sc, u64 nb) { mxfp8_blocks(w, q, sc, nb); } \
    extern "C" __global__ void mxfp4_##S(const T* w, u8* p, u8* sc, u64 nb) { mxfp4_blocks(w, p, sc, nb); } \
    extern "C" __global__ void int4_##S(const T* w, u8* o, const float* sc, u64 r, u64 c, u64 g) { int4_groups(w, o, sc, r, c, g); } \
    extern "C" __global__ void int4_v8_##S(const T* w, u8* o, const float* sc, u64 r, u64 c, u64 g) { int4_groups_v8(w, o, sc, r, c, g); }

KILN_INSTANTIATE(Bf16, bf16)
KILN_INSTANTIATE(F16, f16)
KILN_INSTANTIATE(float, f32)
