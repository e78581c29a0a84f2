#include <pybind11/pybind11.h>

#include "fusedist/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_gemm(py::module_& m) {
  m.def(
      "gemm_sm90",
      [](const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, bool w_nk,
         uintptr_t bias, uintptr_t c, int64_t ldc, float beta, uintptr_t out, int64_t ldo, int m,
         int n, int k, int dtype, uintptr_t flags, int block_rows, int pieces, uintptr_t stream) {
        GemmWaitArgs wait;
        wait.flags = flags, wait.block_rows = block_rows, wait.pieces = pieces;
        gemm_sm90(comm, x, ldx, w, ldw, w_nk, bias, c, ldc, beta, out, ldo, m, n, k, DType(dtype),
                  wait, stream);
      },
      py::arg("comm").none(true), py::arg("x"), py::arg("ldx"), py::arg("w"), py::arg("ldw"),
      py::arg("w_nk"), py::arg("bias"), py::arg("c"), py::arg("ldc"), py::arg("beta"),
      py::arg("out"), py::arg("ldo"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("dtype"),
      py::arg("flags"), py::arg("block_rows"), py::arg("pieces"), py::arg("stream"));
}
