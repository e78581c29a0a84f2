#include <pybind11/pybind11.h>

#include "fusedist/gemm/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_gemm(py::module_& m) {
  m.def(
      "gemm_sm90",
      [](const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, bool w_nk,
         uintptr_t bias, uintptr_t c, int64_t ldc, float beta, uintptr_t out, int64_t ldo, int m,
         int n, int k, int dtype, uintptr_t flags, int block_rows, int pieces, uintptr_t stream,
         bool wait_on_c, int wait_peer, uint64_t signal_offset, int signal_row0,
         int signal_block_rows, int signal_pieces, int tile, int raster, int m_load) {
        GemmWaitArgs wait;
        wait.flags = flags, wait.block_rows = block_rows, wait.pieces = pieces;
        wait.on_c = wait_on_c, wait.peer = wait_peer;
        GemmSignalArgs signal;
        signal.offset = signal_offset, signal.row0 = signal_row0;
        signal.block_rows = signal_block_rows, signal.pieces = signal_pieces;
        gemm_sm90(comm, x, ldx, w, ldw, w_nk, bias, c, ldc, beta, out, ldo, m, n, k, DType(dtype),
                  wait, signal, stream, tile, raster, m_load);
      },
      py::arg("comm").none(true), py::arg("x"), py::arg("ldx"), py::arg("w"), py::arg("ldw"),
      py::arg("w_nk"), py::arg("bias"), py::arg("c"), py::arg("ldc"), py::arg("beta"),
      py::arg("out"), py::arg("ldo"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("dtype"),
      py::arg("flags"), py::arg("block_rows"), py::arg("pieces"), py::arg("stream"),
      py::arg("wait_on_c") = false, py::arg("wait_peer") = -1, py::arg("signal_offset") = 0,
      py::arg("signal_row0") = 0, py::arg("signal_block_rows") = 0, py::arg("signal_pieces") = 0,
      py::arg("tile") = 0, py::arg("raster") = 0, py::arg("m_load") = 0);
  m.attr("GEMM_SM90_BLOCK_M") = kGemmSm90BlockM;
  m.attr("GEMM_SM90_BLOCK_N") = kGemmSm90BlockN;
  m.attr("GEMM_SM90_MID_MAX_M") = kGemmSm90MidMaxM;
  py::dict tiles;  // the tile configurations this build has (layout.h, Sm90Tile)
  tiles["wide"] = int(kSm90TileWide);
  tiles["narrow"] = int(kSm90TileNarrow);
  tiles["mid"] = int(kSm90TileMid);
  tiles["swap"] = int(kSm90TileSwap);
  tiles["swap_1wg"] = int(kSm90TileSwap1wg);
  m.attr("GEMM_SM90_TILES") = tiles;
  py::dict rasters;  // the scheduler's tile orders (layout.h, Sm90Raster)
  rasters["along_n"] = int(kSm90RasterAlongN);
  rasters["along_m"] = int(kSm90RasterAlongM);
  m.attr("GEMM_SM90_RASTERS") = rasters;

  py::class_<GemvArgs>(m, "GemvArgs",
                       "One gemv call: device pointers as integers, sizes, row strides in "
                       "elements, dtype codes, the scale mode (GEMV_SCALE_MODES), the workspace")
      .def(py::init<>())
      .def_readwrite("x", &GemvArgs::x)
      .def_readwrite("w", &GemvArgs::w)
      .def_readwrite("scale", &GemvArgs::scale)
      .def_readwrite("bias", &GemvArgs::bias)
      .def_readwrite("out", &GemvArgs::out)
      .def_readwrite("x_scale", &GemvArgs::x_scale)
      .def_readwrite("workspace", &GemvArgs::workspace)
      .def_readwrite("counters", &GemvArgs::counters)
      .def_readwrite("m", &GemvArgs::m)
      .def_readwrite("n", &GemvArgs::n)
      .def_readwrite("k", &GemvArgs::k)
      .def_readwrite("ldx", &GemvArgs::ldx)
      .def_readwrite("ldw", &GemvArgs::ldw)
      .def_readwrite("ldo", &GemvArgs::ldo)
      .def_readwrite("scale_ld", &GemvArgs::scale_ld)
      .def_readwrite("scale_mode", &GemvArgs::scale_mode)
      .def_readwrite("workspace_floats", &GemvArgs::workspace_floats)
      .def_readwrite("counters_len", &GemvArgs::counters_len)
      .def_readwrite("max_ctas", &GemvArgs::max_ctas)
      .def_readwrite("stages", &GemvArgs::stages)
      .def_property(
          "dtype", [](const GemvArgs& a) { return int(a.dtype); },
          [](GemvArgs& a, int v) { a.dtype = DType(v); })
      .def_property(
          "w_dtype", [](const GemvArgs& a) { return int(a.w_dtype); },
          [](GemvArgs& a, int v) { a.w_dtype = DType(v); })
      .def_property(
          "x_dtype", [](const GemvArgs& a) { return int(a.x_dtype); },
          [](GemvArgs& a, int v) { a.x_dtype = DType(v); });
  py::class_<GemvPlan>(m, "GemvPlan", "gemv_plan's answer: grid, workspace sizes, strip rows")
      .def_readonly("grid", &GemvPlan::grid)
      .def_readonly("workspace_floats", &GemvPlan::workspace_floats)
      .def_readonly("counters", &GemvPlan::counters)
      .def_readonly("strip_rows", &GemvPlan::strip_rows)
      .def_readonly("ctas_per_sm", &GemvPlan::ctas_per_sm)
      .def_readonly("units", &GemvPlan::units)
      .def_readonly("stages", &GemvPlan::stages)
      .def_readonly("smem_bytes", &GemvPlan::smem_bytes);
  m.def("gemv_plan", &gemv_plan, py::arg("args"));
  m.def("gemv", &gemv, py::arg("args"), py::arg("stream"));
  m.attr("GEMV_MAX_M") = kGemvMaxM;
  m.attr("GEMV_MAX_M_FP8_X") = kGemvMaxMFp8X;
  m.attr("GEMV_MAX_STAGES") = kGemvMaxStages;
  m.attr("GEMV_SCALE_BLOCK") = kGemvScaleBlockSize;
  py::dict scale_modes;  // GemvArgs.scale_mode values (api.h, GemvScale)
  scale_modes["none"] = int(kGemvScaleNone);
  scale_modes["tensor"] = int(kGemvScaleTensor);
  scale_modes["channel"] = int(kGemvScaleChannel);
  scale_modes["block"] = int(kGemvScaleBlock);
  m.attr("GEMV_SCALE_MODES") = scale_modes;

  py::class_<Fp8GemmArgs>(m, "Fp8GemmArgs",
                          "One fp8_gemm call: device pointers as integers, sizes, row strides "
                          "in elements, the output dtype code, persistent CTAs (0: every SM), the "
                          "stream-K workspace")
      .def(py::init<>())
      .def_readwrite("xq", &Fp8GemmArgs::xq)
      .def_readwrite("sx", &Fp8GemmArgs::sx)
      .def_readwrite("wq", &Fp8GemmArgs::wq)
      .def_readwrite("sw", &Fp8GemmArgs::sw)
      .def_readwrite("bias", &Fp8GemmArgs::bias)
      .def_readwrite("out", &Fp8GemmArgs::out)
      .def_readwrite("m", &Fp8GemmArgs::m)
      .def_readwrite("n", &Fp8GemmArgs::n)
      .def_readwrite("k", &Fp8GemmArgs::k)
      .def_readwrite("ldx", &Fp8GemmArgs::ldx)
      .def_readwrite("ldw", &Fp8GemmArgs::ldw)
      .def_readwrite("ldo", &Fp8GemmArgs::ldo)
      .def_readwrite("sms", &Fp8GemmArgs::sms)
      .def_readwrite("workspace", &Fp8GemmArgs::workspace)
      .def_readwrite("workspace_bytes", &Fp8GemmArgs::workspace_bytes)
      .def_readwrite("block", &Fp8GemmArgs::block)
      .def_property(
          "out_dtype", [](const Fp8GemmArgs& a) { return int(a.out_dtype); },
          [](Fp8GemmArgs& a, int v) { a.out_dtype = DType(v); });
  m.def("fp8_gemm_why_not", &fp8_gemm_why_not, py::arg("args"));
  m.def("fp8_gemm_workspace_size", &fp8_gemm_workspace_size, py::arg("args"));
  m.def("fp8_gemm", &fp8_gemm, py::arg("args"), py::arg("stream"));
}
