// Launchers of the CUDA packing kernels (lioncub_packing_kernels.cu), called by the bindings in
// lioncub_packing_cuda.cpp with raw device pointers on the current stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace lioncub {
namespace cuda {

enum class InputKind { kF32, kBF16, kF16, kU8, kI32 };

void launch_pack_signs(InputKind kind, const void* x, int64_t n, bool zero_is_positive, int bits, uint8_t* out,
                       int64_t nbytes, cudaStream_t stream);
// plus / minus: the bit patterns of +1 and -1 in the output dtype (elem_bytes 4 or 2)
void launch_unpack_signs(const uint8_t* packed, int64_t n, int elem_bytes, uint32_t plus, uint32_t minus, void* out,
                         cudaStream_t stream);
void launch_vote(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, bool zero_is_positive, uint8_t* out,
                 int64_t out_bytes, cudaStream_t stream);
int max_voters();
void launch_sum_fields(const uint8_t* rows, int64_t p, int64_t stride, int bits, int64_t numel, int32_t* out,
                       cudaStream_t stream);
void launch_pack_fields(InputKind kind, const void* values, int64_t n, int bits, uint8_t* out, int64_t nbytes,
                        cudaStream_t stream);
void launch_unpack_fields(const uint8_t* packed, int bits, int64_t n, uint8_t* out, cudaStream_t stream);
void launch_quantize_l1_pack(InputKind kind, const void* c, int64_t n, const int64_t* offsets, const float* scales,
                             int64_t nseg, int levels, int bits, uint8_t* out, int64_t nbytes, cudaStream_t stream);
// The fused Lion step, one bucket piece at a time (the piece starts at element `offset` of the bucket).
// lion_direction_pack ORs the piece's sign fields into `out` (`nbytes` bytes, zeroed by the caller before
// the first piece) and updates fp32 momentum in place; 16-bit momentum is left to the caller.
void launch_lion_direction_pack(InputKind kind, void* m, const void* g, int64_t n, int64_t offset, float b1, float a1,
                                float b2, float a2, bool zero_is_positive, int bits, uint8_t* out, int64_t nbytes,
                                cudaStream_t stream);
void launch_apply_packed_signs(InputKind kind, void* p, int64_t n, const uint8_t* packed, int64_t offset,
                               bool has_decay, float decay, float neg_lr, cudaStream_t stream);

}  // namespace cuda
}  // namespace lioncub
