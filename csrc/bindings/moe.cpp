// fusedist._C mixture-of-experts bindings: declarations only (csrc/ops/moe/).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "fusedist/moe/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_moe(py::module_& m) {
  py::class_<MoeGatingArgs>(m, "MoeGatingArgs",
                            "One routing call: device pointers as integers, sizes, the logits' "
                            "dtype code and the routing scheme")
      .def(py::init<>())
      .def_readwrite("logits", &MoeGatingArgs::logits)
      .def_readwrite("bias", &MoeGatingArgs::bias)
      .def_readwrite("ids", &MoeGatingArgs::ids)
      .def_readwrite("weights", &MoeGatingArgs::weights)
      .def_readwrite("logit_stride", &MoeGatingArgs::logit_stride)
      .def_readwrite("tokens", &MoeGatingArgs::tokens)
      .def_readwrite("experts", &MoeGatingArgs::experts)
      .def_readwrite("top_k", &MoeGatingArgs::top_k)
      .def_readwrite("scoring", &MoeGatingArgs::scoring)
      .def_readwrite("renormalize", &MoeGatingArgs::renormalize)
      .def_readwrite("num_groups", &MoeGatingArgs::num_groups)
      .def_readwrite("topk_groups", &MoeGatingArgs::topk_groups)
      .def_readwrite("routed_scaling", &MoeGatingArgs::routed_scaling)
      .def_property(
          "dtype", [](const MoeGatingArgs& a) { return int(a.dtype); },
          [](MoeGatingArgs& a, int v) { a.dtype = DType(v); });
  py::class_<MoeSortArgs>(m, "MoeSortArgs",
                          "One layout-by-expert call: device pointers as integers, sizes, the "
                          "chunking and the error record")
      .def(py::init<>())
      .def_readwrite("ids", &MoeSortArgs::ids)
      .def_readwrite("ids_int64", &MoeSortArgs::ids_int64)
      .def_readwrite("counts", &MoeSortArgs::counts)
      .def_readwrite("offsets", &MoeSortArgs::offsets)
      .def_readwrite("src_index", &MoeSortArgs::src_index)
      .def_readwrite("dest_index", &MoeSortArgs::dest_index)
      .def_readwrite("workspace", &MoeSortArgs::workspace)
      .def_readwrite("tokens", &MoeSortArgs::tokens)
      .def_readwrite("rows", &MoeSortArgs::rows)
      .def_readwrite("top_k", &MoeSortArgs::top_k)
      .def_readwrite("experts", &MoeSortArgs::experts)
      .def_readwrite("align", &MoeSortArgs::align)
      .def_readwrite("chunk_pairs", &MoeSortArgs::chunk_pairs)
      .def_readwrite("err", &MoeSortArgs::err);
  m.def("moe_gating", &moe_gating, py::arg("args"), py::arg("stream"));
  m.def("moe_route_sort", &moe_route_sort, py::arg("gating"), py::arg("sort"), py::arg("stream"));
  m.def("moe_sort", &moe_sort, py::arg("args"), py::arg("stream"));
  m.def("moe_gating_why_not", &moe_gating_why_not, py::arg("experts"), py::arg("top_k"),
        py::arg("num_groups"));
  m.def("moe_sort_workspace_ints", &moe_sort_workspace_ints, py::arg("pairs"),
        py::arg("experts"), py::arg("chunk_pairs"));
  m.attr("MOE_MAX_EXPERTS") = kMoeMaxExperts;
  m.attr("MOE_MAX_TOP_K") = kMoeMaxTopK;
  m.attr("MOE_MAX_GROUPS") = kMoeMaxGroups;
  m.attr("MOE_SORT_SMALL_MAX_PAIRS") = kMoeSortSmallMaxPairs;
  m.attr("MOE_SORT_CHUNK_QUANTUM") = kMoeSortChunkQuantum;
  m.attr("MOE_SORT_MAX_CHUNK_PAIRS") = kMoeSortMaxChunkPairs;

  py::class_<MoePermuteArgs>(m, "MoePermuteArgs",
                             "One permute call: device pointers as integers, sizes, strides in "
                             "elements, the dtype code, quant (0 none, 1 per row, 2 per 128)")
      .def(py::init<>())
      .def_readwrite("x", &MoePermuteArgs::x)
      .def_readwrite("src_index", &MoePermuteArgs::src_index)
      .def_readwrite("out", &MoePermuteArgs::out)
      .def_readwrite("scale", &MoePermuteArgs::scale)
      .def_readwrite("x_stride", &MoePermuteArgs::x_stride)
      .def_readwrite("out_stride", &MoePermuteArgs::out_stride)
      .def_readwrite("tokens", &MoePermuteArgs::tokens)
      .def_readwrite("rows", &MoePermuteArgs::rows)
      .def_readwrite("top_k", &MoePermuteArgs::top_k)
      .def_readwrite("hidden", &MoePermuteArgs::hidden)
      .def_readwrite("quant", &MoePermuteArgs::quant)
      .def_readwrite("err", &MoePermuteArgs::err)
      .def_property(
          "dtype", [](const MoePermuteArgs& a) { return int(a.dtype); },
          [](MoePermuteArgs& a, int v) { a.dtype = DType(v); });
  m.def("moe_permute", &moe_permute, py::arg("args"), py::arg("stream"));

  py::class_<MoeUnpermuteArgs>(m, "MoeUnpermuteArgs",
                               "One unpermute call: device pointers as integers, sizes, strides "
                               "in elements, the dtype code")
      .def(py::init<>())
      .def_readwrite("y", &MoeUnpermuteArgs::y)
      .def_readwrite("dest_index", &MoeUnpermuteArgs::dest_index)
      .def_readwrite("weights", &MoeUnpermuteArgs::weights)
      .def_readwrite("residual", &MoeUnpermuteArgs::residual)
      .def_readwrite("out", &MoeUnpermuteArgs::out)
      .def_readwrite("y_stride", &MoeUnpermuteArgs::y_stride)
      .def_readwrite("res_stride", &MoeUnpermuteArgs::res_stride)
      .def_readwrite("out_stride", &MoeUnpermuteArgs::out_stride)
      .def_readwrite("tokens", &MoeUnpermuteArgs::tokens)
      .def_readwrite("rows", &MoeUnpermuteArgs::rows)
      .def_readwrite("top_k", &MoeUnpermuteArgs::top_k)
      .def_readwrite("hidden", &MoeUnpermuteArgs::hidden)
      .def_readwrite("err", &MoeUnpermuteArgs::err)
      .def_property(
          "dtype", [](const MoeUnpermuteArgs& a) { return int(a.dtype); },
          [](MoeUnpermuteArgs& a, int v) { a.dtype = DType(v); });
  m.def("moe_unpermute", &moe_unpermute, py::arg("args"), py::arg("stream"));
}
