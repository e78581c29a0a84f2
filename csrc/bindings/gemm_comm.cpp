#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "fusedist/gemm/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_gemm_comm(py::module_& m) {
  m.def(
      "gemm_ar_fused",
      [](const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, bool w_nk,
         uintptr_t bias, uintptr_t out, int m, int n, int k, int dtype, uintptr_t stream) {
        gemm_ar_fused(comm, x, ldx, w, ldw, w_nk, bias, out, m, n, k, DType(dtype), stream);
      },
      py::arg("comm").none(true), py::arg("x"), py::arg("ldx"), py::arg("w"), py::arg("ldw"),
      py::arg("w_nk"), py::arg("bias"), py::arg("out"), py::arg("m"), py::arg("n"),
      py::arg("k"), py::arg("dtype"), py::arg("stream"));
  m.def("gemm_rs_counter_wait", &gemm_rs_counter_wait, py::arg("comm"), py::arg("signal_offset"),
        py::arg("src"), py::arg("piece"), py::arg("expected"), py::arg("stream"));
  m.def(
      "gemm_ar_staging_gather",
      [](const SymmComm& c, uint64_t staging_offset, const std::vector<int64_t>& row_bounds,
         int64_t row_bytes, uintptr_t out, const std::array<uint32_t, 6>& desc,
         uintptr_t stream) {
        gemm_ar_staging_gather(c, staging_offset, row_bounds, row_bytes, out,
                               to_call_desc(desc), stream);
      },
      py::arg("comm"), py::arg("staging_offset"), py::arg("row_bounds"), py::arg("row_bytes"),
      py::arg("out"), py::arg("desc"), py::arg("stream"));
  m.attr("GEMM_AR_FUSED_MAX_M") = kGemmArFusedMaxM;
  m.attr("MAX_SIGNAL_PIECES") = kMaxSignalPieces;
}
