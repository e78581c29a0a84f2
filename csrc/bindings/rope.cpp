// fusedist._C RoPE + cache-append binding: declarations only (csrc/ops/attention/rope_append.cu).
#include <pybind11/pybind11.h>

#include "fusedist/attention/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_rope(py::module_& m) {
  py::class_<RopeAppendArgs>(m, "RopeAppendArgs",
                             "One rope_append call: device pointers as integers, sizes, codes")
      .def(py::init<>())
      .def_readwrite("q", &RopeAppendArgs::q)
      .def_readwrite("k", &RopeAppendArgs::k)
      .def_readwrite("v", &RopeAppendArgs::v)
      .def_readwrite("positions", &RopeAppendArgs::positions)
      .def_readwrite("cos_sin", &RopeAppendArgs::cos_sin)
      .def_readwrite("k_cache", &RopeAppendArgs::k_cache)
      .def_readwrite("v_cache", &RopeAppendArgs::v_cache)
      .def_readwrite("k_scale", &RopeAppendArgs::k_scale)
      .def_readwrite("v_scale", &RopeAppendArgs::v_scale)
      .def_readwrite("slot_mapping", &RopeAppendArgs::slot_mapping)
      .def_readwrite("tokens", &RopeAppendArgs::tokens)
      .def_readwrite("num_slots", &RopeAppendArgs::num_slots)
      .def_readwrite("err", &RopeAppendArgs::err)
      .def_readwrite("q_heads", &RopeAppendArgs::q_heads)
      .def_readwrite("kv_heads", &RopeAppendArgs::kv_heads)
      .def_readwrite("head_dim", &RopeAppendArgs::head_dim)
      .def_readwrite("rot", &RopeAppendArgs::rot)
      .def_readwrite("max_position", &RopeAppendArgs::max_position)
      .def_readwrite("q_stride", &RopeAppendArgs::q_stride)
      .def_readwrite("k_stride", &RopeAppendArgs::k_stride)
      .def_readwrite("v_stride", &RopeAppendArgs::v_stride)
      .def_readwrite("positions_int64", &RopeAppendArgs::positions_int64)
      .def_readwrite("style", &RopeAppendArgs::style)
      .def_readwrite("q_norm", &RopeAppendArgs::q_norm)
      .def_readwrite("k_norm", &RopeAppendArgs::k_norm)
      .def_readwrite("norm_eps", &RopeAppendArgs::norm_eps)
      .def_property(
          "norm_dtype", [](const RopeAppendArgs& a) { return int(a.norm_dtype); },
          [](RopeAppendArgs& a, int v) { a.norm_dtype = DType(v); })
      .def_property(
          "dtype", [](const RopeAppendArgs& a) { return int(a.dtype); },
          [](RopeAppendArgs& a, int v) { a.dtype = DType(v); })
      .def_property(
          "cache_dtype", [](const RopeAppendArgs& a) { return int(a.cache_dtype); },
          [](RopeAppendArgs& a, int v) { a.cache_dtype = DType(v); });
  m.def("rope_append", &rope_append, py::arg("args"), py::arg("stream"));
}
