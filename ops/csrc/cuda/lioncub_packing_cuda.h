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

// ---------------------------------------------------------------- #47: the second generation (lioncub_bandwidth_kernels.cu)
//
// The same results as the launchers above (and as the torch path), written for the memory-bandwidth limit: whole
// warps read coalesced rows and pack 32 signs with one ballot, the vote counts 32 or 128 positions per thread in
// bit-sliced counters. The bindings call these; the launchers above stay as "v1" (DS_LIONCUB_CUDA_KERNELS=v1), the
// kernels before #47, for the benchmarks' "before".
void launch_pack_signs_v2(InputKind kind, const void* x, int64_t n, bool zero_is_positive, int bits, uint8_t* out,
                          int64_t nbytes, cudaStream_t stream);
// `sign_bytes`: the bytes of `packed` that may be read (at least ceil(n / 8)).
void launch_unpack_signs_v2(const uint8_t* packed, int64_t sign_bytes, int64_t n, int elem_bytes, uint32_t plus,
                            uint32_t minus, void* out, cudaStream_t stream);
// The packed bits "at least `threshold` of the p rows have a 1 here" for the first `numel` positions of each row
// (the 1-bit vote: threshold = vote_threshold(p, zero_is_positive)); out_bytes >= ceil(numel / 8), the bytes past
// the positions 0.
void launch_vote_v2(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, int64_t threshold, uint8_t* out,
                    int64_t out_bytes, cudaStream_t stream);
// The same for b-bit fields (b = 2, 4, 8): bit i is 1 where the sum over the rows of field i is >= threshold. One
// kernel for the k-bit votes' "unpack, sum and compare" (a k-bit all-reduce's summed message is one row).
void launch_vote_field_sums(const uint8_t* rows, int64_t p, int64_t stride, int bits, int64_t numel,
                            int64_t threshold, uint8_t* out, int64_t out_bytes, cudaStream_t stream);
// launch_quantize_l1_pack with each segment's scale computed from its mean |c| in the kernel, as l1_scale does in
// torch: levels * (1 / (clip * mu)) rounded to fp32 at each step, 0 where mu is not > 0.
void launch_quantize_l1_means_pack(InputKind kind, const void* c, int64_t n, const int64_t* offsets,
                                   const float* means, int64_t nseg, int levels, float clip, int bits, uint8_t* out,
                                   int64_t nbytes, cudaStream_t stream);
// Option clip's sketch of every piece in one launch. `pieces` (device, int64): [0] a zero the blocks count on,
// then npieces + 1 row starts, and per piece its address, numel, first bin, first table position and InputKind
// (kF32, kBF16 or kF16), each an array of npieces. `scratch`: fold_size doubles (a power of two >= bins).
constexpr int kSketchPieceFields = 5;
int64_t sketch_descriptor_length(int64_t npieces);
int64_t sketch_rows_of(int64_t numel, int64_t column, int64_t bins);
void launch_sketch_and_squares(int64_t* pieces, int64_t npieces, int64_t total_rows, int64_t bins,
                               const uint8_t* signs, int64_t period, double* out, double* scratch, int64_t fold_size,
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace lioncub
