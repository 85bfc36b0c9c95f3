// headcat's fused CPU attention: the output and every per-head statistic headcat stores, with no
// T x T map in memory. See ingest/fused/__init__.py for the contract; this file is compiled there (_build) and
// called through ctypes (headcat_attend, at the end).
//
// For each map (sample b, query head h; key/value head h / (H / Hkv)) and each block of query rows:
//   S = scale * Q_blk K^T                     (BLAS, a block of rows x keys that stays in cache)
//   s = tanh(s / cap) * cap                   (soft-capping, when asked)
//   s = mask ? s : s + lowest                 (as the eager mask adds finfo.min; where the allowed keys are one run,
//                                             only the run is computed: the rest is exactly 0)
//   e = exp(s - max), l = sum e               (each row whole: no online rescaling is needed)
//   H = log l - sum e (s - max) / l, and p = e / l is taken where it is read
//   statistics of the real rows (query s < L): D[T - 1 - s + t] += p[t] (t < L); the special keys'
//   cells; [SEP] rows' mass on [SEP] keys; entropy
//   pattern cells (SPEC 10's detectors): C[kind] += p[key] for each (key, kind) listed for query s (one list
//   for every sample: the detection sequences share one repetition pattern); key -1 is the row's whole mass
//   O_blk = (E V) / l                          (BLAS, then each row divided by its sum)
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <vector>

// The BLAS torch links (MKL on x86 wheels exports the Fortran symbol); MKL's per-thread thread count where present.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
extern "C" int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));

namespace {

// Column-major C (m x n) = alpha op(A) op(B).
inline void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float* c, int64_t ldc) {
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  const float beta = 0.f;
  sgemm_(&transa, &transb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
}

using Vec = at::vec::Vectorized<float>;

struct Stats {
  bool on = false;
  const int64_t* lengths = nullptr;    // (B,) real tokens
  const int64_t* positions = nullptr;  // (B, J)
  const int64_t* counts = nullptr;     // (B,)
  const bool* slot_sep = nullptr;      // (B, J)
  const bool* query_sep = nullptr;     // (B, T)
  int64_t slots = 0;
  float* offsets = nullptr;            // (maps, 2T - 1)
  double* entropy = nullptr;           // (maps,)
  float* special_offsets = nullptr;    // (maps, 2T - 1)
  double* columns = nullptr;           // (maps, J)
  double* seps = nullptr;              // (maps,)
};

// Sparse pattern cells, the same for every sample: query s reads entries rows[s] .. rows[s + 1] - 1.
struct Cells {
  bool on = false;
  const int64_t* rows = nullptr;   // (Tq + 1,) CSR pointers
  const int64_t* keys = nullptr;   // (n,) key column, or -1: the row's whole mass
  const int64_t* kinds = nullptr;  // (n,) which accumulator
  int64_t count = 0;               // accumulators per map
  double* masses = nullptr;        // (maps, count)
};

// One sample's maps average-pooled (adaptive_avg_pool2d's bins over its first rows x columns), the catalog's example:
// each row's probabilities in a column bin are summed in a vector's lanes into every row bin the row lies in (float32,
// as the eager map's mean sums them); at the map's end each cell's lanes are summed and divided by its cell count.
struct Pooled {
  bool on = false;
  int64_t sample = -1, rows = 0, side_rows = 0, side_columns = 0;
  const int64_t* row_bins = nullptr;     // (side_rows, 2): start, stop
  const int64_t* column_bins = nullptr;  // (side_columns, 2)
  double* maps = nullptr;                // (heads, side_rows, side_columns)
};

// One call, as ingest/fused/__init__.py's _Call lays it out (ctypes; the same fields in the same order): q (B, H, Tq, D),
// k and v (B, Hkv, Tk, D) into out (B, Tq, H, D); float32, last dim contiguous, strides in elements. mask:
// (B or 1, 1, Tq, Tk) bool (true: attend) or null: then causal says whether key t > query s is skipped. Statistics
// (Tq == Tk), pattern cells and the example where each is on.
struct Call {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  int64_t heads = 0, tq = 0, dim = 0, kv_heads = 0, tk = 0;
  int64_t q_strides[3] = {}, k_strides[3] = {}, v_strides[3] = {}, out_strides[3] = {};
  const bool* mask = nullptr;
  int64_t mask_batch_stride = 0, mask_row_stride = 0;
  int64_t causal = 0;
  double scale = 1, softcap = 0;
  int64_t block_rows = 0;
  int64_t copy_kv = 0;  // copy each key/value head's rows into contiguous rows before its maps (see attend)
  Stats stats;
  Cells cells;
  Pooled pooled;
};

// One row of scores -> exp(s - max) in place (not yet divided by their sum, which goes to *total); returns the
// row's entropy. Keys past n are not read.
inline double softmax_row(float* row, int64_t n, const bool* mask, float cap, float* total) {
  const float lowest = std::numeric_limits<float>::lowest();
  if (cap > 0) {
    for (int64_t t = 0; t < n; ++t) row[t] = std::tanh(row[t] / cap) * cap;
  }
  if (mask != nullptr) {
    for (int64_t t = 0; t < n; ++t) row[t] = mask[t] ? row[t] : row[t] + lowest;
  }
  float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n);
  const Vec vtop(top);
  Vec vsum(0.f), vdot(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    Vec shifted = Vec::loadu(row + t) - vtop;
    Vec e = shifted.exp_u20();
    vsum = vsum + e;
    vdot = at::vec::fmadd(e, shifted, vdot);
    e.store(row + t);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  float dot = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vdot);
  for (; t < n; ++t) {
    float shifted = row[t] - top;
    float e = std::exp(shifted);
    sum += e;
    dot += e * shifted;
    row[t] = e;
  }
  *total = sum;
  return std::log(static_cast<double>(sum)) - static_cast<double>(dot) / static_cast<double>(sum);
}

// Where a row's allowed keys are one run lo..hi - 1 (padding, causal, sliding windows), eager's softmax gives every
// other key exactly 0 (exp(s + lowest - max) underflows), so only the run is computed; whole is false otherwise.
struct Window {
  int64_t lo = 0, hi = 0;
  bool whole = true;
};

inline Window allowed_window(const bool* mask, int64_t n) {
  Window window{0, n, true};
  if (mask == nullptr) return window;
  window.lo = std::find(mask, mask + n, true) - mask;
  if (window.lo == n) return Window{0, n, false};  // nothing allowed: eager's softmax over s + lowest, not 0
  window.hi = std::find(mask + window.lo, mask + n, false) - mask;
  if (std::find(mask + window.hi, mask + n, true) != mask + n) return Window{0, n, false};  // a gap
  return window;
}

// target += row * scale (the row's probabilities, its exps divided by their sum).
inline void add_into(float* target, const float* row, int64_t n, float scale) {
  const Vec factor(scale);
  at::vec::map2([factor](Vec a, Vec b) { return at::vec::fmadd(b, factor, a); }, target, target, row, n);
}

// add_into over row[0..n), returning the sum of row[0..n) in a vector's lanes (the tail in the first ones): one
// pass for the offsets and an example's column bin.
inline Vec add_and_sum(float* target, const float* row, int64_t n, float scale) {
  const Vec factor(scale);
  Vec lanes(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    const Vec x = Vec::loadu(row + t);
    lanes = lanes + x;
    at::vec::fmadd(x, factor, Vec::loadu(target + t)).store(target + t);
  }
  if (t < n) {
    const Vec x = Vec::loadu(row + t, n - t);  // the rest zero
    lanes = lanes + x;
    at::vec::fmadd(x, factor, Vec::loadu(target + t, n - t)).store(target + t, n - t);
  }
  return lanes;
}

// The sum of row[0..n) in a vector's lanes.
inline Vec sum_lanes(const float* row, int64_t n) {
  Vec lanes(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) lanes = lanes + Vec::loadu(row + t);
  if (t < n) lanes = lanes + Vec::loadu(row + t, n - t);
  return lanes;
}

// The n rows of a head (ld floats apart, d used) as contiguous rows.
void copy_rows(const float* from, int64_t ld, int64_t n, int64_t d, float* to) {
  for (int64_t t = 0; t < n; ++t) std::copy(from + t * ld, from + t * ld + d, to + t * d);
}

// Maps start:stop of the call (map m: sample m / H, query head m % H); scores: block_rows x Tk floats, then with
// copy_kv 2 x Tk x D floats more for a key/value head's rows.
void attend(const Call& c, float* const scores, int64_t start, int64_t stop) {
  const int64_t heads = c.heads, tq = c.tq, dim = c.dim, tk = c.tk;
  const int64_t group = heads / c.kv_heads;
  const float* qp = c.q;
  const float* kp = c.k;
  const float* vp = c.v;
  float* op = c.out;
  const bool has_mask = c.mask != nullptr;
  const bool* mp = c.mask;
  const int64_t mask_batch_stride = c.mask_batch_stride, mask_row_stride = c.mask_row_stride;
  const bool causal = c.causal != 0;
  const double scale = c.scale, softcap = c.softcap;
  const Stats& st = c.stats;
  const Cells& cells = c.cells;
  const Pooled& pooled = c.pooled;
  // The example's sums: each (row bin, column bin) cell's probabilities in a vector's lanes, summed once a map.
  std::vector<float> bin_lanes(pooled.side_rows * pooled.side_columns * Vec::size());
  std::vector<int64_t> first_row_bin(pooled.rows);  // the first row bin holding row s (bins only move forward)
  for (int64_t s = 0, i = 0; s < pooled.rows; ++s) {
    while (pooled.row_bins[2 * i + 1] <= s) ++i;
    first_row_bin[s] = i;
  }
  const int64_t width = 2 * tk - 1;
  const int64_t rows_per_block = std::max<int64_t>(1, std::min<int64_t>(tq, c.block_rows));
  // With copy_kv, a key/value head's rows (strided in the model's (B, T, H, D) layout) are copied into contiguous
  // rows once a range of maps reaches the head: every block of query rows of every query head of its group reads them
  // again, and read strided they cost more (measured in docs/performance.md; the caller decides when a copy pays).
  float* const k_rows = c.copy_kv ? scores + rows_per_block * tk : nullptr;
  float* const v_rows = c.copy_kv ? k_rows + tk * dim : nullptr;
  int64_t held = -1;  // the (sample, key/value head) whose rows k_rows and v_rows hold
  std::vector<float> inverses(rows_per_block);
  std::vector<Window> windows(rows_per_block);
  const float cap = static_cast<float>(softcap);
  // Callers run one thread per range of maps: MKL's own threads off here, the thread's setting put back at the end.
  const int previous = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0;

  for (int64_t m = start; m < stop; ++m) {
    const int64_t b = m / heads, h = m % heads, kvh = h / group;
    const float* qm = qp + b * c.q_strides[0] + h * c.q_strides[1];
    const float* km = kp + b * c.k_strides[0] + kvh * c.k_strides[1];
    const float* vm = vp + b * c.v_strides[0] + kvh * c.v_strides[1];
    int64_t k_ld = c.k_strides[2], v_ld = c.v_strides[2];
    if (c.copy_kv) {
      if (b * c.kv_heads + kvh != held) {
        copy_rows(km, k_ld, tk, dim, k_rows);
        copy_rows(vm, v_ld, tk, dim, v_rows);
        held = b * c.kv_heads + kvh;
      }
      km = k_rows, vm = v_rows, k_ld = v_ld = dim;
    }
    float* om = op + b * c.out_strides[0] + h * c.out_strides[2];
    const bool* mm = has_mask ? mp + b * mask_batch_stride : nullptr;
    int64_t real = 0, used = 0;
    float *target = nullptr, *special = nullptr;
    double* column = nullptr;
    double total = 0, sep = 0;
    if (st.on) {
      real = st.lengths[b];
      used = st.counts[b];
      target = st.offsets + m * width;
      special = st.special_offsets + m * width;
      column = st.columns + m * st.slots;
      std::fill(target, target + width, 0.f);
      std::fill(special, special + width, 0.f);
      std::fill(column, column + st.slots, 0.0);
    }
    double* mass = cells.on ? cells.masses + m * cells.count : nullptr;
    if (cells.on) std::fill(mass, mass + cells.count, 0.0);
    const bool example_map = pooled.on && b == pooled.sample;
    if (example_map) std::fill(bin_lanes.begin(), bin_lanes.end(), 0.f);
    for (int64_t first = 0; first < tq; first += rows_per_block) {
      const int64_t rows = std::min(rows_per_block, tq - first);
      int64_t keys = causal ? std::min(tk, first + rows) : tk;  // keys this block reads
      if (has_mask) {  // a masked block reads up to its rows' last allowed key (a causal or padding mask's end)
        keys = 0;
        for (int64_t r = 0; r < rows; ++r) {
          windows[r] = allowed_window(mm + (first + r) * mask_row_stride, tk);
          keys = std::max(keys, windows[r].whole ? windows[r].hi : tk);
        }
      }
      // S (rows x keys, row-major, ld keys) = scale Q_blk K^T: column-major S^T = K Q^T.
      gemm('T', 'N', keys, rows, dim, static_cast<float>(scale), km, k_ld, qm + first * c.q_strides[2],
           c.q_strides[2], scores, keys);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = first + r;
        float* row = scores + r * keys;
        const int64_t n = causal ? std::min(keys, s + 1) : keys;
        float sum = 1.f;
        const bool* mask_row = has_mask ? mm + s * mask_row_stride : nullptr;
        const Window window = has_mask ? windows[r] : Window{0, n, true};
        double h_row;
        if (window.whole) {  // no mask, or one whose allowed keys are one run lo..hi - 1: the rest is exactly 0
          h_row = softmax_row(row + window.lo, window.hi - window.lo, nullptr, cap, &sum);
          std::fill(row, row + window.lo, 0.f);
          std::fill(row + window.hi, row + n, 0.f);
        } else {  // any other mask (none allowed, or gaps): lowest added where masked, as eager does
          h_row = softmax_row(row, n, mask_row, cap, &sum);
        }
        const float inverse = 1.f / sum;
        inverses[r] = inverse;
        std::fill(row + n, row + keys, 0.f);
        const bool example_row = example_map && s < pooled.rows;
        // The offsets' keys 0..added - 1, taken with the example's column bins where this row is pooled too.
        const int64_t added = st.on && s < real ? std::min(real, n) : 0;
        if (example_row) {  // each column bin's lanes (no horizontal sum per row), into every row bin holding s
          int64_t covered = 0;  // keys already added into the offsets (adaptive bins leave no gap, may overlap by a key)
          for (int64_t j = 0; j < pooled.side_columns; ++j) {  // keys past n are 0 (causal)
            const int64_t lo = pooled.column_bins[2 * j], hi = std::min(pooled.column_bins[2 * j + 1], n);
            if (hi <= lo) continue;
            const int64_t from = std::clamp(covered, lo, hi), to = std::clamp(added, from, hi);
            Vec lanes = sum_lanes(row + lo, from - lo) + sum_lanes(row + to, hi - to);
            if (to > from) lanes = lanes + add_and_sum(target + (tk - 1 - s) + from, row + from, to - from, inverse);
            covered = std::max(covered, to);
            for (int64_t i = first_row_bin[s]; i < pooled.side_rows && pooled.row_bins[2 * i] <= s; ++i) {
              float* cell = bin_lanes.data() + (i * pooled.side_columns + j) * Vec::size();
              at::vec::fmadd(lanes, Vec(inverse), Vec::loadu(cell)).store(cell);
            }
          }
          if (covered < added) add_into(target + (tk - 1 - s) + covered, row + covered, added - covered, inverse);
        } else if (added > 0) {
          add_into(target + (tk - 1 - s), row, added, inverse);
        }
        if (st.on && s < real) {
          total += h_row;
          for (int64_t j = 0; j < used; ++j) {
            const int64_t key = st.positions[b * st.slots + j];
            if (key >= n) continue;  // a causal map's later key: 0
            const float value = row[key] * inverse;
            column[j] += value;
            special[tk - 1 + key - s] += value;
          }
          if (st.query_sep[b * tq + s]) {
            for (int64_t j = 0; j < used; ++j) {
              const int64_t key = st.positions[b * st.slots + j];
              if (st.slot_sep[b * st.slots + j] && key < n) sep += row[key] * inverse;
            }
          }
        }
        if (cells.on) {
          for (int64_t e = cells.rows[s]; e < cells.rows[s + 1]; ++e) {
            const int64_t key = cells.keys[e];
            if (key >= n) continue;  // a causal map's later key: 0
            const float value = key < 0 ? sum * inverse : row[key] * inverse;  // -1: the row's whole mass
            mass[cells.kinds[e]] += static_cast<double>(value);
          }
        }
      }
      // O_blk (rows x D, ld c.out_strides[1]) = P V: column-major O^T = V^T P^T.
      gemm('N', 'N', dim, rows, keys, 1.f, vm, v_ld, scores, keys, om + first * c.out_strides[1],
           c.out_strides[1]);
      for (int64_t r = 0; r < rows; ++r) {  // the exps' product with V, divided by their sum: P V
        float* o = om + (first + r) * c.out_strides[1];
        const float inverse = inverses[r];
        at::vec::map([inverse](Vec x) { return x * Vec(inverse); }, o, o, dim);
      }
    }
    if (example_map) {  // a cell's mean: its row bin's rows' column-bin means, averaged
      for (int64_t i = 0; i < pooled.side_rows; ++i) {
        const double rows_in = static_cast<double>(pooled.row_bins[2 * i + 1] - pooled.row_bins[2 * i]);
        for (int64_t j = 0; j < pooled.side_columns; ++j) {
          const float* cell = bin_lanes.data() + (i * pooled.side_columns + j) * Vec::size();
          const double columns_in = static_cast<double>(pooled.column_bins[2 * j + 1] - pooled.column_bins[2 * j]);
          const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, Vec::loadu(cell));
          pooled.maps[(h * pooled.side_rows + i) * pooled.side_columns + j] += sum / rows_in / columns_in;
        }
      }
    }
    if (st.on) {
      st.entropy[m] = total;
      st.seps[m] = sep;
    }
  }
  if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous);
}

}  // namespace

// The entry points, called through ctypes (which releases the GIL around them). scores: the block's scores, the
// caller's (from torch's allocator, so that its memory profiler counts them). Returns 0, or 1 where memory ran out
// (nothing is thrown across C).
extern "C" int headcat_attend(const Call* call, float* scores, int64_t start, int64_t stop) {
  try {
    attend(*call, scores, start, stop);
  } catch (const std::bad_alloc&) {
    return 1;
  }
  return 0;
}

// The caller checks its copy of Call's layout against this.
extern "C" int64_t headcat_call_size() { return sizeof(Call); }
