// fusedist._C attention bindings: declarations only (csrc/ops/attention/).
#include <pybind11/pybind11.h>

#include "fusedist/attention/api.h"

namespace py = pybind11;
using namespace fusedist;

void register_attention(py::module_& m) {
  py::class_<DecodeArgs>(m, "DecodeArgs",
                         "One paged decode call: device pointers as integers, sizes, dtype codes")
      .def(py::init<>())
      .def_readwrite("q", &DecodeArgs::q)
      .def_readwrite("k_cache", &DecodeArgs::k_cache)
      .def_readwrite("v_cache", &DecodeArgs::v_cache)
      .def_readwrite("k_scale", &DecodeArgs::k_scale)
      .def_readwrite("v_scale", &DecodeArgs::v_scale)
      .def_readwrite("block_table", &DecodeArgs::block_table)
      .def_readwrite("seq_lens", &DecodeArgs::seq_lens)
      .def_readwrite("out", &DecodeArgs::out)
      .def_readwrite("o_partial", &DecodeArgs::o_partial)
      .def_readwrite("lse_partial", &DecodeArgs::lse_partial)
      .def_readwrite("counters", &DecodeArgs::counters)
      .def_readwrite("batch", &DecodeArgs::batch)
      .def_readwrite("q_heads", &DecodeArgs::q_heads)
      .def_readwrite("kv_heads", &DecodeArgs::kv_heads)
      .def_readwrite("head_dim", &DecodeArgs::head_dim)
      .def_readwrite("page_size", &DecodeArgs::page_size)
      .def_readwrite("bt_stride", &DecodeArgs::bt_stride)
      .def_readwrite("num_splits", &DecodeArgs::num_splits)
      .def_readwrite("stages", &DecodeArgs::stages)
      .def_readwrite("fp8_direct", &DecodeArgs::fp8_direct)
      .def_readwrite("bt_cols", &DecodeArgs::bt_cols)
      .def_readwrite("num_pages", &DecodeArgs::num_pages)
      .def_readwrite("err", &DecodeArgs::err)
      .def_readwrite("scale", &DecodeArgs::scale)
      .def_property(
          "q_dtype", [](const DecodeArgs& a) { return int(a.q_dtype); },
          [](DecodeArgs& a, int v) { a.q_dtype = DType(v); })
      .def_property(
          "kv_dtype", [](const DecodeArgs& a) { return int(a.kv_dtype); },
          [](DecodeArgs& a, int v) { a.kv_dtype = DType(v); });
  m.def("attention_decode", &attention_decode, py::arg("args"), py::arg("stream"));
  py::class_<PrefillArgs>(m, "PrefillArgs",
                          "One paged prefill call: device pointers as integers, sizes, dtype codes")
      .def(py::init<>())
      .def_readwrite("q", &PrefillArgs::q)
      .def_readwrite("k_cache", &PrefillArgs::k_cache)
      .def_readwrite("v_cache", &PrefillArgs::v_cache)
      .def_readwrite("k_scale", &PrefillArgs::k_scale)
      .def_readwrite("v_scale", &PrefillArgs::v_scale)
      .def_readwrite("block_table", &PrefillArgs::block_table)
      .def_readwrite("seq_lens", &PrefillArgs::seq_lens)
      .def_readwrite("cu_seqlens_q", &PrefillArgs::cu_seqlens_q)
      .def_readwrite("out", &PrefillArgs::out)
      .def_readwrite("o_partial", &PrefillArgs::o_partial)
      .def_readwrite("lse_partial", &PrefillArgs::lse_partial)
      .def_readwrite("q_stride", &PrefillArgs::q_stride)
      .def_readwrite("tokens", &PrefillArgs::tokens)
      .def_readwrite("batch", &PrefillArgs::batch)
      .def_readwrite("q_heads", &PrefillArgs::q_heads)
      .def_readwrite("kv_heads", &PrefillArgs::kv_heads)
      .def_readwrite("head_dim", &PrefillArgs::head_dim)
      .def_readwrite("page_size", &PrefillArgs::page_size)
      .def_readwrite("bt_stride", &PrefillArgs::bt_stride)
      .def_readwrite("bt_cols", &PrefillArgs::bt_cols)
      .def_readwrite("num_pages", &PrefillArgs::num_pages)
      .def_readwrite("max_q_len", &PrefillArgs::max_q_len)
      .def_readwrite("num_splits", &PrefillArgs::num_splits)
      .def_readwrite("tile_rows", &PrefillArgs::tile_rows)
      .def_readwrite("tile_warps", &PrefillArgs::tile_warps)
      .def_readwrite("mainloop", &PrefillArgs::mainloop)
      .def_readwrite("err", &PrefillArgs::err)
      .def_readwrite("scale", &PrefillArgs::scale)
      .def_property(
          "q_dtype", [](const PrefillArgs& a) { return int(a.q_dtype); },
          [](PrefillArgs& a, int v) { a.q_dtype = DType(v); })
      .def_property(
          "kv_dtype", [](const PrefillArgs& a) { return int(a.kv_dtype); },
          [](PrefillArgs& a, int v) { a.kv_dtype = DType(v); });
  m.def("attention_prefill", &attention_prefill, py::arg("args"), py::arg("stream"));
  m.def("attention_prefill_tile_tokens", &attention_prefill_tile_tokens, py::arg("group"),
        py::arg("tile_rows") = 64);
  m.attr("ATTENTION_PREFILL_MAX_SPLITS") = kAttentionPrefillMaxSplits;
  py::class_<PagedCheckArgs>(m, "PagedCheckArgs",
                             "The paged-metadata check of the torch attention paths")
      .def(py::init<>())
      .def_readwrite("block_table", &PagedCheckArgs::block_table)
      .def_readwrite("seq_lens", &PagedCheckArgs::seq_lens)
      .def_readwrite("bad_rows", &PagedCheckArgs::bad_rows)
      .def_readwrite("err", &PagedCheckArgs::err)
      .def_readwrite("rows", &PagedCheckArgs::rows)
      .def_readwrite("cols", &PagedCheckArgs::cols)
      .def_readwrite("bt_stride", &PagedCheckArgs::bt_stride)
      .def_readwrite("page_size", &PagedCheckArgs::page_size)
      .def_readwrite("num_pages", &PagedCheckArgs::num_pages)
      .def_readwrite("op", &PagedCheckArgs::op);
  m.def("paged_check", &paged_check, py::arg("args"), py::arg("stream"));
  py::class_<PoisonRowsArgs>(m, "PoisonRowsArgs",
                             "NaN into the rows of the sequences paged_check marked bad")
      .def(py::init<>())
      .def_readwrite("bad_rows", &PoisonRowsArgs::bad_rows)
      .def_readwrite("out", &PoisonRowsArgs::out)
      .def_readwrite("token_stride", &PoisonRowsArgs::token_stride)
      .def_readwrite("row_bytes", &PoisonRowsArgs::row_bytes)
      .def_readwrite("seqs", &PoisonRowsArgs::seqs)
      .def_readwrite("tokens", &PoisonRowsArgs::tokens)
      .def_readwrite("elem_bytes", &PoisonRowsArgs::elem_bytes)
      .def_readwrite("nan_bits", &PoisonRowsArgs::nan_bits);
  m.def("poison_rows", &poison_rows, py::arg("args"), py::arg("stream"));
  m.attr("OP_ERROR_RECORD_BYTES") = int(sizeof(OpErrorRecord));
  m.def(
      "attention_decode_ctas_per_sm",
      [](int head_dim, int q_dtype, int kv_dtype, int stages, int fp8_direct) {
        return attention_decode_ctas_per_sm(head_dim, DType(q_dtype), DType(kv_dtype), stages,
                                            fp8_direct);
      },
      py::arg("head_dim"), py::arg("q_dtype"), py::arg("kv_dtype"), py::arg("stages") = 0,
      py::arg("fp8_direct") = 0);
  m.attr("ATTENTION_DECODE_MAX_SPLITS") = kAttentionDecodeMaxSplits;
  m.attr("ATTENTION_DECODE_TILE_HEADS") = kAttentionDecodeTileHeads;
  m.attr("ATTENTION_DECODE_SLAB") = kAttentionDecodeSlab;
}
