// Cache memory from the CUDA driver's virtual memory management (kernels/vmm.py documents why and how it is used).
//
// kvc_vmm_malloc / kvc_vmm_free have the signatures torch.cuda.memory.CUDAPluggableAllocator expects: each segment
// the caching allocator asks for is one address range (cuMemAddressReserve), one physical allocation at the device's
// recommended granularity (cuMemCreate, 2 MB on current GPUs) mapped onto it (cuMemMap) and made readable and
// writable by that device (cuMemSetAccess).  libcuda is opened at run time (dlopen), so building needs only a C
// compiler and cuda.h (the one Triton ships), not a CUDA toolkit or the driver's link library.
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>

#include "cuda.h"

typedef CUresult (*granularity_fn)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
typedef CUresult (*reserve_fn)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*addr_free_fn)(CUdeviceptr, size_t);
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
typedef CUresult (*sync_fn)(CUstream);

static struct {
  granularity_fn granularity;
  reserve_fn reserve;
  addr_free_fn addr_free;
  create_fn create;
  release_fn release;
  map_fn map;
  unmap_fn unmap;
  access_fn access;
  sync_fn sync;
} d;
static int ready = 0;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return;
  d.granularity = (granularity_fn)dlsym(lib, "cuMemGetAllocationGranularity");
  d.reserve = (reserve_fn)dlsym(lib, "cuMemAddressReserve");
  d.addr_free = (addr_free_fn)dlsym(lib, "cuMemAddressFree");
  d.create = (create_fn)dlsym(lib, "cuMemCreate");
  d.release = (release_fn)dlsym(lib, "cuMemRelease");
  d.map = (map_fn)dlsym(lib, "cuMemMap");
  d.unmap = (unmap_fn)dlsym(lib, "cuMemUnmap");
  d.access = (access_fn)dlsym(lib, "cuMemSetAccess");
  d.sync = (sync_fn)dlsym(lib, "cuStreamSynchronize");
  ready = d.granularity && d.reserve && d.addr_free && d.create && d.release && d.map && d.unmap && d.access &&
          d.sync;
}

// 1 where the driver's functions were found (the allocator can work), else 0.
int kvc_vmm_ready(void) {
  pthread_once(&once, load);
  return ready;
}

static CUmemAllocationProp props(int device) {
  CUmemAllocationProp p = {0};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  return p;
}

// The device's recommended granularity (bytes), 0 where it cannot be read.
size_t kvc_vmm_granularity(int device) {
  if (!kvc_vmm_ready()) return 0;
  CUmemAllocationProp p = props(device);
  size_t g = 0;
  if (d.granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS) return 0;
  return g;
}

static size_t rounded(ssize_t size, size_t g) { return ((size_t)size + g - 1) / g * g; }

void* kvc_vmm_malloc(ssize_t size, int device, void* stream) {
  (void)stream;
  const size_t g = kvc_vmm_granularity(device);
  if (!g || size <= 0) return NULL;
  const size_t n = rounded(size, g);
  CUmemAllocationProp p = props(device);
  CUdeviceptr ptr = 0;
  if (d.reserve(&ptr, n, g, 0, 0) != CUDA_SUCCESS) return NULL;
  CUmemGenericAllocationHandle h;
  if (d.create(&h, n, &p, 0) != CUDA_SUCCESS) {
    d.addr_free(ptr, n);
    return NULL;
  }
  if (d.map(ptr, n, 0, h, 0) != CUDA_SUCCESS) {
    d.release(h);
    d.addr_free(ptr, n);
    return NULL;
  }
  d.release(h);  // the mapping keeps the physical memory until it is unmapped
  CUmemAccessDesc a = {0};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = device;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (d.access(ptr, n, &a, 1) != CUDA_SUCCESS) {
    d.unmap(ptr, n);
    d.addr_free(ptr, n);
    return NULL;
  }
  return (void*)ptr;
}

void kvc_vmm_free(void* ptr, ssize_t size, int device, void* stream) {
  const size_t g = kvc_vmm_granularity(device);
  if (!g || !ptr) return;
  const size_t n = rounded(size, g);
  d.sync((CUstream)stream);  // the caching allocator frees a segment only when no use of it is pending; be safe
  d.unmap((CUdeviceptr)ptr, n);
  d.addr_free((CUdeviceptr)ptr, n);
}
