// Peak instruction rates of one core: independent AVX-512 VNNI vpdpbusd and FMA vfmadd231ps chains (12 of
// each, so neither latency nor a dependency limits them).  The physical bounds that README quotes next to
// the integer kernels (issue 24): gcc -O2 -mavx512f -mavx512vnni -o /tmp/isa_peak benchmarks/kernels/isa_peak.c && /tmp/isa_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
int main(){
  const long N=100000000;
  __m512i w=_mm512_set1_epi8(3), x=_mm512_set1_epi8(5);
#define DI(i) __m512i a##i=_mm512_set1_epi32(i);
  R12(DI)
  double t=now();
  for(long n=0;n<N;n++){
#define ST(i) a##i=_mm512_dpbusd_epi32(a##i,w,x);
    R12(ST)
    __asm__ volatile("" :: "v"(a0));
  }
  double tv=now()-t;
  __m512 fw=_mm512_set1_ps(1.0001f), fx=_mm512_set1_ps(0.9999f);
#define DF(i) __m512 f##i=_mm512_set1_ps(i);
  R12(DF)
  t=now();
  for(long n=0;n<N;n++){
#define SF(i) f##i=_mm512_fmadd_ps(f##i,fw,fx);
    R12(SF)
    __asm__ volatile("" :: "v"(f0));
  }
  double tf=now()-t;
  int s=0;
#define SA(i) s+=_mm512_reduce_add_epi32(a##i);
  R12(SA)
  float fs=0;
#define SB(i) fs+=_mm512_reduce_add_ps(f##i);
  R12(SB)
  double ni=12.0*N;
  printf("vpdpbusd zmm: %.2f Ginstr/s = %.0f int8 GOPS; vfmadd zmm: %.2f Ginstr/s = %.0f GFLOPS; ratio %.2f (%d %g)\n",
    ni/tv/1e9, ni/tv*128/1e9, ni/tf/1e9, ni/tf*32/1e9, (ni/tv*128)/(ni/tf*32), s, fs);
}
