// Data movement: pack params into a padded flat buffer, unpack them, copy, zero-fill, cast.
#include "common.cuh"

namespace fsdp {

// Chunks (16-byte vectors) in flight per thread when a block moves a pack tile.
constexpr int kTileUnroll = 4;

// One param of a pack table, in elements; the layout of the host's `PackEntry`.
struct PackEntry {
  uint64_t ptr;
  uint64_t offset;
  uint64_t numel;
  uint64_t padded;
};

// Pack and unpack split the flat buffer into tiles of this many 16-byte vectors, one block per
// tile at a time: a large param is shared by many blocks, a tile may hold many small params, and
// the work per block stays even whatever the sizes.
constexpr uint64_t kTileVectors = 2 * kBlock * kTileUnroll;

// The last entry that starts at or before flat element `at` (entries sorted by offset), else 0;
// searched from entry `from`, which starts at or before `at` (or is 0). A block's tiles go up the
// flat buffer, so the last entry of its previous tile is such a start, and most often the answer:
// then one probe finds it, rather than a probe per halving of the table, each waiting on the last.
__device__ __forceinline__ uint64_t find_entry(const PackEntry* table, uint64_t count,
                                               uint64_t from, uint64_t at) {
  uint64_t lo = from;
  uint64_t hi = count;
  if (lo + 1 < hi && table[lo + 1].offset > at) return lo;
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (table[mid].offset <= at) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Moves every entry's part of flat elements [0, extent) between the params and the flat buffer,
// block by block over tiles; when packing, also zero-fills each entry's padding.
template <class Bits, bool kPack>
__device__ __forceinline__ void pack_tiles(const PackEntry* table, uint64_t count, Bits* flat,
                                           uint64_t extent) {
  constexpr uint64_t kTile = kTileVectors * kPerVector<Bits>;
  // The last entry of the block's previous tile.
  uint64_t last = 0;
  for (uint64_t lo = static_cast<uint64_t>(blockIdx.x) * kTile; lo < extent;
       lo += static_cast<uint64_t>(gridDim.x) * kTile) {
    const uint64_t hi = lo + kTile < extent ? lo + kTile : extent;
    for (uint64_t e = find_entry(table, count, last, lo); e < count; ++e) {
      const PackEntry entry = table[e];
      if (entry.offset >= hi) break;
      last = e;
      Bits* param = reinterpret_cast<Bits*>(entry.ptr);
      const uint64_t data_end = entry.offset + entry.numel;
      const uint64_t from = entry.offset > lo ? entry.offset : lo;
      const uint64_t to = data_end < hi ? data_end : hi;
      if (from < to) {
        Bits* in_flat = flat + from;
        Bits* in_param = param + (from - entry.offset);
        if constexpr (kPack) {
          copy_range<Bits, kTileUnroll>(in_param, in_flat, to - from, threadIdx.x, blockDim.x);
        } else {
          copy_range<Bits, kTileUnroll>(in_flat, in_param, to - from, threadIdx.x, blockDim.x);
        }
      }
      if constexpr (kPack) {
        const uint64_t pad_end = entry.offset + entry.padded;
        const uint64_t pad_from = data_end > lo ? data_end : lo;
        const uint64_t pad_to = pad_end < hi ? pad_end : hi;
        if (pad_from < pad_to) {
          zero_range<Bits, kTileUnroll>(flat + pad_from, pad_to - pad_from, threadIdx.x,
                                        blockDim.x);
        }
      }
    }
  }
}

template <class Bits>
__device__ __forceinline__ void unpack_all(const PackEntry* table, uint64_t count, Bits* flat) {
  if (count == 0) return;
  const PackEntry last = table[count - 1];
  pack_tiles<Bits, false>(table, count, flat, last.offset + last.numel);
}

template <class S, class D>
struct CastOp {
  const typename S::Bits* src;
  typename D::Bits* dst;
  template <int N>
  using Regs = Raw<typename S::Bits, N>;
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t i, Regs<N>& r) const {
    r.load(src + i);
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    float x[N];
    to_floats<S>(r, x);
    store_floats<D>(dst + i, x);
  }
};

template <class S, class D>
__device__ __forceinline__ void cast(const typename S::Bits* src, typename D::Bits* dst,
                                     uint64_t n) {
  // A chunk is one vector of the wider type (see `elementwise`): the fewer elements per vector.
  constexpr int kS = kPerVector<typename S::Bits>;
  constexpr int kD = kPerVector<typename D::Bits>;
  Phase phase;
  phase.add(src);
  phase.add(dst);
  elementwise<(kS < kD ? kS : kD), kRound>(CastOp<S, D>{src, dst}, n, phase, grid_thread(),
                                                grid_threads());
}

}  // namespace fsdp

using fsdp::kBlock;

extern "C" __global__ void __launch_bounds__(kBlock) fill_zero_bytes(uint8_t* dst, uint64_t bytes) {
  fsdp::zero_range<uint8_t, fsdp::kMoveRound>(dst, bytes, fsdp::grid_thread(),
                                               fsdp::grid_threads());
}

#define FSDP_MOVES(name, T)                                                                       \
  extern "C" __global__ void __launch_bounds__(kBlock)                                            \
      copy_##name(const T::Bits* src, T::Bits* dst, uint64_t n) {                                 \
    fsdp::copy_range<T::Bits, fsdp::kMoveRound>(src, dst, n, fsdp::grid_thread(),                \
                                                 fsdp::grid_threads());                           \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(kBlock)                                            \
      pack_##name(const fsdp::PackEntry* table, uint64_t count, T::Bits* flat, uint64_t numel) {  \
    fsdp::pack_tiles<T::Bits, true>(table, count, flat, numel);                                   \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(kBlock)                                            \
      unpack_##name(const fsdp::PackEntry* table, uint64_t count, T::Bits* flat) {                \
    fsdp::unpack_all<T::Bits>(table, count, flat);                                                \
  }

FSDP_MOVES(bf16, fsdp::Bf16)
FSDP_MOVES(f16, fsdp::F16)
FSDP_MOVES(f32, fsdp::F32)

#define FSDP_CAST(sname, S, dname, D)                                                  \
  extern "C" __global__ void __launch_bounds__(kBlock)                                 \
      cast_##sname##_##dname(const S::Bits* src, D::Bits* dst, uint64_t n) {          \
    fsdp::cast<S, D>(src, dst, n);                                                     \
  }

FSDP_CAST(bf16, fsdp::Bf16, f16, fsdp::F16)
FSDP_CAST(bf16, fsdp::Bf16, f32, fsdp::F32)
FSDP_CAST(f16, fsdp::F16, bf16, fsdp::Bf16)
FSDP_CAST(f16, fsdp::F16, f32, fsdp::F32)
FSDP_CAST(f32, fsdp::F32, bf16, fsdp::Bf16)
FSDP_CAST(f32, fsdp::F32, f16, fsdp::F16)
