// Optimizer updates on a shard: fp32 master weights and moments, the param written rounded to its
// dtype. Each formula is `crate::optim`'s, operation for operation, with round-to-nearest
// intrinsics so that nvcc cannot contract into FMAs or approximate the division and square root.
#include <stddef.h>

#include "common.cuh"

namespace fsdp {

// Every optimizer loads at least two operands (master and gradient).
constexpr int kOptimizerRound = arithmetic_round(2, true);

// `crate::optim::StepValues`, field for field: what the step's updates read from device memory.
struct StepValues {
  double bias1;
  uint64_t step;
  float lr;
  float weight_decay;
  float beta1;
  float beta2;
  float eps;
  float sqrt_bias2;
  float grad_scale;
  // Nonzero where the device skipped the step: every update leaves its memory as it is.
  uint32_t skip;
};
static_assert(sizeof(StepValues) == 48 && offsetof(StepValues, step) == 8 &&
                  offsetof(StepValues, lr) == 16 && offsetof(StepValues, eps) == 32 &&
                  offsetof(StepValues, sqrt_bias2) == 36 &&
                  offsetof(StepValues, grad_scale) == 40 && offsetof(StepValues, skip) == 44,
              "StepValues is laid out as crate::optim::StepValues");

// `crate::optim::AdamwCoefficients`, field for field.
struct AdamwCoefficients {
  float decay;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;
  float sqrt_bias2;
  float eps;
  float grad_scale;
};

// `crate::optim::GroupUpdate`: a group's learning-rate scale and whether weight decay applies.
struct GroupUpdate {
  float lr_scale;
  bool decay;
};

// `crate::optim::GroupUpdate::coefficients` for AdamW, operation for operation (f64 where it
// computes in f64).
__device__ __forceinline__ AdamwCoefficients adamw_coefficients(const StepValues& s,
                                                                GroupUpdate group) {
  const double lr = static_cast<double>(__fmul_rn(s.lr, group.lr_scale));
  const double weight_decay = group.decay ? static_cast<double>(s.weight_decay) : 0.0;
  AdamwCoefficients c;
  c.decay = __double2float_rn(__dsub_rn(1.0, __dmul_rn(lr, weight_decay)));
  c.beta1 = s.beta1;
  c.one_minus_beta1 = __double2float_rn(__dsub_rn(1.0, static_cast<double>(s.beta1)));
  c.beta2 = s.beta2;
  c.one_minus_beta2 = __double2float_rn(__dsub_rn(1.0, static_cast<double>(s.beta2)));
  c.step_size = __double2float_rn(__ddiv_rn(lr, s.bias1));
  c.sqrt_bias2 = s.sqrt_bias2;
  c.eps = s.eps;
  c.grad_scale = s.grad_scale;
  return c;
}

// `crate::optim::adamw_element`, operation for operation: the new p, m and v in place.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g,
                                              const AdamwCoefficients& c) {
  g = __fmul_rn(g, c.grad_scale);
  const float decayed = __fmul_rn(p, c.decay);
  m = __fadd_rn(__fmul_rn(c.beta1, m), __fmul_rn(c.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(c.beta2, v), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.sqrt_bias2), c.eps);
  p = __fsub_rn(decayed, __fmul_rn(c.step_size, __fdiv_rn(m, denom)));
}

// For f32 params `param` may be `master`; then the second store is skipped, it would write the
// same bits again.
template <class P>
struct AdamwOp {
  float* master;
  float* m;
  float* v;
  const float* grad;
  typename P::Bits* param;
  AdamwCoefficients c;
  bool aliased;
  template <int N>
  struct Regs {
    Raw<uint32_t, N> p;
    Raw<uint32_t, N> m;
    Raw<uint32_t, N> v;
    Raw<uint32_t, N> g;
  };
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t i, Regs<N>& r) const {
    r.p.load(reinterpret_cast<const uint32_t*>(master) + i);
    r.m.load(reinterpret_cast<const uint32_t*>(m) + i);
    r.v.load(reinterpret_cast<const uint32_t*>(v) + i);
    r.g.load(reinterpret_cast<const uint32_t*>(grad) + i);
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    float p[N];
    float mo[N];
    float vo[N];
    float g[N];
    to_floats<F32>(r.p, p);
    to_floats<F32>(r.m, mo);
    to_floats<F32>(r.v, vo);
    to_floats<F32>(r.g, g);
#pragma unroll
    for (int k = 0; k < N; ++k) adamw_element(p[k], mo[k], vo[k], g[k], c);
    store_floats<F32>(reinterpret_cast<uint32_t*>(master) + i, p);
    store_floats<F32>(reinterpret_cast<uint32_t*>(m) + i, mo);
    store_floats<F32>(reinterpret_cast<uint32_t*>(v) + i, vo);
    if (!aliased) store_floats<P>(param + i, p);
  }
};

// `crate::optim`'s hash of the moments' rounding, operation for operation (32-bit wrapping).
__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x7feb352du;
  x = (x ^ (x >> 15)) * 0x846ca68bu;
  return x ^ (x >> 16);
}

// `crate::optim::moment_seed`, operation for operation.
__device__ __forceinline__ uint32_t moment_seed(uint64_t step, uint32_t group) {
  return mix(static_cast<uint32_t>(step) ^
             mix(static_cast<uint32_t>(step >> 32) ^ mix(group ^ 0x9e3779b9u)));
}

__device__ __forceinline__ uint32_t rounding_bits(uint32_t seed, uint64_t index, uint32_t which) {
  return mix(seed ^ mix(static_cast<uint32_t>(index) ^ mix(static_cast<uint32_t>(index >> 32) ^ which)));
}

// `crate::optim::bf16_stochastic`: the bits below bf16's added to, then cut off; infinities and
// NaN round to nearest.
__device__ __forceinline__ uint32_t bf16_stochastic(float x, uint32_t bits) {
  if (!isfinite(x)) return Bf16::from_f32(x);
  return (__float_as_uint(x) + (bits & 0xFFFFu)) >> 16;
}

// As AdamwOp, the moments stored as bf16: read widened, computed in f32, stored rounded
// stochastically with the bits of (seed, first_index + the element's index in the shard).
template <class P>
struct AdamwBf16MomentsOp {
  float* master;
  Bf16::Bits* m;
  Bf16::Bits* v;
  const float* grad;
  typename P::Bits* param;
  AdamwCoefficients c;
  uint32_t seed;
  uint64_t first_index;
  bool aliased;
  template <int N>
  struct Regs {
    Raw<uint32_t, N> p;
    Raw<uint16_t, N> m;
    Raw<uint16_t, N> v;
    Raw<uint32_t, N> g;
  };
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t i, Regs<N>& r) const {
    r.p.load(reinterpret_cast<const uint32_t*>(master) + i);
    r.m.load(m + i);
    r.v.load(v + i);
    r.g.load(reinterpret_cast<const uint32_t*>(grad) + i);
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    float p[N];
    float mo[N];
    float vo[N];
    float g[N];
    to_floats<F32>(r.p, p);
    to_floats<Bf16>(r.m, mo);
    to_floats<Bf16>(r.v, vo);
    to_floats<F32>(r.g, g);
    Raw<uint16_t, N> ms;
    Raw<uint16_t, N> vs;
    uint32_t mb[N];
    uint32_t vb[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      adamw_element(p[k], mo[k], vo[k], g[k], c);
      const uint64_t index = first_index + i + k;
      mb[k] = bf16_stochastic(mo[k], rounding_bits(seed, index, 0));
      vb[k] = bf16_stochastic(vo[k], rounding_bits(seed, index, 1));
    }
    if constexpr (N == 1) {
      ms.x = static_cast<uint16_t>(mb[0]);
      vs.x = static_cast<uint16_t>(vb[0]);
    } else {
#pragma unroll
      for (int k = 0; k < N / 2; ++k) {
        ms.w[k] = mb[2 * k] | (mb[2 * k + 1] << 16);
        vs.w[k] = vb[2 * k] | (vb[2 * k + 1] << 16);
      }
    }
    store_floats<F32>(reinterpret_cast<uint32_t*>(master) + i, p);
    ms.store(m + i);
    vs.store(v + i);
    if (!aliased) store_floats<P>(param + i, p);
  }
};

template <class P>
struct SgdOp {
  float* master;
  const float* grad;
  typename P::Bits* param;
  float lr;
  float weight_decay;
  float grad_scale;
  bool aliased;
  template <int N>
  struct Regs {
    Raw<uint32_t, N> p;
    Raw<uint32_t, N> g;
  };
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t i, Regs<N>& r) const {
    r.p.load(reinterpret_cast<const uint32_t*>(master) + i);
    r.g.load(reinterpret_cast<const uint32_t*>(grad) + i);
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    float p[N];
    float g[N];
    to_floats<F32>(r.p, p);
    to_floats<F32>(r.g, g);
    // torch.optim.SGD's weight decay adds `weight_decay * p` to the gradient; none at all when it
    // is 0 (not even `0 * p`, which is NaN for an infinite p).
#pragma unroll
    for (int k = 0; k < N; ++k) {
      g[k] = __fmul_rn(g[k], grad_scale);
      const float d = weight_decay != 0.0f ? __fadd_rn(g[k], __fmul_rn(weight_decay, p[k])) : g[k];
      p[k] = __fsub_rn(p[k], __fmul_rn(lr, d));
    }
    store_floats<F32>(reinterpret_cast<uint32_t*>(master) + i, p);
    if (!aliased) store_floats<P>(param + i, p);
  }
};

template <class P>
__device__ __forceinline__ void adamw(float* master, float* m, float* v, const float* grad,
                                      typename P::Bits* param, uint64_t n,
                                      const StepValues* values, GroupUpdate group) {
  const StepValues s = *values;
  if (s.skip) return;
  const AdamwCoefficients c = adamw_coefficients(s, group);
  Phase phase;
  phase.add(master);
  phase.add(m);
  phase.add(v);
  phase.add(grad);
  phase.add(param);
  const bool aliased = static_cast<void*>(param) == static_cast<void*>(master);
  elementwise<kChunk<uint32_t>, kOptimizerRound>(AdamwOp<P>{master, m, v, grad, param, c, aliased},
                                                 n, phase, grid_stride());
}

template <class P>
__device__ __forceinline__ void adamw_bf16_moments(float* master, Bf16::Bits* m, Bf16::Bits* v,
                                                   const float* grad, typename P::Bits* param,
                                                   uint64_t n, const StepValues* values,
                                                   GroupUpdate group, uint32_t group_index,
                                                   uint64_t first_index) {
  const StepValues s = *values;
  if (s.skip) return;
  const AdamwCoefficients c = adamw_coefficients(s, group);
  const uint32_t seed = moment_seed(s.step, group_index);
  Phase phase;
  phase.add(master);
  phase.add(m);
  phase.add(v);
  phase.add(grad);
  phase.add(param);
  const bool aliased = static_cast<void*>(param) == static_cast<void*>(master);
  elementwise<kChunk<uint32_t>, kOptimizerRound>(
      AdamwBf16MomentsOp<P>{master, m, v, grad, param, c, seed, first_index, aliased}, n, phase,
      grid_stride());
}

// `crate::optim::GroupUpdate::coefficients` for SGD, then the update.
template <class P>
__device__ __forceinline__ void sgd(float* master, const float* grad, typename P::Bits* param,
                                    uint64_t n, const StepValues* values, GroupUpdate group) {
  const StepValues s = *values;
  if (s.skip) return;
  const float lr = __fmul_rn(s.lr, group.lr_scale);
  const float weight_decay = group.decay ? s.weight_decay : 0.0f;
  const float grad_scale = s.grad_scale;
  Phase phase;
  phase.add(master);
  phase.add(grad);
  phase.add(param);
  const bool aliased = static_cast<void*>(param) == static_cast<void*>(master);
  elementwise<kChunk<uint32_t>, kOptimizerRound>(
      SgdOp<P>{master, grad, param, lr, weight_decay, grad_scale, aliased}, n, phase,
      grid_stride());
}

}  // namespace fsdp

using fsdp::kBlock;

// `decay` is an int: a kernel parameter of type bool has no layout the driver promises.
#define FSDP_OPTIM(name, P)                                                                     \
  extern "C" __global__ void __launch_bounds__(kBlock)                                          \
      adamw_##name(float* master, float* m, float* v, const float* grad, P::Bits* param,        \
                   uint64_t n, const fsdp::StepValues* values, float lr_scale, int decay) {     \
    fsdp::adamw<P>(master, m, v, grad, param, n, values, {lr_scale, decay != 0});               \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(kBlock)                                          \
      adamw_bf16m_##name(float* master, fsdp::Bf16::Bits* m, fsdp::Bf16::Bits* v,              \
                         const float* grad, P::Bits* param, uint64_t n,                         \
                         const fsdp::StepValues* values, float lr_scale, int decay,             \
                         uint32_t group, uint64_t first_index) {                                \
    fsdp::adamw_bf16_moments<P>(master, m, v, grad, param, n, values, {lr_scale, decay != 0},   \
                                group, first_index);                                            \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(kBlock)                                          \
      sgd_##name(float* master, const float* grad, P::Bits* param, uint64_t n,                  \
                 const fsdp::StepValues* values, float lr_scale, int decay) {                   \
    fsdp::sgd<P>(master, grad, param, n, values, {lr_scale, decay != 0});                       \
  }

FSDP_OPTIM(bf16, fsdp::Bf16)
FSDP_OPTIM(f16, fsdp::F16)
FSDP_OPTIM(f32, fsdp::F32)

// `*dst = values`, by one thread: the step's values, written in stream order after the last
// step's updates read theirs.
extern "C" __global__ void __launch_bounds__(kBlock)
    write_step_values(fsdp::StepValues* dst, fsdp::StepValues values) {
  if (fsdp::grid_thread() == 0) *dst = values;
}

// `crate::engine::GradNorm::of_parts` then `clip_coefficient`, operation for operation, by one
// thread: the ranks' sums of squares (the f64 at the start of each 16-byte part) added in rank
// order, the square root rounded to f32, then `max_norm / (l2 + 1e-6)`, at most 1 (NaN stays
// NaN), into the step's values' `grad_scale`.
extern "C" __global__ void __launch_bounds__(kBlock)
    clip_step_values(const uint8_t* parts, uint32_t ranks, float max_norm,
                     fsdp::StepValues* values) {
  if (fsdp::grid_thread() != 0) return;
  double sum = 0.0;
  for (uint32_t r = 0; r < ranks; ++r) {
    sum = __dadd_rn(sum, *reinterpret_cast<const double*>(parts + 16u * r));
  }
  const float l2 = __double2float_rn(__dsqrt_rn(sum));
  const float coefficient = __fdiv_rn(max_norm, __fadd_rn(l2, 1e-6f));
  values->grad_scale = isnan(coefficient) ? coefficient : fminf(coefficient, 1.0f);
}

// `crate::backend::Backend::skip_nonfinite_step`, by one thread: the step is skipped where the
// 2-norm, combined as `clip_step_values` combines it, or the largest magnitude of any rank's part
// (the u32 bits at byte 8; NaN's bits are above infinity's) is infinite or NaN, and then counted.
extern "C" __global__ void __launch_bounds__(kBlock)
    skip_nonfinite_step(const uint8_t* parts, uint32_t ranks, unsigned long long* skipped,
                        fsdp::StepValues* values) {
  if (fsdp::grid_thread() != 0) return;
  double sum = 0.0;
  uint32_t top = 0;
  for (uint32_t r = 0; r < ranks; ++r) {
    sum = __dadd_rn(sum, *reinterpret_cast<const double*>(parts + 16u * r));
    top = max(top, *reinterpret_cast<const uint32_t*>(parts + 16u * r + 8u));
  }
  const float l2 = __double2float_rn(__dsqrt_rn(sum));
  const bool skip = top >= 0x7f800000u || !isfinite(l2);
  values->skip = skip ? 1u : 0u;
  if (skip) *skipped += 1ull;
}

// `x^n` as `crate::optim::powi` computes it: by repeated squaring, the same multiplications in
// the same order.
static __device__ double powi_by_squaring(double x, uint32_t n) {
  double r = 1.0;
  for (;;) {
    if (n & 1u) r = __dmul_rn(r, x);
    n /= 2u;
    if (n == 0u) return r;
    x = __dmul_rn(x, x);
  }
}

// `crate::backend::Backend::correct_step_values`, by one thread: the host's values of update
// `step` become update `step - k`'s, `k` the steps skipped on the device, with
// `crate::optim::bias_corrections` operation for operation.
extern "C" __global__ void __launch_bounds__(kBlock)
    correct_step_values(const unsigned long long* skipped, fsdp::StepValues* values) {
  if (fsdp::grid_thread() != 0) return;
  const unsigned long long k = *skipped;
  if (k == 0ull) return;
  fsdp::StepValues s = *values;
  s.step = s.step > k ? s.step - k : 0u;
  const uint32_t t = s.step < 0x7fffffffull ? static_cast<uint32_t>(s.step) : 0x7fffffffu;
  s.bias1 = __dsub_rn(1.0, powi_by_squaring(static_cast<double>(s.beta1), t));
  const double bias2 = __dsub_rn(1.0, powi_by_squaring(static_cast<double>(s.beta2), t));
  s.sqrt_bias2 = __double2float_rn(__dsqrt_rn(bias2));
  *values = s;
}
