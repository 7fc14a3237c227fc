// torch's own no-op device guard, registered for CUDA.
//
// A CPU-only torch wheel has no CUDA DeviceGuardImpl, so indexing a fake CUDA tensor from Python,
// or `.to("cuda")`, raises "PyTorch is not linked with support for cuda devices". Loading this
// library (built by tests/support/sync_trace.py with torch.utils.cpp_extension) registers one that
// does nothing, which is all fake tensors need. A CUDA build of torch has the real guard: it never
// loads this.
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> noop_cuda_guard;
c10::impl::DeviceGuardImplRegistrar register_noop_cuda_guard(
    c10::DeviceType::CUDA,
    &noop_cuda_guard);

} // namespace
