// bitmosaic C++ kernel: the nearest codebook point of llama.cpp's lattice types for many scales at once, the
// scale search of algorithms/gguf_lattice.py (issue 72).
//
// For every point i (|w| a[i, :D], weights m[i, :D]) and trial scale s[i, c], over the P codebook points g
// (Gt: the codebook transposed, [D, P]):
//   r_g = s A_g - 2 B_g,  A_g = sum_j m_j g_j^2,  B_g = sum_j (m_j a_j) g_j
// (the weighted error sum m (a - s g)^2 is sum m a^2 + s r_g), and, for the types whose signs have even
// parity, r_g + 4 F_g with F_g = min_j (m_j a_j) g_j: the error with the cheapest sign flipped.  Output per
// (i, c): the first g minimising each (idx, val; fidx, fval), what the torch reference returns.
// nearest_k: per point (one scale s[i]) the K first points by r, ascending, ties in codebook order (the
// vector GPTQ's candidates).
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "isa.h"

namespace {

struct Args {
  const float *a, *m, *s, *Gt;
  int64_t N, D, P, C;
  bool parity;
  int32_t* idx;
  float* val;
  int32_t* fidx;
  float* fval;
};

namespace portable {
#include "latticesearch_rows.h"
}  // namespace portable

#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX2_TARGET)
namespace avx2 {
#include "latticesearch_rows.h"
}  // namespace avx2
BM_END_TARGET
#endif

std::vector<torch::Tensor> nearest_many(torch::Tensor a, torch::Tensor m, torch::Tensor s, torch::Tensor Gt,
                                        bool parity, int64_t isa) {
  bm::check_isa(isa);
  auto f32 = [](const torch::Tensor& t, int64_t dim) {
    return t.dim() == dim && t.scalar_type() == torch::kFloat && t.is_contiguous();
  };
  TORCH_CHECK(f32(a, 2) && f32(m, 2) && f32(s, 2) && f32(Gt, 2), "a, m, s, Gt: contiguous float32 2-D");
  const int64_t N = a.size(0), D = a.size(1), P = Gt.size(1), C = s.size(1);
  TORCH_CHECK(m.sizes() == a.sizes() && s.size(0) == N && Gt.size(0) == D && P >= 1 && C >= 1, "shapes");
  auto idx = torch::empty({N, C}, torch::kInt), fidx = torch::zeros({N, C}, torch::kInt);
  auto val = torch::empty({N, C}, torch::kFloat), fval = torch::zeros({N, C}, torch::kFloat);
  const Args args{a.data_ptr<float>(), m.data_ptr<float>(), s.data_ptr<float>(), Gt.data_ptr<float>(),
                  N, D, P, C, parity, idx.data_ptr<int32_t>(), val.data_ptr<float>(), fidx.data_ptr<int32_t>(),
                  fval.data_ptr<float>()};
#ifdef BM_X86
  if (isa >= bm::kAvx2) {
    avx2::search_rows(args);
    return {idx, val, fidx, fval};
  }
#endif
  portable::search_rows(args);
  return {idx, val, fidx, fval};
}

std::vector<torch::Tensor> nearest_k(torch::Tensor a, torch::Tensor m, torch::Tensor s, torch::Tensor Gt, int64_t K,
                                     int64_t isa) {
  bm::check_isa(isa);
  auto f32 = [](const torch::Tensor& t, int64_t dim) {
    return t.dim() == dim && t.scalar_type() == torch::kFloat && t.is_contiguous();
  };
  TORCH_CHECK(f32(a, 2) && f32(m, 2) && f32(s, 1) && f32(Gt, 2), "a, m, Gt: contiguous float32 2-D, s 1-D");
  const int64_t N = a.size(0), D = a.size(1), P = Gt.size(1);
  TORCH_CHECK(m.sizes() == a.sizes() && s.size(0) == N && Gt.size(0) == D && K >= 1 && K <= P, "shapes");
  auto idx = torch::empty({N, K}, torch::kInt);
  auto val = torch::empty({N, K}, torch::kFloat);
  const Args args{a.data_ptr<float>(), m.data_ptr<float>(), s.data_ptr<float>(), Gt.data_ptr<float>(),
                  N, D, P, 1, false, idx.data_ptr<int32_t>(), val.data_ptr<float>(), nullptr, nullptr};
#ifdef BM_X86
  if (isa >= bm::kAvx2) {
    avx2::topk_rows(args, K);
    return {idx, val};
  }
#endif
  portable::topk_rows(args, K);
  return {idx, val};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nearest_many", &nearest_many,
        "per point and trial scale the first codebook point minimising s A - 2 B (and + 4 F with parity)",
        py::arg("a"), py::arg("m"), py::arg("s"), py::arg("Gt"), py::arg("parity"), py::arg("isa"));
  m.def("nearest_k", &nearest_k, "per point the K first codebook points by s A - 2 B, ascending (stable)",
        py::arg("a"), py::arg("m"), py::arg("s"), py::arg("Gt"), py::arg("K"), py::arg("isa"));
  m.def("isa_supported", &bm::isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
}
