#include <pybind11/pybind11.h>

#include "fusedist/comm/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_allreduce(py::module_& m) {
  m.def(
      "allreduce",
      [](const SymmComm& c, uintptr_t in, uintptr_t out, int64_t numel, int dtype, int algo,
         uintptr_t stream) {
        allreduce(c, in, out, numel, DType(dtype), AllReduceAlgo(algo), stream);
      },
      py::arg("comm"), py::arg("inp"), py::arg("out"), py::arg("numel"), py::arg("dtype"),
      py::arg("algo"), py::arg("stream"));
  m.def(
      "allreduce_max_numel",
      [](const SymmComm& c, int dtype, int algo) {
        return allreduce_max_numel(c, DType(dtype), AllReduceAlgo(algo));
      },
      py::arg("comm"), py::arg("dtype"), py::arg("algo"));
  m.def(
      "allreduce_rmsnorm",
      [](const SymmComm& c, uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t normed,
         uintptr_t residual_out, uintptr_t scales, int tokens, int hidden, float eps, int dtype,
         int out_dtype, uintptr_t stream) {
        allreduce_rmsnorm(c, x, residual, weight, normed, residual_out, scales, tokens, hidden,
                          eps, DType(dtype), DType(out_dtype), stream);
      },
      py::arg("comm"), py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("normed"),
      py::arg("residual_out"), py::arg("scales"), py::arg("tokens"), py::arg("hidden"),
      py::arg("eps"), py::arg("dtype"), py::arg("out_dtype"), py::arg("stream"));
  m.attr("ALGO_ONE_SHOT") = int(AllReduceAlgo::kOneShot);
  m.attr("ALGO_TWO_SHOT") = int(AllReduceAlgo::kTwoShot);
}
