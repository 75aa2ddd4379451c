// bitmosaic integer-activation matmul: the gathered quantization of the SQ-format's static parts
// (quantize_gathered; ops.py quantize_gathered, modules/sq_int.py SQIntKernel).  Part of intmm.cpp (one
// translation unit): included after the ISA traits, whose run_absmax / fp16_round it picks per call.
#pragma once
#include <c10/util/Half.h>

namespace {

using RunAbsmaxFn = void (*)(const float*, int64_t, int64_t, float*);
using Fp16Fn = void (*)(float*, int64_t);

void run_absmax_portable(const float* g, int64_t run, int64_t R, float* rm) {
  for (int64_t r = 0; r < R; ++r) rm[r] = absmax_portable(g + r * run, run);
}

void fp16_round_portable(float* v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) v[j] = (float)c10::Half(v[j]);
}

RunAbsmaxFn run_absmax_fn(int64_t isa, int64_t run) {
#ifdef BM_X86
  if ((isa == bm::kAvx512 || isa == bm::kAvx2) && run % 8 == 0) return &IntAvx2::run_absmax;
#endif
  return &run_absmax_portable;
}

Fp16Fn fp16_fn(int64_t isa) {
#ifdef BM_X86
  if (isa == bm::kAvx512) return &IntVnni::fp16_round;  // AVX-512F's vcvtps2ph
#endif
  return &fp16_round_portable;
}


// quantize_gathered's rows (a struct of plain values, so the loops keep them in registers)
struct GatherRows {
  const float* x;
  int64_t K;
  const int64_t* chan;
  int64_t n;
  const int64_t* act;
  int64_t R, run, S, sub;
  float qmax, qmax2;  // columns below n1 (and their scale columns) take qmax, the rest qmax2
  int64_t n1;
  float min_scale;
  bool fp16, given;
  int64_t Ms;
  QuantVFn quant;
  RunAbsmaxFn run_absmax;
  Fp16Fn fp16_round;

  void rows(int64_t m0, int64_t m1, float* sr, int8_t* q, int64_t KP, int32_t* rs, float* qz) const {
    std::vector<float> g(R * run, 0.f), sj(R * run, 1.f), amax(S), rm(R), qc(S, qmax);
    for (int64_t r = 0; r < R; ++r) qc[act[r]] = r * run < n1 ? qmax : qmax2;  // each scale column's grid
    float* gp = g.data();
    float* sjp = sj.data();
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = x + m * K;
      for (int64_t j = 0; j < n; ++j) gp[j] = xm[chan[j]];
      float* srm = sr + (given ? (Ms == 1 ? 0 : m) : m) * R;
      if (!given) {  // g is zero past n: whole runs
        run_absmax(gp, run, R, rm.data());
        std::fill(amax.begin(), amax.end(), 0.f);
        for (int64_t r = 0; r < R; ++r) amax[act[r]] = std::max(amax[act[r]], rm[r]);
        for (int64_t c = 0; c < S; ++c) amax[c] = std::min(std::max(amax[c] / qc[c], min_scale), 65504.f);
        if (fp16) fp16_round(amax.data(), S);
        for (int64_t r = 0; r < R; ++r) srm[r] = amax[act[r]];
      }
      for (int64_t r = 0; r < R; ++r) {  // each column's scale, then one pass over the row
        const float s = srm[r];
        const int64_t j1 = std::min(n, (r + 1) * run);
        for (int64_t j = r * run; j < j1; ++j) sjp[j] = s;
      }
      int8_t* qrow = q + m * KP;
      const int64_t k1 = std::min(n, n1);
      quant(gp, sjp, -qmax, qmax, qrow, k1);
      if (n > k1) quant(gp + k1, sjp + k1, -qmax2, qmax2, qrow + k1, n - k1);
      int32_t* rsm = rs + m * R;
      for (int64_t r = 0; r < R; ++r) {
        int32_t t = 0;
        const int64_t j1 = std::min(n, (r + 1) * run);
        for (int64_t j = r * run; j < j1; ++j) t += qrow[j];
        rsm[r] = t;
      }
      for (int64_t c = 0; c < R / sub; ++c) {
        float z = 0.f;
        for (int64_t k = c * sub; k < (c + 1) * sub; ++k) z += srm[k] * (float)rsm[k];
        qz[m * (R / sub) + c] = z;
      }
    }
  }
};

}  // namespace

// Gathered, symmetric quantization (the SQ-format's static parts, modules/sq_int.py SQIntKernel): the columns
// x[:, chan[j]] (j < n, e.g. the high channels in stored order) in runs of `run` columns, run r under scale
// column act[r] of S; columns below n1 on the grid +-qmax, the rest +-qmax2 (both SQ parts in one call:
// the runs of a scale column lie on one side).  Scales: the given ones (sa [1 or M, S], calibrated) or,
// with an empty sa, per token from the absmax over the columns of each scale column,
// min(max(amax / qmax, min_scale), 65504),
// rounded to fp16 where `fp16` (formats/sq.py _fp16_scale; the same float32 operations).  Levels: q =
// clamp(round_half_even(x / s), -qmax, qmax).  Returns q [M, KP] int8 (zero past n), the run sums rs [M, R]
// int32, the run scales sr [1 or M, R] float32 and qz [M, R / sub] = sum over each group of sub runs of
// sr rs (the runs mode's zero-point term; with sub 1 unused: rs is the group sums).
std::vector<torch::Tensor> quantize_gathered(torch::Tensor x, torch::Tensor chan, torch::Tensor act, int64_t run,
                                             int64_t S, double qmax, double qmax2, int64_t n1, torch::Tensor sa,
                                             int64_t KP, int64_t sub, double min_scale, bool fp16, int64_t isa) {
  check_f32(x, "x");
  TORCH_CHECK(chan.dtype() == torch::kLong && chan.is_contiguous() && act.dtype() == torch::kLong && act.is_contiguous(),
              "chan and act must be contiguous int64");
  const int64_t M = x.size(0), K = x.size(1), n = chan.numel(), R = act.numel();
  TORCH_CHECK(run >= 1 && R * run >= n && KP >= n && sub >= 1 && R % sub == 0 && S >= 1, "bad gathered layout");
  TORCH_CHECK(n1 >= n || (n1 >= 0 && n1 % run == 0), "the second grid must start at a run");
  const int64_t* cp = chan.data_ptr<int64_t>();
  const int64_t* ap = act.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(cp[j] >= 0 && cp[j] < K, "a gathered column is out of range");
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ap[r] >= 0 && ap[r] < S, "a run's scale column is out of range");
  const bool given = sa.numel() > 0;
  if (given) {
    check_f32(sa, "scales");
    TORCH_CHECK(sa.dim() == 2 && sa.size(1) == S && (sa.size(0) == 1 || sa.size(0) == M), "scales must be [1 or M, S]");
  }
  bm::check_isa(isa);
  const int64_t Ms = given ? sa.size(0) : M;
  auto q = torch::zeros({M, KP}, x.options().dtype(torch::kInt8));
  auto rs = torch::empty({M, R}, x.options().dtype(torch::kInt32));
  auto sr = torch::empty({Ms, R}, x.options());
  auto qz = torch::empty({M, R / sub}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = given ? sa.data_ptr<float>() : nullptr;
  int8_t* qp = q.data_ptr<int8_t>();
  int32_t* rp = rs.data_ptr<int32_t>();
  float* srp = sr.data_ptr<float>();
  float* qzp = qz.data_ptr<float>();
  const float qm = (float)qmax, lo_s = (float)min_scale;
  const QuantVFn fn = quant_ops(isa).quantv;
  if (given)  // the given scales of each run, once
    for (int64_t m = 0; m < Ms; ++m)
      for (int64_t r = 0; r < R; ++r) srp[m * R + r] = sp[m * S + ap[r]];
  GatherRows G{xp, K, cp, n, ap, R, run, S, sub, qm, (float)qmax2, n1, lo_s, fp16, given, Ms, fn, run_absmax_fn(isa, run),
               fp16_fn(isa)};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { G.rows(m0, m1, srp, qp, KP, rp, qzp); });
  return {q, rs, sr, qz};
}
