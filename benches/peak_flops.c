// The CPU's arithmetic ceiling for BENCHMARKS.md ("The packed GEMM"): 24 independent
// accumulators of VDPBF16PS zmm, then of VFMADD...PS zmm, per core. Run one copy and two at once
// (`./peak & ./peak; wait`) to see whether the two cores are real.
//
//     gcc -O2 -mavx512f -mavx512bf16 -mavx512bw benches/peak_flops.c -o peak && ./peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512 acc[24]; for(int i=0;i<24;i++) acc[i]=_mm512_setzero_ps();
  __m512bh a=(__m512bh)_mm512_set1_epi32(0x3f803f80), b=(__m512bh)_mm512_set1_epi32(0x3f803f80);
  long N=200000000/24; double t0=now();
  for(long it=0;it<N;it++){
    #pragma GCC unroll 24
    for(int i=0;i<24;i++) acc[i]=_mm512_dpbf16_ps(acc[i],a,b);
    __asm__ volatile("" : "+v"(a));
  }
  double t=now()-t0; float s=0; for(int i=0;i<24;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("dpbf16 zmm: %.3f G/s -> %.1f GFLOP/s/core (s=%g)\n", N*24/t/1e9, N*24*64/t/1e9, s);
  __m512 f[24]; for(int i=0;i<24;i++) f[i]=_mm512_setzero_ps(); __m512 x=_mm512_set1_ps(1.0001f);
  t0=now();
  for(long it=0;it<N;it++){
    #pragma GCC unroll 24
    for(int i=0;i<24;i++) f[i]=_mm512_fmadd_ps(f[i],x,x);
    __asm__ volatile("" : "+v"(x));
  }
  t=now()-t0; s=0; for(int i=0;i<24;i++) s+=_mm512_reduce_add_ps(f[i]);
  printf("fma zmm: %.3f G/s -> %.1f GFLOP/s/core (s=%g)\n", N*24/t/1e9, N*24*32/t/1e9, s);
}
