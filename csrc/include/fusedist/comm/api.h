// fusedist/comm/api.h -- the host API of the comm area's launchers (symmetric.cu, call_check.cu,
// allreduce.cu, allreduce_rmsnorm.cu, fp8_codec.cu): what the bindings expose of symmetric memory, the call
// check and the symmetric all-reduces; the GEMM area's host API (gemm/api.h) builds on its
// SymmComm. Plain C++ (no torch, no device code): pointers travel as uintptr_t, streams as
// cudaStream_t.
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

// ---- fp8_codec.cu: the FP8 payload codec of fusedist.comm.fp8 (fp8_codec.cuh) ---------------
// x: numel elements of dtype (float32 / float16 / bfloat16); q: ceil(numel / block) * block
// bytes; scales: ceil(numel / block) floats.
struct Fp8EncodeArgs {
  uintptr_t x = 0, q = 0, scales = 0;
  int64_t numel = 0;
  int block = 0;
  DType dtype = DType::kFloat32;
  int fmt = kFp8E4M3;  // payload format (common.h Fp8Format)
};
void fp8_encode(const Fp8EncodeArgs& args, uintptr_t stream);
// out[i] (float32, i < numel) = the sum over `payloads` payloads, in order, of q * scale;
// payload r's bytes at q + r * q_stride, its scales at scales + r * scale_stride.
struct Fp8DecodeSumArgs {
  uintptr_t q = 0, scales = 0, out = 0;
  int64_t numel = 0, q_stride = 0, scale_stride = 0;
  int block = 0;
  int payloads = 1;
  int fmt = kFp8E4M3;  // as Fp8EncodeArgs::fmt
};
void fp8_decode_sum(const Fp8DecodeSumArgs& args, uintptr_t stream);

}  // namespace fusedist
