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

// ---- kernels (templates, instantiated below with C names) ----
template <typename T>
__device__ void amax_partial(const T* x, u64 n, float* partial) {
    __shared__ float shm[256];
    float m = 0.0f;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        m = nan_max(m, to_f32(x[i]));
    shm[threadIdx.x] = m;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shm[threadIdx.x] = nan_max(shm[threadIdx.x], shm[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = shm[0];
}

template <typename T, bool ROUND>
__device__ void fp8_scaled(const T* w, u8* out, u64 n, float scale) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float q = __fdiv_rn(to_f32(w[i]), scale);
    out[i] = e4m3_out(ROUND ? round_as(q, T()) : q);
}

template <typename T>
__device__ void nvfp4_blocks(const T* w, u8* packed, u8* scales, u64 nblocks, float ws2) {
    u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const T* p = w + b * 16;
    float v[16];
    float m = 0.0f;
    for (int i = 0; i < 16; i++) { v[i] = to_f32(p[i]); m = nan_max(m, v[i]); }
    float s = __fdiv_rn(m, __fmul_rn(6.0f, ws2));
    if (s == 0.0f) s = 1.0f;
    if (!(s != s)) s = fminf(fmaxf(s, 1.0f / 512.0f), 448.0f);
    u8 sc = e4m3_out(s);
    scales[b] = sc;
    float d = __fmul_rn(e4m3_to_f32(sc), ws2);
    for (int i = 0; i < 8; i++)
        packed[b * 8 + i] = (u8)(e2m1_nvfp4(__fdiv_rn(v[2 * i], d)) | (e2m1_nvfp4(__fdiv_rn(v[2 * i + 1], d)) << 4));
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
    const T* p = w + b * 32;
    float m = 0.0f;
    for (int i = 0; i < 32; i++) m = nan_max(m, to_f32(p[i]));
    int k = mxfp8_exponent(m);
    scales[b] = (u8)(k + 127);
    float f = (float)ldexp(1.0, -k);
    for (int i = 0; i < 32; i++) {
        float x = __fmul_rn(to_f32(p[i]), f);
        if (!(x != x)) x = fminf(fmaxf(x, -448.0f), 448.0f);
        q[b * 32 + i] = e4m3_out(x);
    }
}

template <typename T>
__device__ void mxfp4_blocks(const T* w, u8* packed, u8* scales, u64 nblocks) {
    u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    const T* p = w + b * 32;
    float m = 0.0f;
    for (int i = 0; i < 32; i++) m = nan_max(m, to_f32(p[i]));
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
    for (int i = 0; i < 16; i++) {
        u32 lo = e2m1_mx(__fdiv_rn(to_f32(p[2 * i]), divisor));
        u32 hi = e2m1_mx(__fdiv_rn(to_f32(p[2 * i + 1]), divisor));
        packed[b * 16 + i] = (u8)(lo | (hi << 4));
    }
}

__device__ __forceinline__ int to_int(float x, float lo, float hi) {
    if (x != x) return 0;
    return (int)fminf(fmaxf(rintf(x), lo), hi);
}

// INT4 groups: one thread per packed byte (row pair r, column c).
template <typename T>
__device__ void int4_groups(const T* w, u8* out, const float* scales, u64 rows, u64 cols, u64 group) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= rows / 2 * cols) return;
    u64 r = i / cols, c = i % cols, groups = cols / group;
    int q0 = to_int(__fdiv_rn(to_f32(w[(2 * r) * cols + c]), scales[(2 * r) * groups + c / group]), -8.0f, 7.0f);
    int q1 = to_int(__fdiv_rn(to_f32(w[(2 * r + 1) * cols + c]), scales[(2 * r + 1) * groups + c / group]), -8.0f, 7.0f);
    out[i] = (u8)((q0 & 0xf) | ((q1 & 0xf) << 4));
}

#define KILN_INSTANTIATE(T, S)                                                                       \
    extern "C" __global__ void amax_##S(const T* x, u64 n, float* partial) { amax_partial(x, n, partial); } \
    extern "C" __global__ void fp8_round_##S(const T* w, u8* out, u64 n, float s) { fp8_scaled<T, true>(w, out, n, s); } \
    extern "C" __global__ void fp8_f32div_##S(const T* w, u8* out, u64 n, float s) { fp8_scaled<T, false>(w, out, n, s); } \
    extern "C" __global__ void nvfp4_##S(const T* w, u8* p, u8* sc, u64 nb, float ws2) { nvfp4_blocks(w, p, sc, nb, ws2); } \
    extern "C" __global__ void mxfp8_##S(const T* w, u8* q, u8* sc, u64 nb) { mxfp8_blocks(w, q, sc, nb); } \
    extern "C" __global__ void mxfp4_##S(const T* w, u8* p, u8* sc, u64 nb) { mxfp4_blocks(w, p, sc, nb); } \
    extern "C" __global__ void int4_##S(const T* w, u8* o, const float* sc, u64 r, u64 c, u64 g) { int4_groups(w, o, sc, r, c, g); }

KILN_INSTANTIATE(Bf16, bf16)
KILN_INSTANTIATE(F16, f16)
KILN_INSTANTIATE(float, f32)
