// fusedist._C FP8 payload codec: declarations only (csrc/ops/comm/fp8_codec.cu).
#include <pybind11/pybind11.h>

#include "fusedist/comm/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_fp8_codec(py::module_& m) {
  // The payload formats' codes (common.h Fp8Format): the values fmt takes.
  m.attr("FP8_FORMAT_E4M3") = int(kFp8E4M3);
  m.attr("FP8_FORMAT_E3M4") = int(kFp8E3M4);
  py::class_<Fp8EncodeArgs>(m, "Fp8EncodeArgs",
                            "One fp8_encode call: device pointers as integers, the element "
                            "count, the block size, the dtype code, the payload format "
                            "(FP8_FORMAT_*)")
      .def(py::init<>())
      .def_readwrite("x", &Fp8EncodeArgs::x)
      .def_readwrite("q", &Fp8EncodeArgs::q)
      .def_readwrite("scales", &Fp8EncodeArgs::scales)
      .def_readwrite("numel", &Fp8EncodeArgs::numel)
      .def_readwrite("block", &Fp8EncodeArgs::block)
      .def_property(
          "dtype", [](const Fp8EncodeArgs& a) { return int(a.dtype); },
          [](Fp8EncodeArgs& a, int v) { a.dtype = DType(v); })
      .def_readwrite("fmt", &Fp8EncodeArgs::fmt);
  m.def("fp8_encode", &fp8_encode, py::arg("args"), py::arg("stream"));

  py::class_<Fp8DecodeSumArgs>(m, "Fp8DecodeSumArgs",
                               "One fp8_decode_sum call: device pointers as integers, sizes and "
                               "strides in elements, the payload count")
      .def(py::init<>())
      .def_readwrite("q", &Fp8DecodeSumArgs::q)
      .def_readwrite("scales", &Fp8DecodeSumArgs::scales)
      .def_readwrite("out", &Fp8DecodeSumArgs::out)
      .def_readwrite("numel", &Fp8DecodeSumArgs::numel)
      .def_readwrite("q_stride", &Fp8DecodeSumArgs::q_stride)
      .def_readwrite("scale_stride", &Fp8DecodeSumArgs::scale_stride)
      .def_readwrite("block", &Fp8DecodeSumArgs::block)
      .def_readwrite("payloads", &Fp8DecodeSumArgs::payloads)
      .def_readwrite("fmt", &Fp8DecodeSumArgs::fmt);
  m.def("fp8_decode_sum", &fp8_decode_sum, py::arg("args"), py::arg("stream"));
}
