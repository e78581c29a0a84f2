// The MoE grouped GEMMs (fusedist/moe/grouped_gemm_api.h): declarations only.
#include <pybind11/pybind11.h>

#include "fusedist/moe/grouped_gemm_api.h"

namespace py = pybind11;
using namespace fusedist;

void register_moe_gemm(py::module_& m) {
  py::class_<MoeGroupedGemmArgs>(m, "MoeGroupedGemmArgs",
                                 "One grouped GEMM / GEMV call: device pointers as integers, "
                                 "sizes, x's row stride in elements, dtype codes, the scale "
                                 "modes (MOE_X_SCALE_MODES, MOE_W_SCALE_MODES), the workspaces")
      .def(py::init<>())
      .def_readwrite("x", &MoeGroupedGemmArgs::x)
      .def_readwrite("w", &MoeGroupedGemmArgs::w)
      .def_readwrite("out", &MoeGroupedGemmArgs::out)
      .def_readwrite("x_scale", &MoeGroupedGemmArgs::x_scale)
      .def_readwrite("w_scale", &MoeGroupedGemmArgs::w_scale)
      .def_readwrite("counts", &MoeGroupedGemmArgs::counts)
      .def_readwrite("offsets", &MoeGroupedGemmArgs::offsets)
      .def_readwrite("src_index", &MoeGroupedGemmArgs::src_index)
      .def_readwrite("experts", &MoeGroupedGemmArgs::experts)
      .def_readwrite("n", &MoeGroupedGemmArgs::n)
      .def_readwrite("k", &MoeGroupedGemmArgs::k)
      .def_readwrite("rows", &MoeGroupedGemmArgs::rows)
      .def_readwrite("x_rows", &MoeGroupedGemmArgs::x_rows)
      .def_readwrite("ldx", &MoeGroupedGemmArgs::ldx)
      .def_readwrite("top_k", &MoeGroupedGemmArgs::top_k)
      .def_readwrite("gather", &MoeGroupedGemmArgs::gather)
      .def_readwrite("x_scale_mode", &MoeGroupedGemmArgs::x_scale_mode)
      .def_readwrite("w_scale_mode", &MoeGroupedGemmArgs::w_scale_mode)
      .def_readwrite("workspace", &MoeGroupedGemmArgs::workspace)
      .def_readwrite("workspace_bytes", &MoeGroupedGemmArgs::workspace_bytes)
      .def_readwrite("partial", &MoeGroupedGemmArgs::partial)
      .def_readwrite("counters", &MoeGroupedGemmArgs::counters)
      .def_readwrite("partial_floats", &MoeGroupedGemmArgs::partial_floats)
      .def_readwrite("counters_len", &MoeGroupedGemmArgs::counters_len)
      .def_readwrite("pairs", &MoeGroupedGemmArgs::pairs)
      .def_readwrite("max_ctas", &MoeGroupedGemmArgs::max_ctas)
      .def_property(
          "x_dtype", [](const MoeGroupedGemmArgs& a) { return int(a.x_dtype); },
          [](MoeGroupedGemmArgs& a, int v) { a.x_dtype = DType(v); })
      .def_property(
          "w_dtype", [](const MoeGroupedGemmArgs& a) { return int(a.w_dtype); },
          [](MoeGroupedGemmArgs& a, int v) { a.w_dtype = DType(v); });
  py::class_<MoeGroupedGemvPlan>(m, "MoeGroupedGemvPlan",
                                 "moe_grouped_gemv_plan's answer: grid, worst-case tasks, "
                                 "workspace sizes")
      .def_readonly("grid", &MoeGroupedGemvPlan::grid)
      .def_readonly("ctas_per_sm", &MoeGroupedGemvPlan::ctas_per_sm)
      .def_readonly("strip_rows", &MoeGroupedGemvPlan::strip_rows)
      .def_readonly("max_tasks", &MoeGroupedGemvPlan::max_tasks)
      .def_readonly("partial_floats", &MoeGroupedGemvPlan::partial_floats)
      .def_readonly("counters", &MoeGroupedGemvPlan::counters);
  m.def("moe_grouped_gemm_why_not", &moe_grouped_gemm_why_not, py::arg("args"));
  m.def("moe_grouped_gemm_workspace_size", &moe_grouped_gemm_workspace_size, py::arg("args"));
  m.def("moe_grouped_gemm", &moe_grouped_gemm, py::arg("args"), py::arg("stream"));
  m.def("moe_grouped_gemv_why_not", &moe_grouped_gemv_why_not, py::arg("args"));
  m.def("moe_grouped_gemv_plan", &moe_grouped_gemv_plan, py::arg("args"));
  m.def("moe_grouped_gemv", &moe_grouped_gemv, py::arg("args"), py::arg("stream"));
  py::dict x_modes;  // MoeGroupedGemmArgs.x_scale_mode (grouped_gemm_api.h, MoeXScale)
  x_modes["none"] = int(kMoeXScaleNone);
  x_modes["row"] = int(kMoeXScaleRow);
  x_modes["group"] = int(kMoeXScaleGroup);
  m.attr("MOE_X_SCALE_MODES") = x_modes;
  py::dict w_modes;  // MoeGroupedGemmArgs.w_scale_mode (MoeWScale)
  w_modes["none"] = int(kMoeWScaleNone);
  w_modes["expert"] = int(kMoeWScaleExpert);
  w_modes["channel"] = int(kMoeWScaleChannel);
  w_modes["block"] = int(kMoeWScaleBlock);
  m.attr("MOE_W_SCALE_MODES") = w_modes;
  m.attr("MOE_GEMV_TASK_ROWS") = kMoeGemvTaskRows;
  m.attr("MOE_GEMV_MAX_EXPERTS") = kMoeGemvMaxExperts;
}
