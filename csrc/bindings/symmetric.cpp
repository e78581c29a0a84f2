#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "fusedist/comm/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_symmetric(py::module_& m) {
  py::class_<DeviceInfo>(m, "DeviceInfo")
      .def_readonly("device", &DeviceInfo::device)
      .def_readonly("sm_count", &DeviceInfo::sm_count)
      .def_readonly("major", &DeviceInfo::major)
      .def_readonly("minor", &DeviceInfo::minor)
      .def_readonly("name", &DeviceInfo::name)
      .def_readonly("pci_bus_id", &DeviceInfo::pci_bus_id)
      .def_readonly("total_mem", &DeviceInfo::total_mem);
  m.def("device_info", &device_info, py::arg("device"));
  m.def("current_device", &current_device);
  m.def("device_alloc", &device_alloc, py::arg("bytes"));
  m.def("device_free", &device_free, py::arg("ptr"));
  m.def("ipc_get_handle", [](uintptr_t p) { return py::bytes(ipc_get_handle(p)); }, py::arg("ptr"));
  m.def("ipc_open_handle", [](py::bytes h) { return ipc_open_handle(std::string(h)); }, py::arg("handle"));
  m.def("ipc_close_handle", &ipc_close_handle, py::arg("ptr"));
  m.def("can_access_peer_by_bus_id", &can_access_peer_by_bus_id, py::arg("peer_bus_id"));
  m.def("fill_u32", &fill_u32, py::arg("ptr"), py::arg("value"), py::arg("count"), py::arg("stream"));
  m.def("host_mapped_alloc", &host_mapped_alloc, py::arg("bytes"));
  m.def("host_mapped_device_ptr", &host_mapped_device_ptr, py::arg("host_ptr"));
  m.def("host_mapped_free", &host_mapped_free, py::arg("host_ptr"));
  m.def("memcpy_async", &memcpy_async, py::arg("dst"), py::arg("src"), py::arg("bytes"),
        py::arg("stream"));
  m.def("stream_write_u32", &stream_write_u32, py::arg("ptr"), py::arg("value"), py::arg("stream"));
  m.def("stream_synchronize", &stream_synchronize, py::arg("stream"),
        py::call_guard<py::gil_scoped_release>());
  m.def("copy_to_host", [](uintptr_t p, uint64_t n) { return py::bytes(copy_to_host(p, n)); },
        py::arg("device_ptr"), py::arg("bytes"));
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("GENERATIONS") = kGenerations;
  m.attr("EPOCH_PERIOD") = kEpochPeriod;
  m.attr("DESC_BYTES") = kDescBytes;
  m.attr("ERR_TIMEOUT") = kErrTimeout;
  m.attr("ERR_MISMATCH") = kErrMismatch;
  m.def("next_epoch", [](uint32_t e) { return next_epoch(e); }, py::arg("epoch"));
  m.def("generation_of", [](uint32_t e) { return generation_of(e); }, py::arg("epoch"));
  // A call descriptor crosses as the tuple (op, dtype, flags, a, b, c) (fusedist/symmetric.py).
  m.def(
      "desc_words",
      [](const std::array<uint32_t, 6>& d, uint32_t epoch) {
        std::vector<uint32_t> w(4);
        for (int k = 0; k < 4; ++k) w[k] = desc_word(k, to_call_desc(d), epoch);
        return w;
      },
      py::arg("desc"), py::arg("epoch"));
  m.def(
      "call_check",
      [](const SymmComm& c, const std::array<uint32_t, 6>& d, uintptr_t stream) {
        call_check(c, to_call_desc(d), stream);
      },
      py::arg("comm"), py::arg("desc"), py::arg("stream"));
  m.attr("OP_CODES") = py::dict(
      py::arg("one_shot") = uint32_t(kOpOneShot), py::arg("two_shot") = uint32_t(kOpTwoShot),
      py::arg("all_reduce_add_rmsnorm") = uint32_t(kOpOneShotRmsNorm),
      py::arg("gemm_ar") = uint32_t(kOpGemmAr), py::arg("ag_gemm") = uint32_t(kOpAgGemm),
      py::arg("gemm_rs") = uint32_t(kOpGemmRs), py::arg("call_check") = uint32_t(kOpCallCheck),
      py::arg("nccl_all_reduce") = uint32_t(kOpNcclAllReduce),
      py::arg("nccl_all_gather") = uint32_t(kOpNcclAllGather),
      py::arg("nccl_reduce_scatter") = uint32_t(kOpNcclReduceScatter));
  m.attr("DESC_FP8_OUT") = kDescFp8Out;
  m.attr("DESC_ENGINE_COPY_ENGINE") = kDescEngineCopyEngine;
  m.attr("DESC_ENGINE_FUSED") = kDescEngineFused;
  m.attr("EMPTY_WORD") = kEmptyWord;
  m.attr("ERROR_RECORD_BYTES") = sizeof(ErrorRecord);
  m.attr("CONTROL_BYTES") = sizeof(Control);
  py::class_<SymmComm>(m, "SymmComm")
      .def(py::init<int, int, const std::vector<uintptr_t>&, uint64_t, uint64_t, uintptr_t,
                    uintptr_t, double, int>(),
           py::arg("rank"), py::arg("world"), py::arg("bases"), py::arg("gen_bytes"),
           py::arg("slot_bytes"), py::arg("control"), py::arg("error_record"),
           py::arg("timeout_s"), py::arg("max_blocks"))
      .def_readonly("max_blocks", &SymmComm::max_blocks);
}
