// fusedist._C expert-parallel kernels: declarations only (csrc/ops/ep/).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "fusedist/ep/api.h"

namespace py = pybind11;
using namespace fusedist;
using namespace fusedist::ep;

void register_ep(py::module_& m) {
  py::class_<EpConfig>(m, "EpConfig",
                       "An expert-parallel buffer's layout (ep/config.h): sizes, slot offsets, "
                       "the fixed grid; made by ep_config, identical on every rank")
      .def_readonly("world", &EpConfig::world)
      .def_readonly("rank", &EpConfig::rank)
      .def_readonly("hidden", &EpConfig::hidden)
      .def_readonly("num_experts", &EpConfig::num_experts)
      .def_readonly("local_experts", &EpConfig::local_experts)
      .def_readonly("top_k", &EpConfig::top_k)
      .def_readonly("max_tokens", &EpConfig::max_tokens)
      .def_readonly("cap_rows", &EpConfig::cap_rows)
      .def_readonly("fp8", &EpConfig::fp8)
      .def_readonly("blocks", &EpConfig::blocks)
      .def_readonly("smem_bytes", &EpConfig::smem_bytes)
      .def_readonly("counts_off", &EpConfig::counts_off)
      .def_readonly("rows_off", &EpConfig::rows_off)
      .def_readonly("row_bytes", &EpConfig::row_bytes)
      .def_readonly("dispatch_row_bytes", &EpConfig::dispatch_row_bytes)
      .def_readonly("slot_bytes", &EpConfig::slot_bytes);
  m.def("ep_why_not", &ep_why_not, py::arg("hidden"), py::arg("num_experts"), py::arg("world"),
        py::arg("top_k"), py::arg("max_tokens"), py::arg("fp8"));
  m.def("ep_config", &ep_config, py::arg("world"), py::arg("rank"), py::arg("hidden"),
        py::arg("num_experts"), py::arg("top_k"), py::arg("max_tokens"), py::arg("cap_rows"),
        py::arg("fp8"), py::arg("max_blocks"));
  py::class_<EpDispatchArgs>(m, "EpDispatchArgs",
                             "One low-latency dispatch: device pointers as integers")
      .def(py::init<>())
      .def_readwrite("x", &EpDispatchArgs::x)
      .def_readwrite("ids", &EpDispatchArgs::ids)
      .def_readwrite("tokens", &EpDispatchArgs::tokens)
      .def_readwrite("recv_x", &EpDispatchArgs::recv_x)
      .def_readwrite("recv_counts", &EpDispatchArgs::recv_counts)
      .def_readwrite("recv_offsets", &EpDispatchArgs::recv_offsets)
      .def_readwrite("recv_src", &EpDispatchArgs::recv_src)
      .def_readwrite("send_pos", &EpDispatchArgs::send_pos)
      .def_readwrite("status", &EpDispatchArgs::status);
  py::class_<EpCombineArgs>(m, "EpCombineArgs",
                            "One low-latency combine: device pointers as integers")
      .def(py::init<>())
      .def_readwrite("y", &EpCombineArgs::y)
      .def_readwrite("ids", &EpCombineArgs::ids)
      .def_readwrite("weights", &EpCombineArgs::weights)
      .def_readwrite("send_pos", &EpCombineArgs::send_pos)
      .def_readwrite("recv_src", &EpCombineArgs::recv_src)
      .def_readwrite("recv_offsets", &EpCombineArgs::recv_offsets)
      .def_readwrite("tokens", &EpCombineArgs::tokens)
      .def_readwrite("out", &EpCombineArgs::out);
  m.def("ep_dispatch", &ep_dispatch, py::arg("comm"), py::arg("config"), py::arg("args"),
        py::arg("stream"));
  m.def("ep_combine", &ep_combine, py::arg("comm"), py::arg("config"), py::arg("args"),
        py::arg("stream"));
  m.attr("EP_STATUS_BYTES") = sizeof(EpStatus);
  m.attr("EP_OVERFLOW") = kEpOverflow;
  m.attr("EP_BAD_ID") = kEpBadId;
  m.attr("EP_MAX_BLOCKS") = kEpMaxBlocks;
  m.attr("EP_OP_CODES") = py::dict(py::arg("dispatch") = kOpEpDispatch,
                                   py::arg("combine") = kOpEpCombine,
                                   py::arg("ht_dispatch") = kOpEpHtDispatch,
                                   py::arg("ht_combine") = kOpEpHtCombine);
  m.def(
      "ep_desc",
      [](uint32_t op, const EpConfig& c) {
        const CallDesc d = ep_desc(op, c);
        return std::array<uint32_t, 6>{d.op, d.dtype, d.flags, d.a, d.b, d.c};
      },
      py::arg("op"), py::arg("config"));
}
