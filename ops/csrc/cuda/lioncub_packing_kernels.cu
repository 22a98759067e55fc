// ds_lioncub packing kernels for CUDA. Same layout, tie rule and results as the CPU kernels and the
// pure torch path (../includes/lioncub_packing.h). Built without --use_fast_math: the L1 quantizer
// multiplies and rounds exactly as torch does (__fmul_rn, rintf = round half to even).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lioncub_packing.h"
#include "lioncub_packing_cuda.h"

namespace lioncub {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPlanes = 16;  // p < 65536 voters

inline unsigned grid_for(int64_t items)
{
    const int64_t blocks = (items + kThreads - 1) / kThreads;
    return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > (int64_t(1) << 20) ? (int64_t(1) << 20) : blocks));
}

__device__ __forceinline__ int64_t thread_index() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t thread_stride() { return int64_t(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------- element readers

struct F32 {
    const float* p;
    __device__ __forceinline__ bool positive(int64_t i, bool zip) const { return float_positive(p[i], zip); }
    __device__ __forceinline__ float value(int64_t i) const { return p[i]; }
};
struct BF16 {
    const uint16_t* p;
    __device__ __forceinline__ bool positive(int64_t i, bool zip) const { return half_bits_positive(p[i], 0x7F80, zip); }
    __device__ __forceinline__ float value(int64_t i) const { return __uint_as_float(uint32_t(p[i]) << 16); }
};
struct F16 {
    const uint16_t* p;
    __device__ __forceinline__ bool positive(int64_t i, bool zip) const { return half_bits_positive(p[i], 0x7C00, zip); }
    __device__ __forceinline__ float value(int64_t i) const { return __half2float(__ushort_as_half(p[i])); }
};
struct U8 {  // bool, or uint8 0/1: bit 0 is the sign bit
    const uint8_t* p;
    __device__ __forceinline__ bool positive(int64_t i, bool) const { return p[i] & 1u; }
};

__device__ __forceinline__ void store_group(uint8_t* out, int64_t first, uint64_t w, int bits, int64_t nbytes)
{
    for (int k = 0; k < bits; ++k)
        if (first + k < nbytes) out[first + k] = static_cast<uint8_t>(w >> (8 * k));
}

// ---------------------------------------------------------------- pack signs

// One lane per element: a warp ballot is 32 sign bits in element order, i.e. 4 packed bytes.
template <typename R>
__global__ void pack_signs_ballot(R in, int64_t n, bool zip, uint8_t* out, int64_t nbytes)
{
    const int64_t total = (nbytes * 8 + 31) / 32 * 32;  // a multiple of 32: whole warps take part
    const int lane = threadIdx.x & 31;
    for (int64_t i = thread_index(); i < total; i += thread_stride()) {
        const bool bit = i < n && in.positive(i, zip);
        const uint32_t word = __ballot_sync(0xFFFFFFFFu, bit);
        if (lane == 0) {
            const int64_t byte = i / 8;
            if (byte + 4 <= nbytes) {
                *reinterpret_cast<uint32_t*>(out + byte) = word;  // byte % 4 == 0: aligned
            } else {
                for (int k = 0; k < 4 && byte + k < nbytes; ++k) out[byte + k] = static_cast<uint8_t>(word >> (8 * k));
            }
        }
    }
}

// One thread per group of 8 elements (`bits` bytes of b-bit sign fields).
template <typename R>
__global__ void pack_sign_fields(R in, int64_t n, bool zip, int bits, uint8_t* out, int64_t nbytes)
{
    const int64_t groups = (nbytes + bits - 1) / bits;
    for (int64_t g = thread_index(); g < groups; g += thread_stride()) {
        uint32_t mask = 0;
        for (int j = 0; j < 8; ++j) {
            const int64_t i = 8 * g + j;
            if (i < n && in.positive(i, zip)) mask |= 1u << j;
        }
        store_group(out, g * bits, mask_to_fields(mask, bits), bits, nbytes);
    }
}

template <typename R>
void pack_signs_with(R in, int64_t n, bool zip, int bits, uint8_t* out, int64_t nbytes, cudaStream_t stream)
{
    if (nbytes == 0) return;
    if (bits == 1) {
        pack_signs_ballot<<<grid_for(nbytes * 8), kThreads, 0, stream>>>(in, n, zip, out, nbytes);
    } else {
        pack_sign_fields<<<grid_for((nbytes + bits - 1) / bits), kThreads, 0, stream>>>(in, n, zip, bits, out, nbytes);
    }
}

// ---------------------------------------------------------------- unpack signs

// One thread per packed byte: 8 values, written with one or two 16-byte stores.
template <typename Word>
__global__ void unpack_signs_kernel(const uint8_t* packed, int64_t n, Word plus, Word minus, Word* out)
{
    const int64_t bytes = (n + 7) / 8;
    for (int64_t b = thread_index(); b < bytes; b += thread_stride()) {
        const uint32_t byte = packed[b];
        alignas(16) Word v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = ((byte >> j) & 1u) ? plus : minus;
        if (8 * b + 8 <= n) {
            uint4* dst = reinterpret_cast<uint4*>(out + 8 * b);  // 8 * sizeof(Word) bytes, 16-byte aligned
            const uint4* src = reinterpret_cast<const uint4*>(v);
#pragma unroll
            for (int k = 0; k < int(sizeof(v) / sizeof(uint4)); ++k) dst[k] = src[k];
        } else {
            for (int j = 0; 8 * b + j < n; ++j) out[8 * b + j] = v[j];
        }
    }
}

// ---------------------------------------------------------------- fused vote

// One thread per output byte: bit-sliced counters over the p rows (plane k = bit k of the 8
// counts), then count >= threshold, packed. No unpacked bit is ever stored.
__global__ void vote_kernel(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, int planes,
                            uint32_t threshold, uint8_t* out, int64_t out_bytes)
{
    const int64_t nbytes = (numel + 7) / 8;
    for (int64_t i = thread_index(); i < out_bytes; i += thread_stride()) {
        if (i >= nbytes) {
            out[i] = 0;
            continue;
        }
        uint32_t P[kMaxPlanes];
#pragma unroll
        for (int k = 0; k < kMaxPlanes; ++k) P[k] = 0;
        for (int64_t r = 0; r < p; ++r) {
            uint32_t x = rows[r * stride + i];
#pragma unroll
            for (int k = 0; k < kMaxPlanes; ++k) {
                if (k < planes) {
                    const uint32_t carry = P[k] & x;
                    P[k] ^= x;
                    x = carry;
                }
            }
        }
        uint32_t gt = 0, eq = 0xFFu;
#pragma unroll
        for (int k = kMaxPlanes - 1; k >= 0; --k) {
            if (k < planes) {
                if ((threshold >> k) & 1u) {
                    eq &= P[k];
                } else {
                    gt |= eq & P[k];
                    eq &= ~P[k];
                }
            }
        }
        uint32_t v = (gt | eq) & 0xFFu;
        if (i == nbytes - 1 && (numel & 7)) v &= (1u << (numel & 7)) - 1;
        out[i] = static_cast<uint8_t>(v);
    }
}

// ---------------------------------------------------------------- per-position field sums

__global__ void sum_fields_kernel(const uint8_t* rows, int64_t p, int64_t stride, int bits, int64_t numel,
                                  int32_t* out)
{
    const int per_byte = 8 / bits;
    const uint32_t mask = (1u << bits) - 1;
    for (int64_t e = thread_index(); e < numel; e += thread_stride()) {
        const int64_t byte = e / per_byte;
        const int shift = int(e % per_byte) * bits;
        int32_t sum = 0;
        for (int64_t r = 0; r < p; ++r) sum += (rows[r * stride + byte] >> shift) & mask;
        out[e] = sum;
    }
}

// ---------------------------------------------------------------- b-bit fields

template <typename T>
__global__ void pack_fields_kernel(const T* v, int64_t n, int bits, uint8_t* out, int64_t nbytes)
{
    const uint64_t field_mask = (1u << bits) - 1;
    const int64_t groups = (nbytes + bits - 1) / bits;
    for (int64_t g = thread_index(); g < groups; g += thread_stride()) {
        uint64_t w = 0;
        for (int j = 0; j < 8; ++j) {
            const int64_t i = 8 * g + j;
            if (i < n) w |= (uint64_t(static_cast<uint8_t>(v[i])) & field_mask) << (8 * j);
        }
        store_group(out, g * bits, gather_fields(w, bits), bits, nbytes);
    }
}

__global__ void unpack_fields_kernel(const uint8_t* packed, int bits, int64_t n, uint8_t* out)
{
    const int64_t groups = (n + 7) / 8;
    for (int64_t g = thread_index(); g < groups; g += thread_stride()) {
        uint64_t w = 0;
        for (int k = 0; k < bits; ++k) {
            // the last group may need fewer than `bits` bytes: never read past ceil(n * bits / 8)
            if (g * bits + k < (n * bits + 7) / 8) w |= uint64_t(packed[g * bits + k]) << (8 * k);
        }
        const uint64_t v = spread_fields(w, bits);
        if (8 * g + 8 <= n) {
            *reinterpret_cast<uint2*>(out + 8 * g) = make_uint2(uint32_t(v), uint32_t(v >> 32));
        } else {
            for (int j = 0; 8 * g + j < n; ++j) out[8 * g + j] = static_cast<uint8_t>(v >> (8 * j));
        }
    }
}

// ---------------------------------------------------------------- L1 quantize + pack

template <typename R>
__global__ void quantize_l1_pack_kernel(R in, int64_t n, const int64_t* offsets, const float* scales, int64_t nseg,
                                        int32_t levels, int bits, uint8_t* out, int64_t nbytes)
{
    const int64_t groups = (nbytes + bits - 1) / bits;
    for (int64_t g = thread_index(); g < groups; g += thread_stride()) {
        const int64_t first = 8 * g;
        uint64_t w = 0;
        if (first < n) {
            // segment holding `first`: the last s with offsets[s] <= first
            int64_t lo = 0, hi = nseg;  // invariant: offsets[lo] <= first < offsets[hi]
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (offsets[mid] <= first) lo = mid; else hi = mid;
            }
            int64_t s = lo;
            for (int j = 0; j < 8; ++j) {
                const int64_t i = first + j;
                if (i >= n) break;
                while (offsets[s + 1] <= i) ++s;
                const float v = __fmul_rn(in.value(i), scales[s]);
                w |= uint64_t(l1_field_from_rounded(rintf(v), levels)) << (8 * j);
            }
        }
        store_group(out, g * bits, gather_fields(w, bits), bits, nbytes);
    }
}

// ---------------------------------------------------------------- fused Lion step (mirrors ../cpu/lioncub_packing.cpp)

// c = fma(g, 1 - beta1, fl(m * beta1)) as torch's mul_ then add_(alpha) compute it, and for fp32
// momentum m' = fma(g, 1 - beta2, fl(m * beta2)); the _rn intrinsics keep nvcc from fusing or
// reassociating anything else. 16-bit momentum is updated by the caller with torch's own ops.
// One thread per output group (8 elements, `bits` bytes) that the piece [offset, offset + n) of the
// bucket touches: a group shared with a neighbouring piece is OR-ed in, which is safe because the
// bucket's message was zeroed first and the pieces' launches run one after another on one stream.
template <typename R>
__global__ void lion_direction_pack_kernel(R m, R g, float* m_out, int64_t n, int64_t offset, float b1, float a1,
                                           float b2, float a2, bool zip, int bits, uint8_t* out, int64_t nbytes)
{
    const int64_t first = offset / 8, last = (offset + n - 1) / 8;
    for (int64_t q = first + thread_index(); q <= last; q += thread_stride()) {
        uint32_t mask = 0;
        for (int j = 0; j < 8; ++j) {
            const int64_t e = 8 * q + j - offset;
            if (e < 0 || e >= n) continue;
            const float mf = m.value(e), gf = g.value(e);
            const float c = __fmaf_rn(gf, a1, __fmul_rn(mf, b1));
            if (m_out != nullptr) m_out[e] = __fmaf_rn(gf, a2, __fmul_rn(mf, b2));
            mask |= static_cast<uint32_t>(float_positive(c, zip)) << j;
        }
        const uint64_t w = mask_to_fields(mask, bits);
        // The last group's fields may end inside a byte: a message sized to ceil(n * bits / 8) has no
        // room for the group's remaining (zero) bytes, so they are not touched.
        for (int k = 0; k < bits && q * bits + k < nbytes; ++k) out[q * bits + k] |= static_cast<uint8_t>(w >> (8 * k));
    }
}

// p = p * decay - lr * s: the decay product rounded (to p's dtype) before the add, as torch's mul_
// then add_(delta, alpha=-lr); -lr * s is exact.
struct F32Param {
    float* p;
    __device__ __forceinline__ float load(int64_t i) const { return p[i]; }
    __device__ __forceinline__ float round(float v) const { return v; }
    __device__ __forceinline__ void store(int64_t i, float v) const { p[i] = v; }
};
struct BF16Param {
    uint16_t* p;
    __device__ __forceinline__ float load(int64_t i) const { return __uint_as_float(uint32_t(p[i]) << 16); }
    __device__ __forceinline__ float round(float v) const { return __bfloat162float(__float2bfloat16_rn(v)); }
    __device__ __forceinline__ void store(int64_t i, float v) const { p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
struct F16Param {
    uint16_t* p;
    __device__ __forceinline__ float load(int64_t i) const { return __half2float(__ushort_as_half(p[i])); }
    __device__ __forceinline__ float round(float v) const { return __half2float(__float2half_rn(v)); }
    __device__ __forceinline__ void store(int64_t i, float v) const { p[i] = __half_as_ushort(__float2half_rn(v)); }
};

template <typename P>
__global__ void apply_packed_signs_kernel(P param, int64_t n, const uint8_t* packed, int64_t offset, bool has_decay,
                                          float decay, float neg_lr)
{
    for (int64_t e = thread_index(); e < n; e += thread_stride()) {
        const int64_t b = offset + e;
        const bool plus = (packed[b >> 3] >> (b & 7)) & 1u;
        float v = param.load(e);
        if (has_decay) v = param.round(__fmul_rn(v, decay));
        param.store(e, __fadd_rn(v, plus ? neg_lr : -neg_lr));
    }
}

}  // namespace

// ================================================================ launchers

void launch_pack_signs(InputKind kind, const void* x, int64_t n, bool zip, int bits, uint8_t* out, int64_t nbytes,
                       cudaStream_t stream)
{
    switch (kind) {
        case InputKind::kF32: pack_signs_with(F32{static_cast<const float*>(x)}, n, zip, bits, out, nbytes, stream); break;
        case InputKind::kBF16: pack_signs_with(BF16{static_cast<const uint16_t*>(x)}, n, zip, bits, out, nbytes, stream); break;
        case InputKind::kF16: pack_signs_with(F16{static_cast<const uint16_t*>(x)}, n, zip, bits, out, nbytes, stream); break;
        default: pack_signs_with(U8{static_cast<const uint8_t*>(x)}, n, zip, bits, out, nbytes, stream); break;
    }
}

void launch_unpack_signs(const uint8_t* packed, int64_t n, int elem_bytes, uint32_t plus, uint32_t minus, void* out,
                         cudaStream_t stream)
{
    if (n == 0) return;
    const unsigned grid = grid_for((n + 7) / 8);
    if (elem_bytes == 4) {
        unpack_signs_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(packed, n, plus, minus, static_cast<uint32_t*>(out));
    } else {
        unpack_signs_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(packed, n, uint16_t(plus), uint16_t(minus),
                                                                     static_cast<uint16_t*>(out));
    }
}

void launch_vote(const uint8_t* rows, int64_t p, int64_t stride, int64_t numel, bool zip, uint8_t* out,
                 int64_t out_bytes, cudaStream_t stream)
{
    if (out_bytes == 0) return;
    vote_kernel<<<grid_for(out_bytes), kThreads, 0, stream>>>(rows, p, stride, numel, count_planes(p),
                                                               vote_threshold(p, zip), out, out_bytes);
}

int max_voters() { return (1 << kMaxPlanes) - 1; }

void launch_sum_fields(const uint8_t* rows, int64_t p, int64_t stride, int bits, int64_t numel, int32_t* out,
                       cudaStream_t stream)
{
    if (numel == 0) return;
    sum_fields_kernel<<<grid_for(numel), kThreads, 0, stream>>>(rows, p, stride, bits, numel, out);
}

void launch_pack_fields(InputKind kind, const void* v, int64_t n, int bits, uint8_t* out, int64_t nbytes,
                        cudaStream_t stream)
{
    if (nbytes == 0) return;
    const unsigned grid = grid_for((nbytes + bits - 1) / bits);
    if (kind == InputKind::kI32) {
        pack_fields_kernel<int32_t><<<grid, kThreads, 0, stream>>>(static_cast<const int32_t*>(v), n, bits, out, nbytes);
    } else {
        pack_fields_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(v), n, bits, out, nbytes);
    }
}

void launch_unpack_fields(const uint8_t* packed, int bits, int64_t n, uint8_t* out, cudaStream_t stream)
{
    if (n == 0) return;
    unpack_fields_kernel<<<grid_for((n + 7) / 8), kThreads, 0, stream>>>(packed, bits, n, out);
}

void launch_quantize_l1_pack(InputKind kind, const void* c, int64_t n, const int64_t* offsets, const float* scales,
                             int64_t nseg, int levels, int bits, uint8_t* out, int64_t nbytes, cudaStream_t stream)
{
    if (nbytes == 0) return;
    const unsigned grid = grid_for((nbytes + bits - 1) / bits);
    switch (kind) {
        case InputKind::kF32:
            quantize_l1_pack_kernel<<<grid, kThreads, 0, stream>>>(F32{static_cast<const float*>(c)}, n, offsets, scales,
                                                                   nseg, levels, bits, out, nbytes);
            break;
        case InputKind::kBF16:
            quantize_l1_pack_kernel<<<grid, kThreads, 0, stream>>>(BF16{static_cast<const uint16_t*>(c)}, n, offsets,
                                                                   scales, nseg, levels, bits, out, nbytes);
            break;
        default:
            quantize_l1_pack_kernel<<<grid, kThreads, 0, stream>>>(F16{static_cast<const uint16_t*>(c)}, n, offsets,
                                                                   scales, nseg, levels, bits, out, nbytes);
            break;
    }
}

void launch_lion_direction_pack(InputKind kind, void* m, const void* g, int64_t n, int64_t offset, float b1, float a1,
                                float b2, float a2, bool zip, int bits, uint8_t* out, int64_t nbytes,
                                cudaStream_t stream)
{
    if (n == 0) return;
    const unsigned grid = grid_for((offset + n - 1) / 8 - offset / 8 + 1);
    switch (kind) {
        case InputKind::kF32:
            lion_direction_pack_kernel<<<grid, kThreads, 0, stream>>>(
                F32{static_cast<const float*>(m)}, F32{static_cast<const float*>(g)}, static_cast<float*>(m), n, offset,
                b1, a1, b2, a2, zip, bits, out, nbytes);
            break;
        case InputKind::kBF16:
            lion_direction_pack_kernel<<<grid, kThreads, 0, stream>>>(
                BF16{static_cast<const uint16_t*>(m)}, BF16{static_cast<const uint16_t*>(g)}, nullptr, n, offset, b1, a1,
                b2, a2, zip, bits, out, nbytes);
            break;
        default:
            lion_direction_pack_kernel<<<grid, kThreads, 0, stream>>>(
                F16{static_cast<const uint16_t*>(m)}, F16{static_cast<const uint16_t*>(g)}, nullptr, n, offset, b1, a1,
                b2, a2, zip, bits, out, nbytes);
            break;
    }
}

void launch_apply_packed_signs(InputKind kind, void* p, int64_t n, const uint8_t* packed, int64_t offset,
                               bool has_decay, float decay, float neg_lr, cudaStream_t stream)
{
    if (n == 0) return;
    const unsigned grid = grid_for(n);
    switch (kind) {
        case InputKind::kF32:
            apply_packed_signs_kernel<<<grid, kThreads, 0, stream>>>(F32Param{static_cast<float*>(p)}, n, packed, offset,
                                                                     has_decay, decay, neg_lr);
            break;
        case InputKind::kBF16:
            apply_packed_signs_kernel<<<grid, kThreads, 0, stream>>>(BF16Param{static_cast<uint16_t*>(p)}, n, packed,
                                                                     offset, has_decay, decay, neg_lr);
            break;
        default:
            apply_packed_signs_kernel<<<grid, kThreads, 0, stream>>>(F16Param{static_cast<uint16_t*>(p)}, n, packed,
                                                                     offset, has_decay, decay, neg_lr);
            break;
    }
}

}  // namespace cuda
}  // namespace lioncub
