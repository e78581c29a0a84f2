// Host launchers for symmetric memory: allocation, CUDA IPC mapping, host-mapped error
// records and the comm descriptor. Python (fusedist/symmetric.py) orchestrates the exchange.
#include <cudaTypedefs.h>  // CUresult, CUstream for the driver entry point

#include <stdexcept>
#include <string>
#include <cstring>

#include "fusedist/comm/api.h"

namespace fusedist {

namespace {
__global__ void fill_u32_kernel(uint32_t* p, uint32_t value, uint64_t count) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = value;
}
}  // namespace

DeviceInfo device_info(int device) {
  cudaDeviceProp prop;
  FUSEDIST_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  char bus[32] = {0};
  FUSEDIST_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  return DeviceInfo{device, prop.multiProcessorCount, prop.major, prop.minor,
                    prop.name, bus, uint64_t(prop.totalGlobalMem)};
}

int current_device() {
  int d = -1;
  FUSEDIST_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

uintptr_t device_alloc(uint64_t bytes) {
  void* p = nullptr;
  FUSEDIST_CUDA_CHECK(cudaMalloc(&p, bytes));
  return reinterpret_cast<uintptr_t>(p);
}

void device_free(uintptr_t ptr) { FUSEDIST_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr))); }

std::string ipc_get_handle(uintptr_t ptr) {
  cudaIpcMemHandle_t h;
  FUSEDIST_CUDA_CHECK(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

uintptr_t ipc_open_handle(const std::string& bytes) {
  FUSEDIST_CHECK_ARG(bytes.size() == sizeof(cudaIpcMemHandle_t),
                     "ipc_open_handle: handle must be " +
                         std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  void* p = nullptr;
  FUSEDIST_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<uintptr_t>(p);
}

void ipc_close_handle(uintptr_t ptr) {
  FUSEDIST_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)));
}

int can_access_peer_by_bus_id(const std::string& peer_bus_id) {
  int peer = -1;
  if (cudaDeviceGetByPCIBusId(&peer, peer_bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();  // not visible here: clear the sticky-free error
    return -1;
  }
  const int self = current_device();
  if (peer == self) return 1;
  int ok = 0;
  FUSEDIST_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, self, peer));
  return ok;
}

void fill_u32(uintptr_t ptr, uint32_t value, uint64_t count, uintptr_t stream) {
  if (count == 0) return;
  const uint64_t blocks = (count + 255) / 256;
  fill_u32_kernel<<<unsigned(blocks < 4096 ? blocks : 4096), 256, 0,
                    reinterpret_cast<cudaStream_t>(stream)>>>(reinterpret_cast<uint32_t*>(ptr),
                                                              value, count);
  FUSEDIST_LAUNCH_CHECK("fill_u32_kernel");
}

uintptr_t host_mapped_alloc(uint64_t bytes) {
  void* p = nullptr;
  FUSEDIST_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(p, 0, bytes);
  return reinterpret_cast<uintptr_t>(p);
}

uintptr_t host_mapped_device_ptr(uintptr_t host_ptr) {
  void* d = nullptr;
  FUSEDIST_CUDA_CHECK(cudaHostGetDevicePointer(&d, reinterpret_cast<void*>(host_ptr), 0));
  return reinterpret_cast<uintptr_t>(d);
}

void host_mapped_free(uintptr_t host_ptr) {
  FUSEDIST_CUDA_CHECK(cudaFreeHost(reinterpret_cast<void*>(host_ptr)));
}

void memcpy_async(uintptr_t dst, uintptr_t src, uint64_t bytes, uintptr_t stream) {
  if (bytes == 0) return;
  // Device-to-device through unified addressing: a peer's IPC-mapped buffer as source or
  // destination makes this a copy-engine transfer over NVLink, no SMs involved.
  FUSEDIST_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                      bytes, cudaMemcpyDeviceToDevice,
                                      reinterpret_cast<cudaStream_t>(stream)));
}

void* driver_entry_point(const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  FUSEDIST_CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &q));
  if (p == nullptr || q != cudaDriverEntryPointSuccess)
    throw std::runtime_error(std::string("fusedist: the CUDA driver has no ") + symbol +
                             " (needs a driver for CUDA >= 12.0)");
  return p;
}

void stream_write_u32(uintptr_t ptr, uint32_t value, uintptr_t stream) {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  static Fn fn = reinterpret_cast<Fn>(driver_entry_point("cuStreamWriteValue32"));
  // Default flags: the write is ordered after, and makes visible, the stream's earlier work
  // (a copy-engine transfer); it runs in the GPU front end, on no SM.
  const CUresult r = fn(reinterpret_cast<CUstream>(stream), CUdeviceptr(ptr), value, 0);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("fusedist: cuStreamWriteValue32 failed (CUresult " +
                             std::to_string(int(r)) + ")");
}

void stream_synchronize(uintptr_t stream) {
  FUSEDIST_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
}

std::string copy_to_host(uintptr_t device_ptr, uint64_t bytes) {
  std::string out(bytes, '\0');
  FUSEDIST_CUDA_CHECK(cudaMemcpy(out.data(), reinterpret_cast<void*>(device_ptr), bytes,
                                 cudaMemcpyDeviceToHost));
  return out;
}

SymmComm::SymmComm(int rank, int world, const std::vector<uintptr_t>& bases,
                   uint64_t gen_bytes, uint64_t slot_bytes, uintptr_t control,
                   uintptr_t error_record_device, double timeout_s, int max_blocks_)
    : view{}, max_blocks(max_blocks_) {
  FUSEDIST_CHECK_ARG(world >= 1 && world <= kMaxRanks,
                     "SymmComm: world size " + std::to_string(world) + " outside 1.." +
                         std::to_string(kMaxRanks));
  FUSEDIST_CHECK_ARG(rank >= 0 && rank < world, "SymmComm: rank outside the world");
  FUSEDIST_CHECK_ARG(int(bases.size()) == world, "SymmComm: need one base pointer per rank");
  FUSEDIST_CHECK_ARG(slot_bytes % 16 == 0 && gen_bytes % 16 == 0,
                     "SymmComm: slot and generation sizes must be multiples of 16 bytes");
  FUSEDIST_CHECK_ARG(gen_bytes >= world * slot_bytes + 16 + kDescBytes,
                     "SymmComm: generation too small for world slots + a gather region + the "
                     "call descriptors");
  FUSEDIST_CHECK_ARG(max_blocks_ >= 1, "SymmComm: max_blocks must be >= 1");
  FUSEDIST_CHECK_ARG(timeout_s > 0, "SymmComm: timeout must be > 0");
  for (int p = 0; p < world; ++p) {
    FUSEDIST_CHECK_ARG(bases[p] % 16 == 0, "SymmComm: base pointers must be 16-byte aligned");
    view.base[p] = reinterpret_cast<uint8_t*>(bases[p]);
  }
  view.gen_bytes = gen_bytes;
  view.slot_bytes = slot_bytes;
  view.ctl = reinterpret_cast<Control*>(control);
  view.err = reinterpret_cast<ErrorRecord*>(error_record_device);
  view.timeout_ns = uint64_t(timeout_s * 1e9);
  view.rank = rank;
  view.world = world;
}

}  // namespace fusedist
