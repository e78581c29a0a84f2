// fusedist._C single-GPU layer kernels: declarations only (csrc/ops/layers/).
#include <pybind11/pybind11.h>

#include "fusedist/layers/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_layers(py::module_& m) {
  py::class_<AddRmsNormArgs>(m, "AddRmsNormArgs",
                             "One add_rmsnorm call: device pointers as integers, sizes, strides "
                             "in elements, the dtype code, fp8_out (+ scale)")
      .def(py::init<>())
      .def_readwrite("x", &AddRmsNormArgs::x)
      .def_readwrite("residual", &AddRmsNormArgs::residual)
      .def_readwrite("weight", &AddRmsNormArgs::weight)
      .def_readwrite("out", &AddRmsNormArgs::out)
      .def_readwrite("scale", &AddRmsNormArgs::scale)
      .def_readwrite("fp8_out", &AddRmsNormArgs::fp8_out)
      .def_readwrite("tokens", &AddRmsNormArgs::tokens)
      .def_readwrite("hidden", &AddRmsNormArgs::hidden)
      .def_readwrite("x_stride", &AddRmsNormArgs::x_stride)
      .def_readwrite("residual_stride", &AddRmsNormArgs::residual_stride)
      .def_readwrite("out_stride", &AddRmsNormArgs::out_stride)
      .def_readwrite("eps", &AddRmsNormArgs::eps)
      .def_readwrite("vectors_per_thread", &AddRmsNormArgs::vectors_per_thread)
      .def_property(
          "dtype", [](const AddRmsNormArgs& a) { return int(a.dtype); },
          [](AddRmsNormArgs& a, int v) { a.dtype = DType(v); });
  m.def("add_rmsnorm", &add_rmsnorm, py::arg("args"), py::arg("stream"));
  m.attr("ADD_RMSNORM_MAX_VECTORS") = kAddRmsNormMaxVectors;

  py::class_<SiluMulArgs>(m, "SiluMulArgs",
                          "One silu_mul call: device pointers as integers, sizes, strides in "
                          "elements, the dtype code, fp8_out (+ scale)")
      .def(py::init<>())
      .def_readwrite("gate_up", &SiluMulArgs::gate_up)
      .def_readwrite("out", &SiluMulArgs::out)
      .def_readwrite("scale", &SiluMulArgs::scale)
      .def_readwrite("fp8_out", &SiluMulArgs::fp8_out)
      .def_readwrite("tokens", &SiluMulArgs::tokens)
      .def_readwrite("inter", &SiluMulArgs::inter)
      .def_readwrite("in_stride", &SiluMulArgs::in_stride)
      .def_readwrite("out_stride", &SiluMulArgs::out_stride)
      .def_property(
          "dtype", [](const SiluMulArgs& a) { return int(a.dtype); },
          [](SiluMulArgs& a, int v) { a.dtype = DType(v); });
  m.def("silu_mul", &silu_mul, py::arg("args"), py::arg("stream"));

  py::class_<QuantizeRowsArgs>(m, "QuantizeRowsArgs",
                               "One quantize_rows call: device pointers as integers, sizes, "
                               "strides in elements, the dtype code")
      .def(py::init<>())
      .def_readwrite("x", &QuantizeRowsArgs::x)
      .def_readwrite("out", &QuantizeRowsArgs::out)
      .def_readwrite("scale", &QuantizeRowsArgs::scale)
      .def_readwrite("tokens", &QuantizeRowsArgs::tokens)
      .def_readwrite("k", &QuantizeRowsArgs::k)
      .def_readwrite("in_stride", &QuantizeRowsArgs::in_stride)
      .def_readwrite("out_stride", &QuantizeRowsArgs::out_stride)
      .def_readwrite("group", &QuantizeRowsArgs::group)
      .def_property(
          "dtype", [](const QuantizeRowsArgs& a) { return int(a.dtype); },
          [](QuantizeRowsArgs& a, int v) { a.dtype = DType(v); });
  m.def("quantize_rows", &quantize_rows, py::arg("args"), py::arg("stream"));
}
