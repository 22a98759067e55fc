// ds_lioncub packing kernels for CUDA, second generation (#47): the 1-bit step's pack, vote and unpack written for
// the memory-bandwidth limit, the k-bit votes' "unpack, sum and compare" in one kernel, the L1 quantizer with its
// per-segment scales computed from the segments' mean |c| in the kernel, and option clip's sketch in one launch.
// Same layouts, tie rules and results as the first generation (lioncub_packing_kernels.cu) and as the torch path
// (../includes/lioncub_packing.h); built without --use_fast_math (the L1 scale and quantizer round as torch does).
//
// Why the first generation fell short (benchmarks/RESULTS.md, "On a GPU"): its vote gives each thread one byte
// of output and walks a fixed 16 bit planes per row (7% of the copy bandwidth: instruction bound); its pack and
// unpack move one element or one byte per thread per loop turn. Here a warp takes 1,024 elements at a time: 32
// coalesced loads per lane (in flight together), 32 ballots, one 128-byte store; unpack reads one packed word per
// lane and writes 16-byte stores that cover 512 contiguous bytes per warp instruction; the vote counts 128 (or 32)
// positions per thread with as many bit planes as p needs, its rows read 16 bytes at a time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lioncub_packing.h"
#include "lioncub_packing_cuda.h"

namespace lioncub {
namespace cuda {
namespace {

constexpr int kBlock = 256;
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kChunk = 1024;  // a warp's turn: 32 rounds of 32 lanes, i.e. 32 words of 32 signs
constexpr int64_t kMaxBlocks = int64_t(1) << 16;

inline unsigned blocks_for(int64_t threads, int block)
{
    int64_t blocks = (threads + block - 1) / block;
    blocks = blocks < 1 ? 1 : blocks;
    return static_cast<unsigned>(blocks > kMaxBlocks ? kMaxBlocks : blocks);
}

inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

__device__ __forceinline__ int64_t global_thread() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t global_threads() { return int64_t(gridDim.x) * blockDim.x; }

// A vote no count can reach: every byte 0 (a kernel, so that the binding's launch check covers it).
__global__ void zero_bytes_kernel(uint8_t* out, int64_t n)
{
    for (int64_t i = global_thread(); i < n; i += global_threads()) out[i] = 0;
}

// The bits of positions bit0 .. bit0 + 31 that lie below numel.
__device__ __forceinline__ uint32_t valid_mask(int64_t numel, int64_t bit0)
{
    const int64_t left = numel - bit0;
    return left >= 32 ? kFull : (left <= 0 ? 0u : ((1u << left) - 1u));
}

// kCount 32-bit words into bytes [first, first + 4 * kCount) of out, the ones below nbytes; one vector store when
// they are all there and `vec` (out aligned to min(16, 4 * kCount) bytes; `first` is a multiple of 4 * kCount).
template <int kCount>
__device__ __forceinline__ void store_words(uint8_t* out, int64_t first, int64_t nbytes, const uint32_t (&w)[kCount],
                                            bool vec)
{
    if (vec && first + 4 * kCount <= nbytes) {
        if constexpr (kCount == 1) {
            *reinterpret_cast<uint32_t*>(out + first) = w[0];
        } else if constexpr (kCount == 2) {
            *reinterpret_cast<uint2*>(out + first) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
            for (int k = 0; k < kCount; k += 4)
                *reinterpret_cast<uint4*>(out + first + 4 * k) = make_uint4(w[k], w[k + 1], w[k + 2], w[k + 3]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4 * kCount; ++k)
            if (first + k < nbytes) out[first + k] = static_cast<uint8_t>(w[k >> 2] >> (8 * (k & 3)));
    }
}

// ---------------------------------------------------------------- sign readers: a raw load, then the sign test

struct SignF32 {
    const float* p;
    using raw_t = float;
    __device__ __forceinline__ raw_t load(int64_t i) const { return __ldg(p + i); }
    __device__ __forceinline__ static bool test(raw_t v, bool zip) { return float_positive(v, zip); }
};
struct SignBF16 {
    const uint16_t* p;
    using raw_t = uint16_t;
    __device__ __forceinline__ raw_t load(int64_t i) const { return __ldg(p + i); }
    __device__ __forceinline__ static bool test(raw_t v, bool zip) { return half_bits_positive(v, 0x7F80, zip); }
};
struct SignF16 {
    const uint16_t* p;
    using raw_t = uint16_t;
    __device__ __forceinline__ raw_t load(int64_t i) const { return __ldg(p + i); }
    __device__ __forceinline__ static bool test(raw_t v, bool zip) { return half_bits_positive(v, 0x7C00, zip); }
};
struct SignU8 {  // bool, or uint8 0/1: bit 0 is the sign bit
    const uint8_t* p;
    using raw_t = uint8_t;
    __device__ __forceinline__ raw_t load(int64_t i) const { return __ldg(p + i); }
    __device__ __forceinline__ static bool test(raw_t v, bool) { return (v & 1u) != 0; }
};

// ---------------------------------------------------------------- pack signs

// Word k (0 <= k < kBits) of the kBits-bit sign fields of the 32 signs in x (field j = bit j of x).
template <int kBits>
__device__ __forceinline__ uint32_t sign_fields_word(uint32_t x, int k)
{
    if constexpr (kBits == 1) {
        return x;
    } else if constexpr (kBits == 2) {  // 16 signs per word: bit j -> bit 2j
        uint32_t v = (x >> (16 * k)) & 0xFFFFu;
        v = (v | (v << 8)) & 0x00FF00FFu;
        v = (v | (v << 4)) & 0x0F0F0F0Fu;
        v = (v | (v << 2)) & 0x33333333u;
        return (v | (v << 1)) & 0x55555555u;
    } else if constexpr (kBits == 4) {  // 8 signs per word: bit j -> bit 4j
        uint32_t v = (x >> (8 * k)) & 0xFFu;
        v = (v | (v << 12)) & 0x000F000Fu;
        v = (v | (v << 6)) & 0x03030303u;
        return (v | (v << 3)) & 0x11111111u;
    } else {  // 4 signs per word: bit j -> bit 8j
        uint32_t v = (x >> (4 * k)) & 0xFu;
        v = (v | (v << 14)) & 0x00030003u;
        return (v | (v << 7)) & 0x01010101u;
    }
}

// The 32 sign words of a warp's chunk (elements e0 .. e0 + 1023); lane k returns word k (elements e0 + 32k ..).
// All 32 loads of a lane are issued before the first ballot; kWhole: the chunk lies below n.
template <bool kWhole, typename R>
__device__ __forceinline__ uint32_t ballot_chunk(const R& in, int64_t e0, int64_t n, bool zip, int lane)
{
    typename R::raw_t v[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        const int64_t i = e0 + 32 * k + lane;
        v[k] = (kWhole || i < n) ? in.load(i) : typename R::raw_t(0);
    }
    uint32_t mine = 0;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        const bool bit = R::test(v[k], zip) && (kWhole || e0 + 32 * k + lane < n);
        const uint32_t word = __ballot_sync(kFull, bit);
        mine = lane == k ? word : mine;
    }
    return mine;
}

// One warp per chunk of 1,024 elements, which fill 128 * kBits bytes of the message: lane k writes the kBits words
// of the fields of signs 32k .. 32k + 31 (one coalesced store per warp for 1-bit signs). Every byte below nbytes is
// written (the fields of elements past n are 0).
template <int kBits, typename R>
__global__ void __launch_bounds__(kBlock)
    pack_signs_v2_kernel(R in, int64_t n, bool zip, uint8_t* out, int64_t nbytes, bool vec)
{
    const int lane = threadIdx.x & 31;
    constexpr int64_t kChunkBytes = 128 * kBits;
    const int64_t chunks = (nbytes + kChunkBytes - 1) / kChunkBytes;
    for (int64_t c = global_thread() >> 5; c < chunks; c += global_threads() >> 5) {  // warp-uniform
        const int64_t e0 = c * kChunk;
        const uint32_t mine =
            e0 + kChunk <= n ? ballot_chunk<true>(in, e0, n, zip, lane) : ballot_chunk<false>(in, e0, n, zip, lane);
        uint32_t w[kBits];
#pragma unroll
        for (int k = 0; k < kBits; ++k) w[k] = sign_fields_word<kBits>(mine, k);
        store_words<kBits>(out, c * kChunkBytes + int64_t(lane) * 4 * kBits, nbytes, w, vec);
    }
}

template <typename R>
void pack_signs_v2_with(R in, int64_t n, bool zip, int bits, uint8_t* out, int64_t nbytes, cudaStream_t stream)
{
    const int64_t chunks = (nbytes + 128 * bits - 1) / (128 * bits);
    const unsigned grid = blocks_for(chunks * 32, kBlock);
    const bool vec = aligned(out, bits == 1 ? 4 : (bits == 2 ? 8 : 16));
    switch (bits) {
        case 1: pack_signs_v2_kernel<1><<<grid, kBlock, 0, stream>>>(in, n, zip, out, nbytes, vec); break;
        case 2: pack_signs_v2_kernel<2><<<grid, kBlock, 0, stream>>>(in, n, zip, out, nbytes, vec); break;
        case 4: pack_signs_v2_kernel<4><<<grid, kBlock, 0, stream>>>(in, n, zip, out, nbytes, vec); break;
        default: pack_signs_v2_kernel<8><<<grid, kBlock, 0, stream>>>(in, n, zip, out, nbytes, vec); break;
    }
}

// ---------------------------------------------------------------- unpack signs

// One warp per chunk of 1,024 elements: lane k loads packed word k of the chunk; each round, lane k takes the bits
// of its 16-byte store (4 fp32 or 8 16-bit values) from the lane that holds them (a shuffle), so that every store
// instruction of the warp writes 512 contiguous bytes. `packed_words`: packed is 4-byte aligned; `vec`: out 16.
template <typename Word>
__global__ void __launch_bounds__(kBlock) unpack_signs_v2_kernel(const uint8_t* packed, int64_t sign_bytes, int64_t n,
                                                                  Word plus, Word minus, Word* out, bool packed_words,
                                                                  bool vec)
{
    constexpr int kPer = 16 / static_cast<int>(sizeof(Word));  // elements per 16-byte store
    constexpr int kRounds = kChunk / (32 * kPer);
    const int lane = threadIdx.x & 31;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = global_thread() >> 5; c < chunks; c += global_threads() >> 5) {  // warp-uniform
        const int64_t e0 = c * kChunk;
        const int64_t b = c * (kChunk / 8) + 4 * lane;  // this lane's packed word: bytes b .. b + 3
        uint32_t mine = 0;
        if (packed_words && b + 4 <= sign_bytes) {
            mine = __ldg(reinterpret_cast<const unsigned int*>(packed + b));
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (b + k < sign_bytes) mine |= uint32_t(__ldg(packed + b + k)) << (8 * k);
        }
#pragma unroll
        for (int r = 0; r < kRounds; ++r) {
            const int bit0 = (32 * r + lane) * kPer;  // the store's first element, within the chunk
            const uint32_t word = __shfl_sync(kFull, mine, bit0 >> 5);
            const uint32_t bits = word >> (bit0 & 31);
            const int64_t e = e0 + bit0;
            alignas(16) Word v[kPer];
#pragma unroll
            for (int j = 0; j < kPer; ++j) v[j] = ((bits >> j) & 1u) ? plus : minus;
            if (vec && e + kPer <= n) {
                *reinterpret_cast<uint4*>(out + e) = *reinterpret_cast<const uint4*>(v);
            } else {
                for (int j = 0; j < kPer && e + j < n; ++j) out[e + j] = v[j];
            }
        }
    }
}

// ---------------------------------------------------------------- the vote: counts of 1 bits over rows, compared

// kWords 32-bit words of one row from byte `first` (a multiple of 4 * kWords): one aligned load (kWide: the rows and
// their stride are aligned, and `first` lies below sign_bytes <= stride, so the words are inside the row), else byte
// by byte, only those below sign_bytes.
template <int kWords, bool kWide>
__device__ __forceinline__ void load_row_words(const uint8_t* at, int64_t first, int64_t sign_bytes,
                                               uint32_t (&x)[kWords])
{
    if constexpr (kWide) {
        if constexpr (kWords == 4) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(at));
            x[0] = v.x;
            x[1] = v.y;
            x[2] = v.z;
            x[3] = v.w;
        } else {
#pragma unroll
            for (int w = 0; w < kWords; ++w) x[w] = __ldg(reinterpret_cast<const unsigned int*>(at) + w);
        }
    } else {
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
            x[w] = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (first + 4 * w + k < sign_bytes) x[w] |= uint32_t(__ldg(at + 4 * w + k)) << (8 * k);
        }
    }
}

// One thread per 4 * kWords output bytes (32 * kWords positions): for each row, its words are added into bit-sliced
// counters (plane k holds bit k of the 32 counts of each word; kPlanes > bit_length(p) - 1, so no count overflows),
// then count >= threshold (0 <= threshold <= p) is decided from the top plane down. Bytes of out past the positions
// are written 0.
template <int kPlanes, int kWords, bool kWide>
__global__ void __launch_bounds__(kBlock) vote_v2_kernel(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel,
                                                          uint32_t threshold, uint8_t* out, int64_t out_bytes, bool vec)
{
    constexpr int kUnit = 4 * kWords;
    const int64_t sign_bytes = (numel + 7) / 8;
    const int64_t units = (out_bytes + kUnit - 1) / kUnit;
    for (int64_t u = global_thread(); u < units; u += global_threads()) {
        const int64_t first = u * kUnit;
        uint32_t result[kWords];
#pragma unroll
        for (int w = 0; w < kWords; ++w) result[w] = 0;
        if (first < sign_bytes) {
            uint32_t plane[kPlanes][kWords];
#pragma unroll
            for (int k = 0; k < kPlanes; ++k)
#pragma unroll
                for (int w = 0; w < kWords; ++w) plane[k][w] = 0;
            const uint8_t* at = rows + first;
#pragma unroll 4
            for (int64_t r = 0; r < p; ++r) {
                uint32_t x[kWords];
                load_row_words<kWords, kWide>(at + r * stride, first, sign_bytes, x);
#pragma unroll
                for (int w = 0; w < kWords; ++w) {
                    uint32_t carry = x[w];
#pragma unroll
                    for (int k = 0; k < kPlanes; ++k) {
                        const uint32_t next = plane[k][w] & carry;
                        plane[k][w] ^= carry;
                        carry = next;
                    }
                }
            }
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                uint32_t greater = 0, equal = kFull;
#pragma unroll
                for (int k = kPlanes - 1; k >= 0; --k) {
                    if ((threshold >> k) & 1u) {
                        equal &= plane[k][w];
                    } else {
                        greater |= equal & plane[k][w];
                        equal &= ~plane[k][w];
                    }
                }
                result[w] = (greater | equal) & valid_mask(numel, 8 * first + 32 * w);
            }
        }
        store_words<kWords>(out, first, out_bytes, result, vec);
    }
}

template <int kPlanes>
void vote_v2_planes(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, uint32_t threshold, uint8_t* out,
                    int64_t out_bytes, cudaStream_t stream)
{
    if (aligned(rows, 16) && stride % 16 == 0) {
        const unsigned grid = blocks_for((out_bytes + 15) / 16, kBlock);
        vote_v2_kernel<kPlanes, 4, true>
            <<<grid, kBlock, 0, stream>>>(rows, p, stride, numel, threshold, out, out_bytes, aligned(out, 16));
        return;
    }
    const unsigned grid = blocks_for((out_bytes + 3) / 4, kBlock);
    if (aligned(rows, 4) && stride % 4 == 0) {
        vote_v2_kernel<kPlanes, 1, true>
            <<<grid, kBlock, 0, stream>>>(rows, p, stride, numel, threshold, out, out_bytes, aligned(out, 4));
    } else {
        vote_v2_kernel<kPlanes, 1, false>
            <<<grid, kBlock, 0, stream>>>(rows, p, stride, numel, threshold, out, out_bytes, aligned(out, 4));
    }
}

// ---------------------------------------------------------------- the k-bit votes: field sums compared

// The kBits words of a row holding the fields of 32 positions, from byte `first` (a multiple of 4 * kBits): one or
// two aligned vector loads (kWide: rows 16-byte aligned, stride a multiple of 4 * kBits), else byte by byte below
// field_bytes.
template <int kBits, bool kWide>
__device__ __forceinline__ void load_field_words(const uint8_t* at, int64_t first, int64_t field_bytes,
                                                 uint32_t (&w)[kBits])
{
    if constexpr (kWide) {
        if constexpr (kBits == 2) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(at));
            w[0] = v.x;
            w[1] = v.y;
        } else {
#pragma unroll
            for (int k = 0; k < kBits; k += 4) {
                const uint4 v = __ldg(reinterpret_cast<const uint4*>(at) + k / 4);
                w[k] = v.x;
                w[k + 1] = v.y;
                w[k + 2] = v.z;
                w[k + 3] = v.w;
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < kBits; ++k) {
            w[k] = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b)
                if (first + 4 * k + b < field_bytes) w[k] |= uint32_t(__ldg(at + 4 * k + b)) << (8 * b);
        }
    }
}

// One thread per 32 positions (one output word): each row's 32 fields added into 32 int32 sums, then
// sum >= threshold packed, one bit per position.
template <int kBits, bool kWide>
__global__ void __launch_bounds__(kBlock)
    field_vote_kernel(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, int32_t threshold, uint8_t* out,
                      int64_t out_bytes, bool vec)
{
    constexpr uint32_t kMask = (1u << kBits) - 1u;
    const int64_t field_bytes = (numel * kBits + 7) / 8;
    const int64_t units = (out_bytes + 3) / 4;
    for (int64_t u = global_thread(); u < units; u += global_threads()) {
        uint32_t result[1] = {0u};
        if (32 * u < numel) {
            const int64_t first = u * 4 * kBits;
            int32_t sum[32];
#pragma unroll
            for (int j = 0; j < 32; ++j) sum[j] = 0;
            const uint8_t* at = rows + first;
#pragma unroll 4
            for (int64_t r = 0; r < p; ++r) {
                uint32_t w[kBits];
                load_field_words<kBits, kWide>(at + r * stride, first, field_bytes, w);
#pragma unroll
                for (int j = 0; j < 32; ++j)
                    sum[j] += static_cast<int32_t>((w[(j * kBits) >> 5] >> ((j * kBits) & 31)) & kMask);
            }
            uint32_t bits = 0;
#pragma unroll
            for (int j = 0; j < 32; ++j) bits |= uint32_t(sum[j] >= threshold) << j;
            result[0] = bits & valid_mask(numel, 32 * u);
        }
        store_words<1>(out, 4 * u, out_bytes, result, vec);
    }
}

template <int kBits>
void field_vote_with(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, int32_t threshold, uint8_t* out,
                     int64_t out_bytes, cudaStream_t stream)
{
    const unsigned grid = blocks_for((out_bytes + 3) / 4, kBlock);
    const bool vec = aligned(out, 4);
    if (aligned(rows, 16) && stride % (4 * kBits) == 0) {
        field_vote_kernel<kBits, true>
            <<<grid, kBlock, 0, stream>>>(rows, p, stride, numel, threshold, out, out_bytes, vec);
    } else {
        field_vote_kernel<kBits, false>
            <<<grid, kBlock, 0, stream>>>(rows, p, stride, numel, threshold, out, out_bytes, vec);
    }
}

// ---------------------------------------------------------------- L1: the scales from the means, quantize, pack

// torch's l1_scale (ds_lioncub/comm/quantize.py): `levels / (clip * mu)` on fp32 tensors is
// `(clip * mu).reciprocal() * levels` (Tensor.__rtruediv__), each step rounded to fp32; 0 where mu is not > 0.
__device__ __forceinline__ float l1_scale_of(float mu, float clip, int32_t levels)
{
    return mu > 0.0f ? __fmul_rn(__frcp_rn(__fmul_rn(clip, mu)), static_cast<float>(levels)) : 0.0f;
}

struct ValueF32 {
    const float* p;
    // elements first .. first + 7 (0 past n); `vec`: p is 16-byte aligned (first is a multiple of 8)
    __device__ __forceinline__ void load8(int64_t first, int64_t n, bool vec, float (&v)[8]) const
    {
        if (vec && first + 8 <= n) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(p + first));
            const float4 b = __ldg(reinterpret_cast<const float4*>(p + first) + 1);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = first + j < n ? __ldg(p + first + j) : 0.0f;
        }
    }
};
template <bool kBF16>
struct ValueHalf {
    const uint16_t* p;
    __device__ __forceinline__ static float widen(uint32_t h)
    {
        if constexpr (kBF16) return __uint_as_float(h << 16);
        else return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
    }
    __device__ __forceinline__ void load8(int64_t first, int64_t n, bool vec, float (&v)[8]) const
    {
        if (vec && first + 8 <= n) {
            const uint4 a = __ldg(reinterpret_cast<const uint4*>(p + first));
            const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = widen((w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = first + j < n ? widen(__ldg(p + first + j)) : 0.0f;
        }
    }
};

// The group's kBits bytes (the low bytes of w) at byte `first` (= group * kBits) of out, those below nbytes; one
// store when all are there and `vec` (out 8-byte aligned).
template <int kBits>
__device__ __forceinline__ void store_group_bytes(uint8_t* out, int64_t first, uint64_t w, int64_t nbytes, bool vec)
{
    if (vec && first + kBits <= nbytes) {
        if constexpr (kBits == 2) *reinterpret_cast<uint16_t*>(out + first) = static_cast<uint16_t>(w);
        else if constexpr (kBits == 4) *reinterpret_cast<uint32_t*>(out + first) = static_cast<uint32_t>(w);
        else *reinterpret_cast<unsigned long long*>(out + first) = w;
    } else {
#pragma unroll
        for (int k = 0; k < kBits; ++k)
            if (first + k < nbytes) out[first + k] = static_cast<uint8_t>(w >> (8 * k));
    }
}

// One thread per group of 8 elements (kBits bytes of fields): the segment of the group's first element by binary
// search over the offsets, its scale from its mean, then q = clamp(round_half_even(c * scale), -L, L) + L per
// element (a NaN product gives q = 0, as torch's int32 cast of NaN keeps L in the low byte), packed.
template <int kBits, typename R>
__global__ void __launch_bounds__(kBlock)
    l1_means_pack_kernel(R in, int64_t n, const int64_t* offsets, const float* means, int64_t nseg, int32_t levels,
                         float clip, uint8_t* out, int64_t nbytes, bool vec_in, bool vec_out)
{
    const int64_t groups = (nbytes + kBits - 1) / kBits;
    for (int64_t g = global_thread(); g < groups; g += global_threads()) {
        const int64_t first = 8 * g;
        uint64_t w = 0;
        if (first < n) {
            float v[8];
            in.load8(first, n, vec_in, v);
            int64_t lo = 0, hi = nseg;  // offsets[lo] <= first < offsets[hi]: at the end, segment lo holds first
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (__ldg(offsets + mid) <= first) lo = mid;
                else hi = mid;
            }
            int64_t s = lo, end = __ldg(offsets + lo + 1);
            float scale = l1_scale_of(__ldg(means + s), clip, levels);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int64_t i = first + j;
                if (i < n) {
                    if (i >= end) {  // the next non-empty segment
                        do {
                            ++s;
                            end = __ldg(offsets + s + 1);
                        } while (end <= i);
                        scale = l1_scale_of(__ldg(means + s), clip, levels);
                    }
                    w |= uint64_t(l1_field_from_rounded(rintf(__fmul_rn(v[j], scale)), levels)) << (8 * j);
                }
            }
        }
        store_group_bytes<kBits>(out, g * kBits, gather_fields(w, kBits), nbytes, vec_out);
    }
}

template <typename R>
void l1_means_pack_with(R in, bool vec_in, int64_t n, const int64_t* offsets, const float* means, int64_t nseg,
                        int levels, float clip, int bits, uint8_t* out, int64_t nbytes, cudaStream_t stream)
{
    const unsigned grid = blocks_for((nbytes + bits - 1) / bits, kBlock);
    const bool vec_out = aligned(out, 8);
    switch (bits) {
        case 2:
            l1_means_pack_kernel<2><<<grid, kBlock, 0, stream>>>(in, n, offsets, means, nseg, levels, clip, out,
                                                                  nbytes, vec_in, vec_out);
            break;
        case 4:
            l1_means_pack_kernel<4><<<grid, kBlock, 0, stream>>>(in, n, offsets, means, nseg, levels, clip, out,
                                                                  nbytes, vec_in, vec_out);
            break;
        default:
            l1_means_pack_kernel<8><<<grid, kBlock, 0, stream>>>(in, n, offsets, means, nseg, levels, clip, out,
                                                                  nbytes, vec_in, vec_out);
            break;
    }
}

// ---------------------------------------------------------------- option clip's sketch, one launch
//
// The order is the CPU's (ds_lioncub/step/clipping.py, ../cpu/lioncub_packing.cpp): each bin adds its elements'
// signed fp32 values in fp64 one after another, in element order, the pieces in the order given, continuing from
// out; a second row of bins adds their squares the same way, and out[K] adds their pairwise fold. Each bin's sum is
// a chain of dependent additions, so the parallelism is across bins, and the reads are spread over a block's warps:
//
// - a piece of n elements from bin c spans rows 0 .. ceil((c + n) / K) - 1 of K bins (element j of the piece is in
//   row (c + j) / K, bin (c + j) % K); the rows of all pieces, one after another, are the kernel's rows;
// - block b owns the 32 bins 32b .. 32b + 31. Its warp 0 adds, one lane per bin; its other 15 warps load the next
//   tile of 120 rows (8 rows each: 32 coalesced elements and their sign bits per row) into shared memory, signed,
//   while warp 0 adds the current one (double-buffered, one __syncthreads per tile);
// - a position without an element (outside its piece, or a bin >= K) holds -0.0f, which leaves every fp64 sum as
//   it is (x + -0.0 == x for every x, -0.0 included), and whose square +0 leaves the squares' sums (never -0.0) as
//   they are: warp 0 adds every row with no branch;
// - the last block to finish (a counter in the pieces' descriptor, zero at launch) folds the K squares' sums
//   pairwise, zeros up to fold_size, and adds the fold to out[K].

constexpr int kSketchStrip = 32;                                    // bins per block: warp 0's lanes
constexpr int kSketchLoaders = 15;                                  // warps that load
constexpr int kSketchRowsPerLoader = 8;                             // rows a loader reads per tile
constexpr int kSketchTile = kSketchLoaders * kSketchRowsPerLoader;  // rows per tile
constexpr int kSketchThreads = 32 * (kSketchLoaders + 1);
constexpr int64_t kSketchJump = kSketchTile - kSketchRowsPerLoader + 1;  // a loader's last row to its next tile's first

struct SketchLayout {
    const int64_t* row_start;  // npieces + 1
    const int64_t* address;
    const int64_t* numel;
    const int64_t* column;
    const int64_t* start;
    const int64_t* kind;
    int64_t npieces;
    int64_t total_rows;
    int64_t bins;
    int64_t period;
    uint32_t step_mod;  // (1 * bins) % period: the table position's advance from one row of a piece to the next
    uint32_t jump_mod;  // (kSketchJump * bins) % period
};

// A loader warp's current row (warp-uniform): its piece and the table position of its element in bin b0 (the
// block's first bin, maybe outside the piece: positions are (start + j) mod period for any j).
struct SketchCursor {
    int64_t piece = -1, row = 0, end_row = 0, first_row = 0, numel = 0, column = 0;
    const char* address = nullptr;
    int kind = 0;
    uint32_t position = 0;
};

__device__ __forceinline__ void sketch_seek(const SketchLayout& L, SketchCursor& cur, int64_t row, int64_t b0)
{
    if (cur.piece >= 0 && row < cur.end_row) {  // the same piece, a known step further
        const int64_t delta = row - cur.row;
        const uint32_t add = delta == 1 ? L.step_mod
                                        : (delta == kSketchJump ? L.jump_mod
                                                                : static_cast<uint32_t>(((delta % L.period) *
                                                                                         int64_t(L.step_mod)) %
                                                                                        L.period));
        uint32_t position = cur.position + add;
        if (position >= L.period) position -= static_cast<uint32_t>(L.period);
        cur.position = position;
        cur.row = row;
        return;
    }
    // row_start[lo] <= row < row_start[hi]: at the end piece lo holds the row (and is not empty)
    int64_t lo = cur.piece < 0 ? 0 : cur.piece, hi = L.npieces;
    if (__ldg(L.row_start + lo + 1) > row) {
        hi = lo + 1;
    }
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (__ldg(L.row_start + mid) <= row) lo = mid;
        else hi = mid;
    }
    cur.piece = lo;
    cur.first_row = __ldg(L.row_start + lo);
    cur.end_row = __ldg(L.row_start + lo + 1);
    cur.address = reinterpret_cast<const char*>(__ldg(L.address + lo));
    cur.numel = __ldg(L.numel + lo);
    cur.column = __ldg(L.column + lo);
    cur.kind = static_cast<int>(__ldg(L.kind + lo));
    const int64_t x = __ldg(L.start + lo) + (row - cur.first_row) * L.bins + b0 - cur.column;
    cur.position = static_cast<uint32_t>(((x % L.period) + L.period) % L.period);
    cur.row = row;
}

__device__ __forceinline__ float sketch_widen(uint32_t raw, int kind)
{
    if (kind == static_cast<int>(InputKind::kF32)) return __uint_as_float(raw);
    if (kind == static_cast<int>(InputKind::kBF16)) return __uint_as_float(raw << 16);
    return __half2float(__ushort_as_half(static_cast<unsigned short>(raw)));
}

__global__ void __launch_bounds__(kSketchThreads)
    sketch_kernel(SketchLayout L, const uint8_t* signs, double* out, double* scratch, int64_t fold_size,
                  unsigned int* counter)
{
    __shared__ float values[2][kSketchTile][kSketchStrip];
    __shared__ bool last_block;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t b0 = int64_t(blockIdx.x) * kSketchStrip;
    const int64_t bin = b0 + lane;
    const int64_t tiles = (L.total_rows + kSketchTile - 1) / kSketchTile;
    const uint32_t period = static_cast<uint32_t>(L.period);
    SketchCursor cur;

    // A loader's 8 rows of tile t into buffer `buf`: addresses and table positions first, then every load, then
    // the signed values (or -0.0f) into shared memory.
    auto load_tile = [&](int64_t t, int buf) {
        const int row0 = (warp - 1) * kSketchRowsPerLoader;
        const char* at[kSketchRowsPerLoader];
        uint32_t position[kSketchRowsPerLoader];
        int kind[kSketchRowsPerLoader];
        bool present[kSketchRowsPerLoader];
#pragma unroll
        for (int i = 0; i < kSketchRowsPerLoader; ++i) {
            const int64_t row = t * kSketchTile + row0 + i;
            present[i] = false;
            at[i] = nullptr;
            position[i] = 0;
            kind[i] = 0;
            if (row < L.total_rows) {  // warp-uniform
                sketch_seek(L, cur, row, b0);
                const int64_t j = (row - cur.first_row) * L.bins + bin - cur.column;
                present[i] = bin < L.bins && j >= 0 && j < cur.numel;
                kind[i] = cur.kind;
                const int64_t size = cur.kind == static_cast<int>(InputKind::kF32) ? 4 : 2;
                at[i] = cur.address + (present[i] ? j : 0) * size;
                uint32_t p = cur.position + static_cast<uint32_t>(lane);
                if (p >= period) p = period >= 32 ? p - period : p % period;
                position[i] = p;
            }
        }
        uint32_t raw[kSketchRowsPerLoader], sign_byte[kSketchRowsPerLoader];
#pragma unroll
        for (int i = 0; i < kSketchRowsPerLoader; ++i) {
            raw[i] = 0;
            sign_byte[i] = 0;
            if (present[i]) {
                raw[i] = kind[i] == static_cast<int>(InputKind::kF32)
                             ? __ldg(reinterpret_cast<const unsigned int*>(at[i]))
                             : static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(at[i])));
                sign_byte[i] = __ldg(signs + (position[i] >> 3));
            }
        }
#pragma unroll
        for (int i = 0; i < kSketchRowsPerLoader; ++i) {
            const float v = sketch_widen(raw[i], kind[i]);
            const bool plus = (sign_byte[i] >> (position[i] & 7u)) & 1u;
            values[buf][row0 + i][lane] = present[i] ? (plus ? v : -v) : -0.0f;
        }
    };

    double sum = 0.0, square = 0.0;
    if (warp == 0 && bin < L.bins) sum = out[bin];
    if (warp > 0 && tiles > 0) load_tile(0, 0);
    __syncthreads();
    for (int64_t t = 0; t < tiles; ++t) {
        const int buf = static_cast<int>(t & 1);
        if (warp == 0) {
#pragma unroll 8
            for (int r = 0; r < kSketchTile; ++r) {
                const double d = static_cast<double>(values[buf][r][lane]);
                sum = __dadd_rn(sum, d);
                square = __fma_rn(d, d, square);  // d * d is exact: the fma rounds as the add alone
            }
        } else if (t + 1 < tiles) {
            load_tile(t + 1, buf ^ 1);
        }
        __syncthreads();
    }
    if (warp == 0 && bin < L.bins) {
        out[bin] = sum;
        scratch[bin] = square;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_block = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    // The pairwise fold (torch_impl.fold_pairwise): v[i] += v[i + h] for h = fold_size / 2 .. 1, zeros past bins.
    for (int64_t h = fold_size / 2; h >= 1; h /= 2) {
        for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
            const double a = __ldcg(scratch + i);
            const double b = i + h < L.bins ? __ldcg(scratch + i + h) : 0.0;
            scratch[i] = __dadd_rn(a, b);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[L.bins] = __dadd_rn(out[L.bins], __ldcg(scratch));
}

}  // namespace

// ================================================================ launchers

void launch_pack_signs_v2(InputKind kind, const void* x, int64_t n, bool zip, int bits, uint8_t* out, int64_t nbytes,
                          cudaStream_t stream)
{
    if (nbytes == 0) return;
    switch (kind) {
        case InputKind::kF32:
            pack_signs_v2_with(SignF32{static_cast<const float*>(x)}, n, zip, bits, out, nbytes, stream);
            break;
        case InputKind::kBF16:
            pack_signs_v2_with(SignBF16{static_cast<const uint16_t*>(x)}, n, zip, bits, out, nbytes, stream);
            break;
        case InputKind::kF16:
            pack_signs_v2_with(SignF16{static_cast<const uint16_t*>(x)}, n, zip, bits, out, nbytes, stream);
            break;
        default: pack_signs_v2_with(SignU8{static_cast<const uint8_t*>(x)}, n, zip, bits, out, nbytes, stream); break;
    }
}

void launch_unpack_signs_v2(const uint8_t* packed, int64_t sign_bytes, int64_t n, int elem_bytes, uint32_t plus,
                            uint32_t minus, void* out, cudaStream_t stream)
{
    if (n == 0) return;
    const unsigned grid = blocks_for((n + kChunk - 1) / kChunk * 32, kBlock);
    const bool words = aligned(packed, 4), vec = aligned(out, 16);
    if (elem_bytes == 4) {
        unpack_signs_v2_kernel<uint32_t><<<grid, kBlock, 0, stream>>>(packed, sign_bytes, n, plus, minus,
                                                                        static_cast<uint32_t*>(out), words, vec);
    } else {
        unpack_signs_v2_kernel<uint16_t><<<grid, kBlock, 0, stream>>>(
            packed, sign_bytes, n, static_cast<uint16_t>(plus), static_cast<uint16_t>(minus),
            static_cast<uint16_t*>(out), words, vec);
    }
}

void launch_vote_v2(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, int64_t threshold, uint8_t* out,
                    int64_t out_bytes, cudaStream_t stream)
{
    if (out_bytes == 0) return;
    if (threshold > p) {  // no count reaches it: every bit is 0
        zero_bytes_kernel<<<blocks_for(out_bytes, kBlock), kBlock, 0, stream>>>(out, out_bytes);
        return;
    }
    const uint32_t t = threshold < 0 ? 0u : static_cast<uint32_t>(threshold);
    const int planes = count_planes(p);  // counts up to p fit this many bits
    if (planes <= 2) vote_v2_planes<2>(rows, p, stride, numel, t, out, out_bytes, stream);
    else if (planes <= 4) vote_v2_planes<4>(rows, p, stride, numel, t, out, out_bytes, stream);
    else if (planes <= 8) vote_v2_planes<8>(rows, p, stride, numel, t, out, out_bytes, stream);
    else vote_v2_planes<16>(rows, p, stride, numel, t, out, out_bytes, stream);
}

void launch_vote_field_sums(const uint8_t* rows, int64_t p, int64_t stride, int bits, int64_t numel,
                            int64_t threshold, uint8_t* out, int64_t out_bytes, cudaStream_t stream)
{
    if (bits == 1) {
        launch_vote_v2(rows, p, stride, numel, threshold, out, out_bytes, stream);
        return;
    }
    if (out_bytes == 0) return;
    const int64_t top = p * ((int64_t(1) << bits) - 1);  // the largest sum
    if (threshold > top) {
        zero_bytes_kernel<<<blocks_for(out_bytes, kBlock), kBlock, 0, stream>>>(out, out_bytes);
        return;
    }
    const int32_t t = threshold < 0 ? 0 : static_cast<int32_t>(threshold);
    switch (bits) {
        case 2: field_vote_with<2>(rows, p, stride, numel, t, out, out_bytes, stream); break;
        case 4: field_vote_with<4>(rows, p, stride, numel, t, out, out_bytes, stream); break;
        default: field_vote_with<8>(rows, p, stride, numel, t, out, out_bytes, stream); break;
    }
}

void launch_quantize_l1_means_pack(InputKind kind, const void* c, int64_t n, const int64_t* offsets,
                                   const float* means, int64_t nseg, int levels, float clip, int bits, uint8_t* out,
                                   int64_t nbytes, cudaStream_t stream)
{
    if (nbytes == 0) return;
    const bool vec_in = aligned(c, 16);
    switch (kind) {
        case InputKind::kF32:
            l1_means_pack_with(ValueF32{static_cast<const float*>(c)}, vec_in, n, offsets, means, nseg, levels, clip,
                               bits, out, nbytes, stream);
            break;
        case InputKind::kBF16:
            l1_means_pack_with(ValueHalf<true>{static_cast<const uint16_t*>(c)}, vec_in, n, offsets, means, nseg,
                               levels, clip, bits, out, nbytes, stream);
            break;
        default:
            l1_means_pack_with(ValueHalf<false>{static_cast<const uint16_t*>(c)}, vec_in, n, offsets, means, nseg,
                               levels, clip, bits, out, nbytes, stream);
            break;
    }
}

int64_t sketch_descriptor_length(int64_t npieces) { return 2 + npieces * (1 + kSketchPieceFields); }

int64_t sketch_rows_of(int64_t numel, int64_t column, int64_t bins)
{
    return numel == 0 ? 0 : (column + numel + bins - 1) / bins;
}

void launch_sketch_and_squares(int64_t* pieces, int64_t npieces, int64_t total_rows, int64_t bins,
                               const uint8_t* signs, int64_t period, double* out, double* scratch, int64_t fold_size,
                               cudaStream_t stream)
{
    SketchLayout layout;
    layout.row_start = pieces + 1;
    layout.address = layout.row_start + npieces + 1;
    layout.numel = layout.address + npieces;
    layout.column = layout.numel + npieces;
    layout.start = layout.column + npieces;
    layout.kind = layout.start + npieces;
    layout.npieces = npieces;
    layout.total_rows = total_rows;
    layout.bins = bins;
    layout.period = period;
    layout.step_mod = static_cast<uint32_t>(bins % period);
    layout.jump_mod = static_cast<uint32_t>(((kSketchJump % period) * (bins % period)) % period);
    const unsigned grid = static_cast<unsigned>((bins + kSketchStrip - 1) / kSketchStrip);
    sketch_kernel<<<grid, kSketchThreads, 0, stream>>>(layout, signs, out, scratch, fold_size,
                                                       reinterpret_cast<unsigned int*>(pieces));
}

}  // namespace cuda
}  // namespace lioncub
