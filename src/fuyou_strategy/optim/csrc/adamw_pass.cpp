// One pass of AdamW over a chunk of optimizer state, out of place: read the master, the two moments and the
// gradient once; write the new master, moments and the compute-dtype weight once. And the gradients' norms as
// torch takes them, reading a bf16 or fp16 gradient in its own dtype (grad_norms, at the end).
//
// The arithmetic is torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, fp32, ADAMW mode,
// no amsgrad, no maximize) statement for statement, on at::vec::Vectorized<float> of the same CPU capability
// torch dispatches to, so that each element comes out bit for bit as torch.optim.AdamW(fused=True) computes
// it. Three differences, none in the arithmetic: the inputs and outputs are separate pointers (they may be
// the same: in place); the gradient is read in its own dtype (fp32, bf16 or fp16; widening is exact),
// multiplied by the unscale and clip factors first when given, as fuyou's update does in fp32 before the
// kernel; and the hyperparameters' vectors are made once per call (`Consts`), not at every vector. Only whole
// blocks of 2 x Vectorized<float>::size() elements are updated here: the caller runs torch's own kernel on the
// rest (torch's scalar tail), and checks at load that both agree bitwise.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kBlock = 2 * fVec::size();  // elements per step: one Vectorized<BFloat16> widens to two fVec
constexpr int64_t kGrainBlocks = 2048;        // blocks a thread takes at a time: ~64K elements, ~1 MiB of traffic

struct Hyper {
  double lr, weight_decay, beta2, exp_avg_grad_coefficient, exp_avg_sq_grad_coefficient, bias_correction2_sqrt,
      eps, step_size;
  bool has_inv_scale, has_coef;
  float inv_scale, coef;
};

template <typename T>
inline void load2(const T* p, fVec& a, fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + fVec::size());
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
  }
}

// A vector's bytes to `p`, with a non-temporal store when `stream` (an output apart from its input, aligned):
// a store to memory the pass did not read would otherwise first read the line into the cache (a read for
// ownership), half again the traffic of writing it. The values are the same either way. at::vec has no
// non-temporal store, so these two lines use the intrinsics of the capability.
template <typename V>
inline void put(void* p, const V& v, bool stream) {
#if defined(CPU_CAPABILITY_AVX512)
  if (stream) {
    if constexpr (std::is_same_v<V, fVec>) _mm512_stream_ps(static_cast<float*>(p), v);
    else _mm512_stream_si512(static_cast<__m512i*>(p), v);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (stream) {
    if constexpr (std::is_same_v<V, fVec>) _mm256_stream_ps(static_cast<float*>(p), v);
    else _mm256_stream_si256(static_cast<__m256i*>(p), v);
    return;
  }
#endif
  v.store(p);
}

template <typename T>
inline void store2(T* p, const fVec& a, const fVec& b, bool stream) {
  if constexpr (std::is_same_v<T, float>) {
    put(p, a, stream);
    put(p + fVec::size(), b, stream);
  } else {
    put(p, at::vec::convert_from_float<T>(a, b), stream);
  }
}

// Whether the pass streams its stores to `out`: it is not `in` (nothing there is in the cache) and it is
// aligned for the capability's non-temporal stores (a whole vector; every block then stays aligned).
inline bool streams(const void* out, const void* in) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return out != in && reinterpret_cast<uintptr_t>(out) % sizeof(fVec) == 0;
#else
  return false;
#endif
}

// The hyperparameters as torch's adam_math makes its vectors of them, made once per call of the pass rather than
// at every vector: the same float values, and the lerp's mask the same in every lane.
struct Consts {
  fVec inv_scale, coef, decay, coeff, beta2, sq_coef, bias_correction2_sqrt, eps, neg_step_size;
  fVec mask;  // lerp's: all lanes set where |1 - beta1| < 0.5
  bool has_inv_scale, has_coef, has_decay;

  explicit Consts(const Hyper& h)
      : inv_scale(h.inv_scale), coef(h.coef), decay(float(1 - h.lr * h.weight_decay)), beta2(float(h.beta2)),
        sq_coef(float(h.exp_avg_sq_grad_coefficient)), bias_correction2_sqrt(float(h.bias_correction2_sqrt)),
        eps(float(h.eps)), neg_step_size(float(-h.step_size)), has_inv_scale(h.has_inv_scale), has_coef(h.has_coef),
        has_decay(h.weight_decay != 0.f) {
    const fVec lerp_weight = fVec(float(h.exp_avg_grad_coefficient));
    mask = lerp_weight.abs() < fVec(0.5);
    coeff = fVec::blendv(lerp_weight - fVec(1), lerp_weight, mask);
  }
};

// torch's fp32 adam_math body (ADAMW, amsgrad=false, maximize=false), one vector.
inline void adamw_vec(fVec& param_vec, fVec grad_vec, fVec& exp_avg_vec, fVec& exp_avg_sq_vec, const Consts& k) {
  if (k.has_inv_scale) grad_vec = grad_vec * k.inv_scale;  // GradScaler.unscale_, in fp32
  if (k.has_coef) grad_vec = grad_vec * k.coef;            // clip_grad_norm_'s multiply, in fp32
  if (k.has_decay) {
    param_vec = param_vec * k.decay;
  }
  // exp_avg.lerp_(grad, 1 - beta1)
  auto base = fVec::blendv(grad_vec, exp_avg_vec, k.mask);
  exp_avg_vec = at::vec::fmadd(k.coeff, grad_vec - exp_avg_vec, base);

  exp_avg_sq_vec = exp_avg_sq_vec * k.beta2 + k.sq_coef * grad_vec * grad_vec;

  fVec denom_vec = (exp_avg_sq_vec.sqrt() / k.bias_correction2_sqrt) + k.eps;
  param_vec = param_vec + k.neg_step_size * exp_avg_vec / denom_vec;
}

// One chunk's pass as the threads share it: its pointers, the gradient's and the weight's dtype (none: no weight
// written), its whole blocks and its constants. `run_blocks` updates blocks [b0, b1) of it.
struct Chunk {
  const float *master_in, *exp_avg_in, *exp_avg_sq_in;
  const void* grad;
  float *master_out, *exp_avg_out, *exp_avg_sq_out;
  void* weight_out;
  at::ScalarType grad_type, weight_type;
  bool has_weight;
  int64_t blocks;
  Hyper h;
};

// Blocks a tile holds (`blocks_of`): its new masters, kept on the stack for the weight's loop, stay in L1.
constexpr int64_t kTileBlocks = 16;

// The pass over blocks [b0, b1) of `c`, a tile of kTileBlocks at a time: the arithmetic of every block of the tile,
// its state written out, then the tile's new weights from the masters kept in L1. Each block's weight written in the
// same loop as its state made that loop long enough (with the weight's rounding) that the core overlapped fewer
// blocks' arithmetic: slower where the pass is bound by the core, not the memory (docs/one-pass-update.md). The
// same values either way.
template <typename G, typename W>
void blocks_of(const Chunk& c, int64_t b0, int64_t b1) {
  const float *master_in = c.master_in, *exp_avg_in = c.exp_avg_in, *exp_avg_sq_in = c.exp_avg_sq_in;
  float *master_out = c.master_out, *exp_avg_out = c.exp_avg_out, *exp_avg_sq_out = c.exp_avg_sq_out;
  const G* grad = static_cast<const G*>(c.grad);
  W* weight_out = static_cast<W*>(c.weight_out);
  const bool sm = streams(master_out, master_in), sa = streams(exp_avg_out, exp_avg_in),
             ss = streams(exp_avg_sq_out, exp_avg_sq_in), sw = streams(weight_out, master_in);
  const Consts k(c.h);
  alignas(64) float kept[kTileBlocks * kBlock];  // the tile's new masters
  for (int64_t t0 = b0 * kBlock, end = b1 * kBlock; t0 < end; t0 += kTileBlocks * kBlock) {
    const int64_t t1 = std::min(t0 + kTileBlocks * kBlock, end);
    for (int64_t d = t0; d < t1; d += kBlock) {
      fVec g1, g2;
      load2(grad + d, g1, g2);
      fVec p1 = fVec::loadu(master_in + d), p2 = fVec::loadu(master_in + d + fVec::size());
      fVec m1 = fVec::loadu(exp_avg_in + d), m2 = fVec::loadu(exp_avg_in + d + fVec::size());
      fVec v1 = fVec::loadu(exp_avg_sq_in + d), v2 = fVec::loadu(exp_avg_sq_in + d + fVec::size());
      adamw_vec(p1, g1, m1, v1, k);
      adamw_vec(p2, g2, m2, v2, k);
      store2(master_out + d, p1, p2, sm);
      store2(exp_avg_out + d, m1, m2, sa);
      store2(exp_avg_sq_out + d, v1, v2, ss);
      if constexpr (!std::is_same_v<W, void>) {
        p1.store(kept + (d - t0));
        p2.store(kept + (d - t0) + fVec::size());
      }
    }
    if constexpr (!std::is_same_v<W, void>) {
      for (int64_t d = t0; d < t1; d += kBlock) {
        const fVec p1 = fVec::loadu(kept + (d - t0)), p2 = fVec::loadu(kept + (d - t0) + fVec::size());
        store2(weight_out + d, p1, p2, sw);
      }
    }
  }
}

template <typename G>
void blocks_weight(const Chunk& c, int64_t b0, int64_t b1) {
  if (!c.has_weight) return blocks_of<G, void>(c, b0, b1);
  switch (c.weight_type) {
    case at::kFloat: return blocks_of<G, float>(c, b0, b1);
    case at::kBFloat16: return blocks_of<G, at::BFloat16>(c, b0, b1);
    default: return blocks_of<G, at::Half>(c, b0, b1);  // checked by make_chunk
  }
}

void run_blocks(const Chunk& c, int64_t b0, int64_t b1) {
  switch (c.grad_type) {
    case at::kFloat: return blocks_weight<float>(c, b0, b1);
    case at::kBFloat16: return blocks_weight<at::BFloat16>(c, b0, b1);
    default: return blocks_weight<at::Half>(c, b0, b1);  // checked by make_chunk
  }
}

void check(const at::Tensor& t, const char* name, int64_t n, bool fp32) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() >= n, "adamw_pass: ", name,
              " must be a contiguous CPU tensor of at least ", n, " elements");
  TORCH_CHECK(!fp32 || t.scalar_type() == at::kFloat, "adamw_pass: ", name, " must be float32");
}

// -- Gradient norms as torch takes them ----------------------------------------------------------------------
// torch.linalg.vector_norm(g, 2) of a contiguous fp32 CPU tensor sums in a fixed order, single-threaded:
// `lanes` fp32 accumulators, accumulator j adding the rounded square of every element at j modulo `lanes`, in
// order (no fused multiply-add); the accumulators folded left to right; then the last size % lanes elements added
// one by one, the first `rounded` of them as rounded squares and the others with a fused multiply-add (how the
// compiler built torch's scalar loop); the square root last. The layout (`lanes`, `rounded` for each tail length)
// depends on how torch was built, so the caller finds it by comparing with torch at load and uses none that differs.
// A bf16 or fp16 gradient is widened (exact) and, given `inv_scale`, multiplied by it in fp32 (as `unscaled`), so
// its norm is that of the fp32 gradient `grad_norm` would make, without making it: one read of 2 bytes per element.

// A value the compiler must have computed (rounded) before its next use: no contraction of `a + x * x` into a fused
// multiply-add, whatever -ffp-contract says. No instruction is emitted. The asm operand must fit one vector register,
// so a wider GCC vector (16 floats under AVX2) is pinned a register's width at a time.
#if defined(__AVX512F__)
#define FUYOU_REGISTER_BYTES 64
#else
#define FUYOU_REGISTER_BYTES 32
#endif
typedef float RegisterLanes __attribute__((vector_size(FUYOU_REGISTER_BYTES), may_alias));

template <typename V>
inline void rounded_here(V& v) {
  if constexpr (sizeof(V) <= FUYOU_REGISTER_BYTES) {
    asm("" : "+x"(v));
  } else {
    static_assert(sizeof(V) % FUYOU_REGISTER_BYTES == 0, "a whole number of registers");
    RegisterLanes* part = reinterpret_cast<RegisterLanes*>(&v);
    for (size_t i = 0; i < sizeof(V) / FUYOU_REGISTER_BYTES; i++) asm("" : "+x"(part[i]));
  }
}

// The accumulators, one vector of L floats (GCC's vector extension: its + and * are per lane).
typedef float Lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Lanes16 __attribute__((vector_size(16 * sizeof(float))));

// Add the squares of the `m` fp32 values at `x` (a multiple of L) into the accumulators, lane j the elements at j
// modulo L, in order.
template <typename Lanes, int64_t L>
inline void add_squares(Lanes& acc, const float* x, int64_t m) {
  for (int64_t d = 0; d < m; d += L) {
    Lanes v;
    std::memcpy(&v, x + d, sizeof(Lanes));
    Lanes sq = v * v;
    rounded_here(sq);
    acc = acc + sq;
  }
}

// A norm's progress between calls (`adamw_chunks` called with `finish_norms` false: a job's chunks one call each):
// the accumulators and how many elements they hold, so that the next call goes on where this one paused, adding
// the same squares in the same order. Python holds one per gradient (`gradients.Beside`); each is one thread's at a
// time (the call's thread that takes it).
struct NormProgress {
  float acc[16] = {};    // the first L lanes' sums
  int64_t position = 0;  // the elements summed into `acc`: whole blocks, from the first
  bool done = false;     // `value` is the norm
  float value = 0.f;
};

// Elements summed between two looks at whether to pause.
constexpr int64_t kNormStep = 256 * kBlock;

// Go on with the norm of `g` (`size` elements) from `p`, in torch's order (above), a kNormStep at a time, until it
// is done or `pause()` says to stop: then its accumulators and position are left in `p` for a later call.
template <typename T, int64_t L, typename Pause>
void norm_on(const T* g, int64_t size, bool has_inv, float inv, int64_t tail_group, NormProgress& p, Pause&& pause) {
  using Lanes = std::conditional_t<L == 8, Lanes8, Lanes16>;
  static_assert(sizeof(Lanes) == L * sizeof(float), "one accumulator per lane");
  static_assert(kBlock % L == 0 && kNormStep % kBlock == 0, "a block fills whole accumulator vectors");
  if (p.done) return;
  Lanes acc;
  std::memcpy(&acc, p.acc, sizeof(Lanes));
  const int64_t whole = size - size % L, blocks = whole - whole % kBlock;
  const bool direct = std::is_same_v<T, float> && !has_inv;  // the gradient's own values: read where they are
  // A block at a time widened (and unscaled) just before its squares are added, in the L1 cache: widening a long
  // run into a buffer first cost as much as the sum (docs/one-pass-update.md). Same values, same order.
  alignas(64) float x[kBlock];
  for (int64_t d = p.position; d < blocks;) {
    if (d > p.position && pause()) {
      std::memcpy(p.acc, &acc, sizeof(Lanes));
      p.position = d;
      return;
    }
    const int64_t e = std::min(d + kNormStep, blocks);
    if (direct) {
      add_squares<Lanes, L>(acc, reinterpret_cast<const float*>(g) + d, e - d);
    } else {
      for (; d < e; d += kBlock) {
        fVec a, b;
        load2(g + d, a, b);
        if (has_inv) {
          a = a * fVec(inv);
          b = b * fVec(inv);
        }
        a.store(x);
        b.store(x + fVec::size());
        add_squares<Lanes, L>(acc, x, kBlock);
      }
    }
    d = e;
  }
  const int64_t m = whole - blocks;  // fewer than a block, a multiple of L
  if (direct) {
    add_squares<Lanes, L>(acc, reinterpret_cast<const float*>(g) + blocks, m);
  } else {
    for (int64_t k = 0; k < m; k++) {
      const float v = static_cast<float>(g[blocks + k]);
      x[k] = has_inv ? v * inv : v;
    }
    add_squares<Lanes, L>(acc, x, m);
  }
  float lanes[L];
  std::memcpy(lanes, &acc, sizeof(Lanes));
  float total = lanes[0];
  for (int64_t j = 1; j < L; j++) total = total + lanes[j];
  const int64_t tail = size - whole, rounded = tail - tail % tail_group;
  for (int64_t d = whole; d < size; d++) {
    float v = static_cast<float>(g[d]);
    if (has_inv) v = v * inv;
    if (d - whole < rounded) {
      float sq = v * v;
      rounded_here(sq);
      total = total + sq;
    } else {
      total = std::fma(v, v, total);
    }
  }
  p.value = std::sqrt(total);
  p.done = true;
}

template <typename T, typename Pause>
void norm_lanes(const T* g, int64_t size, bool has_inv, float inv, int64_t lanes, int64_t tail_group,
                NormProgress& p, Pause&& pause) {
  switch (lanes) {
    case 8: return norm_on<T, 8>(g, size, has_inv, inv, tail_group, p, pause);
    case 16: return norm_on<T, 16>(g, size, has_inv, inv, tail_group, p, pause);
    default: TORCH_CHECK(false, "grad_norms: lanes must be 8 or 16, got ", lanes);  // checked by grad_norms
  }
}

// `norm_on` of one gradient tensor (checked by `Norms`).
template <typename Pause>
void norm_one(const at::Tensor& t, bool has_inv, float inv, int64_t lanes, int64_t tail_group, NormProgress& p,
              Pause&& pause) {
  switch (t.scalar_type()) {
    case at::kFloat: return norm_lanes(t.data_ptr<float>(), t.numel(), has_inv, inv, lanes, tail_group, p, pause);
    case at::kBFloat16:
      return norm_lanes(t.data_ptr<at::BFloat16>(), t.numel(), has_inv, inv, lanes, tail_group, p, pause);
    case at::kHalf: return norm_lanes(t.data_ptr<at::Half>(), t.numel(), has_inv, inv, lanes, tail_group, p, pause);
    default: TORCH_CHECK(false, "grad_norms: a gradient must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}


// As torch's kernel: the bias corrections in double, from the step count as a float.
Hyper make_hyper(double lr, double beta1, double beta2, double weight_decay, double eps, double step,
                 c10::optional<double> inv_scale, c10::optional<double> coef) {
  double bias_correction1 = 1 - std::pow(beta1, step);
  double bias_correction2 = 1 - std::pow(beta2, step);
  return Hyper{lr, weight_decay, beta2, 1 - beta1, 1 - beta2, std::sqrt(bias_correction2), eps, lr / bias_correction1,
               inv_scale.has_value(), coef.has_value(), float(inv_scale.value_or(1.0)), float(coef.value_or(1.0))};
}

// The pass over the first `n` elements of the fp32 master, moments (in: a, b, c; out: x, y, z; checked by the
// caller) and of the gradient and the weight, checked here: its whole blocks (the rest is the caller's).
Chunk make_chunk(const float* a, const float* b, const float* c, const at::Tensor& grad, float* x, float* y, float* z,
                 const c10::optional<at::Tensor>& weight_out, int64_t n, const Hyper& h) {
  check(grad, "grad", n, false);
  const auto gt = grad.scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf,
              "adamw_pass: grad must be float32, bfloat16 or float16, got ", gt);
  at::ScalarType wt = at::kFloat;
  if (weight_out.has_value()) {
    check(*weight_out, "weight_out", n, false);
    wt = weight_out->scalar_type();
    TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf,
                "adamw_pass: weight_out must be float32, bfloat16 or float16, got ", wt);
  }
  return Chunk{a, b, c, grad.data_ptr(), x, y, z, weight_out.has_value() ? weight_out->data_ptr() : nullptr, gt, wt,
               weight_out.has_value(), n / kBlock, h};
}

// The norms to take beside the chunks' passes (`run`): each gradient's (checked here: an error in a parallel task
// would name no tensor), unscaled by `inv_scale` when given, in the order `lanes`, `tail_group` (see above), each
// carried on from its `progress`. `finish`: every norm is finished in this call; else each goes on only while the
// chunks' blocks last (`run`), and the next call carries it on.
struct Norms {
  const std::vector<at::Tensor>& grads;
  bool has_inv;
  float inv;
  int64_t lanes, tail_group;
  std::vector<NormProgress*> progress;
  bool finish;

  Norms(const std::vector<at::Tensor>& g, c10::optional<double> inv_scale, int64_t l, int64_t t,
        std::vector<NormProgress*> p, bool f)
      : grads(g), has_inv(inv_scale.has_value()), inv(static_cast<float>(inv_scale.value_or(1.0))), lanes(l),
        tail_group(t), progress(std::move(p)), finish(f) {
    TORCH_CHECK(progress.size() == grads.size(), "grad_norms: one progress per gradient, got ", progress.size(),
                " for ", grads.size());
    if (grads.empty()) return;
    for (size_t i = 0; i < grads.size(); i++) {
      const auto& g = grads[i];
      TORCH_CHECK(g.device().is_cpu() && g.is_contiguous(), "grad_norms: every gradient must be a contiguous CPU tensor");
      const auto dtype = g.scalar_type();
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                  "grad_norms: a gradient must be float32, bfloat16 or float16, got ", dtype);
      TORCH_CHECK(progress[i] != nullptr, "grad_norms: a progress is None");
    }
    TORCH_CHECK(lanes == 8 || lanes == 16, "grad_norms: lanes must be 8 or 16, got ", lanes);
    TORCH_CHECK(tail_group >= 1, "grad_norms: tail_group must be at least 1, got ", tail_group);
  }

  // Each norm's value (NaN where not done) into `out`, `grads.size()` floats.
  void values(float* out) const {
    for (size_t i = 0; i < progress.size(); i++) out[i] = progress[i]->done ? progress[i]->value : NAN;
  }
};

// Every chunk's whole blocks and every norm, shared among the caller's intra-op threads in one parallel region:
// a norm is one thread's (its order is sequential); a chunk's blocks go kGrainBlocks at a time (a smaller chunk
// whole). Each thread takes the next norm left (the largest first), then the next grain left, so that while a norm
// holds one thread the others update, and a run of small chunks is not one thread's. Which thread takes what changes
// no element's arithmetic: each block is updated once, as torch's kernel updates it, and each norm summed in torch's
// order.
//
// Unless `norms.finish`, a norm goes on only while there are blocks to update: its thread pauses it once every grain
// is done (so that no thread waits for a norm at the end of the call), and the next call goes on from there. One
// thread then never takes a norm, so that the grains are always done; a call on one thread takes none.
void run(const std::vector<Chunk>& chunks, const Norms& norms) {
  struct Grain {
    size_t chunk;
    int64_t b0, b1;
  };
  std::vector<Grain> grains;
  for (size_t i = 0; i < chunks.size(); i++) {
    for (int64_t b = 0; b < chunks[i].blocks; b += kGrainBlocks) {
      grains.push_back({i, b, std::min(b + kGrainBlocks, chunks[i].blocks)});
    }
  }
  const size_t nnorms = norms.grads.size();
  // The norms the largest first: a norm is one thread's, so a large one taken last (a model's output layer, the
  // last gradient of the list) would run alone after the others ended; taken first, it runs while they are shared.
  std::vector<size_t> order(nnorms);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return norms.grads[a].numel() > norms.grads[b].numel(); });
  // The next norm and the next grain to take, and the grains done: shared by the threads, each index taken once.
  std::atomic<size_t> next_norm{0}, next_grain{0}, grains_done{0};
  auto pause = [&]() { return !norms.finish && grains_done.load(std::memory_order_relaxed) == grains.size(); };
  auto take = [&](bool with_norms) {
    for (size_t j = with_norms ? next_norm.fetch_add(1) : nnorms; j < nnorms; j = next_norm.fetch_add(1)) {
      const size_t i = order[j];  // at least a step of it, so that each call takes a norm further
      norm_one(norms.grads[i], norms.has_inv, norms.inv, norms.lanes, norms.tail_group, *norms.progress[i], pause);
      if (!norms.progress[i]->done) break;  // paused: every grain is done
    }
    for (size_t j = next_grain.fetch_add(1); j < grains.size(); j = next_grain.fetch_add(1)) {
      run_blocks(chunks[grains[j].chunk], grains[j].b0, grains[j].b1);
      if (!norms.finish) grains_done.fetch_add(1, std::memory_order_relaxed);  // counted where a norm may pause
    }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    _mm_sfence();  // non-temporal stores are weakly ordered: visible before this task reports done
#endif
  };
  const int64_t tasks = std::min<int64_t>(static_cast<int64_t>(nnorms + grains.size()), at::get_num_threads());
  if (tasks <= 1) {
    take(norms.finish);
    return;
  }
  // One task per thread, each taking until nothing is left; an error in one is raised here, after the others end.
  // The last task takes no norm unless they are finished here; a thread given several tasks (fewer threads than
  // asked, or a nested region run inline) takes them as one call on one thread would.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    take(norms.finish || (end - begin == 1 && end < tasks));
  });
}

const std::vector<at::Tensor> kNoGrads;
const Norms kNoNorms(kNoGrads, c10::nullopt, 8, 1, {}, true);

// `run` of one chunk's pass (see `make_chunk`); returns the elements done (whole blocks).
int64_t pass_over(const float* a, const float* b, const float* c, const at::Tensor& grad, float* x, float* y,
                  float* z, const c10::optional<at::Tensor>& weight_out, int64_t n, double lr, double beta1,
                  double beta2, double weight_decay, double eps, double step, c10::optional<double> inv_scale,
                  c10::optional<double> coef) {
  const Chunk chunk = make_chunk(a, b, c, grad, x, y, z, weight_out, n,
                                 make_hyper(lr, beta1, beta2, weight_decay, eps, step, inv_scale, coef));
  run({chunk}, kNoNorms);
  return chunk.blocks * kBlock;
}

// One state chunk as the store holds it (`formats.Layout("fp32")`), checked: `out` is the chunk's fp32 values,
// master, exp_avg and exp_avg_sq of `n` elements each, one after the other, written from `source` (the same
// layout; none: `out` itself, in place), the master read from `master_in` when given (a parameter holding it).
// `master_in_place`: the new master is written back into `master_in` (an fp32 parameter that is its own master)
// and not into `out`, whose master is left as it was, and no weight is written: the 4 bytes per element an fp32
// parameter would otherwise take twice.
Chunk state_chunk(const at::Tensor& out, const c10::optional<at::Tensor>& source,
                  const c10::optional<at::Tensor>& master_in, const at::Tensor& grad,
                  const c10::optional<at::Tensor>& weight_out, int64_t n, const Hyper& h,
                  bool master_in_place = false) {
  const at::Tensor& in = source.has_value() ? *source : out;
  check(out, "out", 3 * n, true);
  check(in, "source", 3 * n, true);
  if (master_in.has_value()) check(*master_in, "master_in", n, true);
  TORCH_CHECK(!master_in_place || (master_in.has_value() && !weight_out.has_value()),
              "adamw_chunks: a master updated in place needs its master_in and no weight");
  const float* i = in.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* master_out = master_in_place ? master_in->data_ptr<float>() : o;
  return make_chunk(master_in.has_value() ? master_in->data_ptr<float>() : i, i + n, i + 2 * n, grad, master_out,
                    o + n, o + 2 * n, weight_out, n, h);
}

}  // namespace

// Updates the first `blocks * block_elements()` elements; returns that count.
int64_t adamw_pass(const at::Tensor& master_in, const at::Tensor& exp_avg_in, const at::Tensor& exp_avg_sq_in,
                   const at::Tensor& grad, const at::Tensor& master_out, const at::Tensor& exp_avg_out,
                   const at::Tensor& exp_avg_sq_out, const c10::optional<at::Tensor>& weight_out, int64_t n,
                   double lr, double beta1, double beta2, double weight_decay, double eps, double step,
                   c10::optional<double> inv_scale, c10::optional<double> coef) {
  check(master_in, "master_in", n, true);
  check(exp_avg_in, "exp_avg_in", n, true);
  check(exp_avg_sq_in, "exp_avg_sq_in", n, true);
  check(master_out, "master_out", n, true);
  check(exp_avg_out, "exp_avg_out", n, true);
  check(exp_avg_sq_out, "exp_avg_sq_out", n, true);
  return pass_over(master_in.data_ptr<float>(), exp_avg_in.data_ptr<float>(), exp_avg_sq_in.data_ptr<float>(), grad,
                   master_out.data_ptr<float>(), exp_avg_out.data_ptr<float>(), exp_avg_sq_out.data_ptr<float>(),
                   weight_out, n, lr, beta1, beta2, weight_decay, eps, step, inv_scale, coef);
}

// `adamw_pass` on one state chunk as the store holds it (`state_chunk`). One call, and no view made at all (a view
// costs a microsecond even in C++, several per chunk).
int64_t adamw_chunk(const at::Tensor& out, const c10::optional<at::Tensor>& source,
                    const c10::optional<at::Tensor>& master_in, const at::Tensor& grad,
                    const c10::optional<at::Tensor>& weight_out, int64_t n, double lr, double beta1, double beta2,
                    double weight_decay, double eps, double step, c10::optional<double> inv_scale,
                    c10::optional<double> coef) {
  const Chunk chunk = state_chunk(out, source, master_in, grad, weight_out, n,
                                  make_hyper(lr, beta1, beta2, weight_decay, eps, step, inv_scale, coef));
  run({chunk}, kNoNorms);
  return chunk.blocks * kBlock;
}

// `adamw_chunk` on each chunk of a list, and the norms of `norm_grads` (unscaled by `norm_inv_scale`, in the order
// `lanes`, `tail_group`: `grad_norms`), all in one parallel region (`run`): a run of parameters
// (`OptimizerState.group_job`), whose many small chunks would each pay for a call from Python, and the norms a
// speculative update takes before it, which would otherwise hold one thread while the others wait. Every chunk has
// its own length and step count, the same hyperparameters and factors; `master_ins` and `masters_in_place`
// (`state_chunk`) are each empty or one per chunk.
// Each norm goes on from its `norm_progress` (one per gradient); `finish_norms` false: only while the chunks' blocks
// last, for a job whose chunks come one call each (`OptimizerState.update_job`), the last call finishing them.
// Returns each chunk's elements done (its ragged end is the caller's, as above) and the norms (NaN: not done yet).
std::tuple<std::vector<int64_t>, at::Tensor> adamw_chunks(
    const std::vector<at::Tensor>& outs, const std::vector<c10::optional<at::Tensor>>& sources,
    const std::vector<c10::optional<at::Tensor>>& master_ins, const std::vector<bool>& masters_in_place,
    const std::vector<at::Tensor>& grads, const std::vector<c10::optional<at::Tensor>>& weights,
    const std::vector<int64_t>& ns, const std::vector<double>& steps, double lr, double beta1, double beta2,
    double weight_decay, double eps, c10::optional<double> inv_scale, c10::optional<double> coef,
    const std::vector<at::Tensor>& norm_grads, c10::optional<double> norm_inv_scale, int64_t lanes, int64_t tail_group,
    const std::vector<NormProgress*>& norm_progress, bool finish_norms) {
  const size_t n = outs.size();
  TORCH_CHECK(sources.size() == n && grads.size() == n && weights.size() == n && ns.size() == n && steps.size() == n &&
                  (master_ins.empty() || master_ins.size() == n) &&
                  (masters_in_place.empty() || masters_in_place.size() == n),
              "adamw_chunks: outs, sources, grads, weights, ns, steps (and master_ins, masters_in_place, unless "
              "empty) must be lists of one length");
  std::vector<Chunk> chunks;
  chunks.reserve(n);
  std::vector<int64_t> done(n);
  for (size_t i = 0; i < n; i++) {
    chunks.push_back(state_chunk(outs[i], sources[i], master_ins.empty() ? c10::nullopt : master_ins[i], grads[i],
                                 weights[i], ns[i],
                                 make_hyper(lr, beta1, beta2, weight_decay, eps, steps[i], inv_scale, coef),
                                 !masters_in_place.empty() && masters_in_place[i]));
    done[i] = chunks.back().blocks * kBlock;
  }
  const Norms norms(norm_grads, norm_inv_scale, lanes, tail_group, norm_progress, finish_norms);
  run(chunks, norms);
  at::Tensor out = at::empty({static_cast<int64_t>(norm_grads.size())}, at::kFloat);
  norms.values(out.data_ptr<float>());
  return {done, out};
}

// Each tensor's norm (above), into an fp32 tensor of as many elements. Each norm is one thread's (its order is
// sequential); the tensors are shared out among the caller's intra-op threads, each taking the next one left.
at::Tensor grad_norms(const std::vector<at::Tensor>& grads, c10::optional<double> inv_scale, int64_t lanes,
                      int64_t tail_group) {
  std::vector<NormProgress> fresh(grads.size());
  std::vector<NormProgress*> progress;
  for (auto& p : fresh) progress.push_back(&p);
  const Norms norms(grads, inv_scale, lanes, tail_group, std::move(progress), true);
  run({}, norms);
  at::Tensor out = at::empty({static_cast<int64_t>(grads.size())}, at::kFloat);
  norms.values(out.data_ptr<float>());
  return out;
}

int64_t block_elements() { return kBlock; }
int64_t grain_blocks() { return kGrainBlocks; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NormProgress>(m, "NormProgress", "A norm's progress between calls of adamw_chunks (see NormProgress)")
      .def(py::init<>())
      .def_readonly("position", &NormProgress::position, "Elements summed so far")
      .def_readonly("done", &NormProgress::done, "Whether the norm is finished")
      .def_property_readonly("value", [](const NormProgress& p) { return p.done ? p.value : NAN; },
                             "The norm, once done (else NaN)");
  // Without the GIL: the pass runs on the optimizer's worker while the training thread runs Python (forward,
  // backward's hooks); holding it would stop that thread for the whole pass. The tensors' owners are the caller's.
  m.def("adamw_pass", &adamw_pass, "One out-of-place AdamW pass over whole blocks (see the file's comment)",
        py::call_guard<py::gil_scoped_release>());
  m.def("adamw_chunk", &adamw_chunk, "adamw_pass on one fp32 state chunk (see adamw_chunk)",
        py::call_guard<py::gil_scoped_release>());
  m.def("adamw_chunks", &adamw_chunks, "adamw_chunk on each chunk of a list, and norms beside (see adamw_chunks)",
        py::call_guard<py::gil_scoped_release>());
  m.def("grad_norms", &grad_norms, "Each gradient's L2 norm in torch's order (see grad_norms)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_elements", &block_elements, "Elements per block");
  m.def("grain_blocks", &grain_blocks, "Blocks a thread takes at a time (a chunk of fewer is one thread's)");
}
