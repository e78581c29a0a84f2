// fusedist/comm/api.h -- the host-side API of csrc/ops/*.cu: what the bindings expose. Plain C++
// (no torch, no device code): pointers travel as uintptr_t, streams as cudaStream_t.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "fusedist/common/common.h"
#include "fusedist/common/layout.h"

namespace fusedist {

// ---- symmetric.cu: device memory, CUDA IPC, host-mapped records --------------------------
struct DeviceInfo {
  int device;
  int sm_count;
  int major, minor;
  std::string name;
  std::string pci_bus_id;
  uint64_t total_mem;
};
DeviceInfo device_info(int device);
int current_device();
uintptr_t device_alloc(uint64_t bytes);
void device_free(uintptr_t ptr);
std::string ipc_get_handle(uintptr_t ptr);        // 64 opaque bytes
uintptr_t ipc_open_handle(const std::string& h);  // maps a peer's allocation
void ipc_close_handle(uintptr_t ptr);
// Can this process's device reach the device with PCI bus id `peer_bus_id` by P2P? -1 when
// that device is not visible here (CUDA_VISIBLE_DEVICES), so only an IPC open can tell.
int can_access_peer_by_bus_id(const std::string& peer_bus_id);
void fill_u32(uintptr_t ptr, uint32_t value, uint64_t count, uintptr_t stream);
uintptr_t host_mapped_alloc(uint64_t bytes);      // zeroed, returns the host pointer
uintptr_t host_mapped_device_ptr(uintptr_t host_ptr);
void host_mapped_free(uintptr_t host_ptr);
void stream_synchronize(uintptr_t stream);
void memcpy_async(uintptr_t dst, uintptr_t src, uint64_t bytes, uintptr_t stream);  // D2D / peer
// A driver API function by name (fusedist links only cudart, so `import` works without a
// driver); throws when the driver lacks it.
void* driver_entry_point(const char* symbol);
// *ptr = value once the stream's earlier work is done and visible; no SM (cuStreamWriteValue32).
void stream_write_u32(uintptr_t ptr, uint32_t value, uintptr_t stream);
std::string copy_to_host(uintptr_t device_ptr, uint64_t bytes);  // debugging and tests

// One rank's handle on a symmetric communicator: the SymmView kernels receive, plus the
// launch limits every rank derived from the same values.
struct SymmComm {
  SymmView view;
  int max_blocks;  // min SM count over the group's ranks
  SymmComm(int rank, int world, const std::vector<uintptr_t>& bases, uint64_t gen_bytes,
           uint64_t slot_bytes, uintptr_t control, uintptr_t error_record_device,
           double timeout_s, int max_blocks);
};

// ---- call_check.cu ------------------------------------------------------------------------
// The call check (call_check.cuh): a device barrier on `stream` that exchanges `desc` with every
// peer and records a mismatch (or a peer that never comes) like the symmetric kernels do.
void call_check(const SymmComm& comm, const CallDesc& desc, uintptr_t stream);
// The bindings' form of a descriptor: (op, dtype, flags, a, b, c), as fusedist/symmetric.py
// builds it.
inline CallDesc to_call_desc(const std::array<uint32_t, 6>& d) {
  return CallDesc{d[0], d[1], d[2], d[3], d[4], d[5]};
}

// ---- allreduce.cu -------------------------------------------------------------------------
enum class AllReduceAlgo : int { kOneShot = 0, kTwoShot = 1 };
void allreduce(const SymmComm& comm, uintptr_t in, uintptr_t out, int64_t numel, DType dtype,
               AllReduceAlgo algo, uintptr_t stream);
// Largest element count `algo` accepts for `dtype` on this communicator.
int64_t allreduce_max_numel(const SymmComm& comm, DType dtype, AllReduceAlgo algo);

// ---- allreduce_rmsnorm.cu -------------------------------------------------------------------
// out_dtype: dtype (normed in the input dtype) or kFloat8E4M3 (normed + per-token scales).
void allreduce_rmsnorm(const SymmComm& comm, uintptr_t x, uintptr_t residual, uintptr_t weight,
                       uintptr_t normed, uintptr_t residual_out, uintptr_t scales, int tokens,
                       int hidden, float eps, DType dtype, DType out_dtype, uintptr_t stream);

// ---- gemm_comm.cu --------------------------------------------------------------------------
// Fused decode GEMM + all-reduce: out[m, n] = sum over ranks of x[m, k] @ w (+ bias), one kernel
// (gemm_comm.cuh). comm == nullptr: no exchange, a plain skinny GEMM on the current device.
// w is [k, n] with row stride ldw, or [n, k] with row stride ldw when w_nk (nn.Linear weight).
constexpr int kGemmArFusedMaxM = 128;
void gemm_ar_fused(const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw,
                   bool w_nk, uintptr_t bias, uintptr_t out, int m, int n, int k, DType dtype,
                   uintptr_t stream);
// gemm_rs engine='fused', on the comm stream: wait (one thread, bounded by the communicator's
// timeout) until rank `src`'s GEMM signalled `expected` tiles of piece `piece` of this rank's
// block into this rank's counters at `signal_offset` (gemm_sm90.cuh), then clear the counter.
void gemm_rs_counter_wait(const SymmComm& comm, uint64_t signal_offset, int src, int piece,
                          uint32_t expected, uintptr_t stream);

// gemm_ar engine='overlap', transport='copy_engine', last step: out rows [b[p], b[p + 1]) =
// rank p's staging rows there. SMs push this rank's rows into every peer's staging (the rows
// of the partials it pulled), one token per block; on timeout the peers' rows become NaN.
// row_bytes: bytes per row in both; out: row 0 of out. desc: the call's descriptor (the one
// its call checks carry), exchanged by block 0.
void gemm_ar_staging_gather(const SymmComm& comm, uint64_t staging_offset,
                            const std::vector<int64_t>& row_bounds, int64_t row_bytes,
                            uintptr_t out, const CallDesc& desc, uintptr_t stream);

// ---- gemm.cu ------------------------------------------------------------------------------
// Hopper GEMM (gemm_sm90.cuh): out[m, n] = x[m, k] @ w + beta * c + bias, fp32 accumulation.
// w as in gemm_ar_fused; c (0: none) and out row-major with row strides ldc / ldo.
// The fused engines' protocols (gemm_sm90.cuh); both need comm and leave a few SMs free:
//  * `wait` (flags != 0), on_c == false, ag_gemm: x is the gathered input, rank comm.rank's
//    block first, each tile after the copy pieces of its A rows are flagged.
//  * `wait`, on_c == true, gemm_rs's own block: one block of m rows whose C rows arrive in
//    `pieces` flagged pieces from rank `peer`; the C-load warp waits for them.
//  * `signal` (pieces != 0), gemm_rs's peer blocks: rows [row0, row0 + m) of the block layout
//    (none of them this rank's); each stored tile adds 1 on the owner's counters.
// tile (layout.h, Sm90Tile): 0 picks (a plain GEMM: the narrow tile up to 64 rows, the
// one-warpgroup swap tile to 128, the mid tile up to kGemmSm90MidMaxM rows with whole tiles
// readable; else the wide one);
// 1 wide; 2 narrow; 3 mid; 4 swap; 5 swap_1wg (all but wide: plain GEMMs only).
// raster (layout.h, Sm90Raster): 0 picks by tile; 1 along N; 2 along M (plain GEMMs only).
// m_load (plain GEMMs): rows of x (from row 0, row stride ldx) that may be read, m or more;
// the mainloop reads up to a whole tile of them, so no tile load runs past x's end (those
// loads are slow); rows past m never reach out. 0: m.
struct GemmWaitArgs {
  uintptr_t flags = 0;  // uint32 [blocks * pieces]; 0: no wait
  int block_rows = 0;   // rows per block
  int pieces = 1;       // copy pieces per block
  bool on_c = false;
  int peer = -1;        // on_c: the rank the rows come from (a timeout names it)
};
struct GemmSignalArgs {
  uint64_t offset = 0;  // bytes from every rank's symmetric base to its counters
  int row0 = 0;         // block-layout row of x's row 0
  int block_rows = 0;   // rows per rank block
  int pieces = 0;       // pieces per block (<= kMaxSignalPieces); 0: no signals
};
void gemm_sm90(const SymmComm* comm, uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, bool w_nk,
               uintptr_t bias, uintptr_t c, int64_t ldc, float beta, uintptr_t out, int64_t ldo,
               int m, int n, int k, DType dtype, const GemmWaitArgs& wait,
               const GemmSignalArgs& signal, uintptr_t stream, int tile = 0, int raster = 0,
               int m_load = 0);

}  // namespace fusedist
