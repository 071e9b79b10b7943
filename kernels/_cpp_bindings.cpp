// Python bindings of the CPU kernels built by kernels/_cpp.py (one extension module, one build per machine).

#include <torch/extension.h>

#include <string>

torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wscale,
                      const c10::optional<torch::Tensor>& kmask);
std::string q8_isa();
bool q8_amx(bool wanted);
torch::Tensor rms_norm_fused(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight, double eps,
                             const c10::optional<torch::Tensor>& residual, const c10::optional<torch::Tensor>& scale);
torch::Tensor rms_norm_rope(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& cos,
                            const torch::Tensor& sin, int64_t rotate);

torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                         const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& extra_k,
                         const c10::optional<torch::Tensor>& extra_v, const c10::optional<torch::Tensor>& leader,
                         int64_t shared_lo, int64_t shared_hi);

torch::Tensor gelu_mul(const torch::Tensor& gate_up);
std::tuple<torch::Tensor, torch::Tensor> draw_tokens(const torch::Tensor& logits, const torch::Tensor& u,
                                                     double inv_temp, double min_p, const torch::Tensor& ban_offsets,
                                                     const torch::Tensor& ban_ids);
torch::Tensor softcap_(torch::Tensor& x, double cap);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_gemm", &q8_gemm, "x (M, K) fp32 (times kmask (K,)) @ (packed Q8 weight, scale (N,)).T -> (M, N) fp32",
        pybind11::arg("x"), pybind11::arg("wq"), pybind11::arg("wscale"), pybind11::arg("kmask") = pybind11::none());
  m.def("q8_amx", &q8_amx, "use AMX tiles for q8 GEMMs of 8 rows or more where the CPU and OS allow (the default); "
        "returns whether they are in use now");
  m.def("isa", &q8_isa, "the instruction set this build's inner loops use");
  m.def("attend_one", &attend_one, "one query a row (B, H, D) over keys / values (B, G, S, D) (+ one extra each), "
        "rows of one leader sharing slots [shared_lo, shared_hi)", pybind11::arg("q"), pybind11::arg("keys"),
        pybind11::arg("values"), pybind11::arg("mask"), pybind11::arg("extra_k"), pybind11::arg("extra_v"),
        pybind11::arg("leader") = pybind11::none(), pybind11::arg("shared_lo") = 0, pybind11::arg("shared_hi") = 0);
  m.def("gelu_mul", &gelu_mul, "gelu_tanh(gate) * up over the halves of gate_up (R, 2I) fp32 rows -> (R, I)");
  m.def("softcap_", &softcap_, "x = tanh(x / cap) * cap in place over fp32");
  m.def("draw_tokens", &draw_tokens, "one token a row of logits (K, V) fp32 after bans and min-p, at 1 / inv_temp, "
        "by the uniforms u (K,) -> (tok (K,) int64, raw log-softmax at tok (K,) fp32)");
  m.def("rms_norm_fused", &rms_norm_fused, "(residual + rms_norm(x) * weight) * scale over fp32 rows");
  m.def("rms_norm_rope", &rms_norm_rope, "rms_norm(x) * weight over fp32 rows in groups of P, then RoPE on the first "
        "`rotate` rows of each group");
}
