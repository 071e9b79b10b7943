// Python bindings of the CPU kernels built by kernels/_cpp.py (one extension module, one build per machine).

#include <torch/extension.h>

#include <string>

torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wscale);
std::string q8_isa();
torch::Tensor rms_norm_fused(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight, double eps,
                             const c10::optional<torch::Tensor>& residual, const c10::optional<torch::Tensor>& scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_gemm", &q8_gemm, "x (M, K) fp32 @ (Q8 weight (N, Kp) uint8, scale (N,)).T -> (M, N) fp32");
  m.def("isa", &q8_isa, "the instruction set this build's inner loops use");
  m.def("rms_norm_fused", &rms_norm_fused, "(residual + rms_norm(x) * weight) * scale over fp32 rows");
}
