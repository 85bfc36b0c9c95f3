// headcat's fused CPU attention: the output and every per-head statistic headcat stores, with no T x T map in memory.
// See ingest/fused/__init__.py for the contract; this file is compiled there (_build) and called through ctypes
// (headcat_attend, at the end).
//
// For each map (sample b, query head h; key/value head h / (H / Hkv)) and each block of query rows, a tile of keys at
// a time (FlashAttention's loop: the tile's scores, exps and product with V while they are in cache):
//   S = Q_blk K_tile^T                        (BLAS; s = scale S, scaled in the softmax's passes)
//   s = tanh(s / cap) * cap                   (soft-capping, when asked)
//   s = mask ? s : s + lowest                 (as the eager mask adds finfo.min; where the allowed keys are one run,
//                                             only the run is computed: the rest is exactly 0)
//   m = max(m, max s), e = exp(s - m)         (m: the row's largest score so far; its output so far rescaled to it)
//   O_blk += E V_tile                          (BLAS)
//   A_row += sums of the tile's e             (the row's accumulators, rescaled to m with its output: see below;
//                                             where the block's keys fit one tile, a row's exps are final: its
//                                             probabilities go straight into the map's offsets, D[T - 1 + t - s])
// and once a block's tiles are done, each row's l = its sum of exps (each tile's relative to its own top, rescaled to
// the row's largest score M), H = log l - sum e (s - M) / l, O = O / l, and its accumulators / l added into the map's:
//   statistics of the real rows (query s < L), over its real keys t < L: the sums over each window of distances
//   (d = |t - s|, window min(d N / L, N - 1)), itself, the previous and the next key, and sum p d (the features'
//   offset columns, ingest.kernels.offset_columns); the special keys' part of the windows and self, their groups and
//   [SEP] rows' mass on [SEP] keys; the entropy; the example's column bins, into every row bin holding the row;
//   the offsets folded into the windows at the map's end
//   pattern cells (SPEC 10's detectors): C[kind] += p[key] for each (key, kind) listed for query s (one list
//   for every sample: the detection sequences share one repetition pattern); key -1 is the row's whole mass
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <atomic>
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

// Column-major C (m x n) = alpha op(A) op(B) + beta C.
inline void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  sgemm_(&transa, &transb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
}

using Vec = at::vec::Vectorized<float>;

struct Stats {
  bool on = false;
  const int64_t* lengths = nullptr;    // (B,) real tokens
  const int64_t* positions = nullptr;  // (B, J): the used slots first, in key order
  const int64_t* counts = nullptr;     // (B,)
  const bool* slot_sep = nullptr;      // (B, J)
  const int64_t* groups = nullptr;     // (B, J): the slot's special group, or -1
  const bool* query_sep = nullptr;     // (B, T)
  int64_t slots = 0;
  int64_t windows = 0;                 // N
  int64_t group_count = 0;             // G
  double* sums = nullptr;              // (maps, N + 4): windows, self, previous, next, distance
  double* entropy = nullptr;           // (maps,)
  double* special = nullptr;           // (maps, N + 1): the special keys' part of the windows and self
  double* special_groups = nullptr;    // (maps, G)
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
// each row's exps in a column bin are summed a tile at a time into the row's accumulators, and its probabilities at
// the row's end into every row bin the row lies in; at the map's end each cell's sum is divided by its cell count.
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
  int64_t block_keys = 0;  // keys a tile holds (0: all)
  int64_t copy_kv = 0;  // copy each key/value head's rows into contiguous rows before its maps (see attend)
  Stats stats;
  Cells cells;
  Pooled pooled;
};

// A row's scores over one tile of keys, unscaled (q . k) -> exp(s - top) in place, s = scale q . k (soft-capped,
// masked) and top the larger of the tile's largest s and floor (the row's top so far); the tile's sum of exps and,
// with dot, of exp * (s - top) (its entropy's share) go to the Tile. Keys past n are not read.
struct Tile {
  float top = -std::numeric_limits<float>::infinity(), sum = 0.f, dot = 0.f;  // n == 0: no key, nothing added
};

// The largest of row[0..n) (NaN where one is NaN, as at::vec::maximum gives it). Four running maxima: one would wait
// on its own last result at every step (the instruction's latency), four keep the unit busy.
inline float row_max(const float* row, int64_t n) {
  constexpr int64_t V = Vec::size();
  const auto larger = [](Vec& a, Vec& b) { return at::vec::maximum(a, b); };
  if (n < 4 * V) return at::vec::reduce_all<float>(larger, row, n);
  Vec m0 = Vec::loadu(row), m1 = Vec::loadu(row + V), m2 = Vec::loadu(row + 2 * V), m3 = Vec::loadu(row + 3 * V);
  int64_t t = 4 * V;
  for (; t + 4 * V <= n; t += 4 * V) {
    m0 = at::vec::maximum(m0, Vec::loadu(row + t));
    m1 = at::vec::maximum(m1, Vec::loadu(row + t + V));
    m2 = at::vec::maximum(m2, Vec::loadu(row + t + 2 * V));
    m3 = at::vec::maximum(m3, Vec::loadu(row + t + 3 * V));
  }
  for (; t + V <= n; t += V) m0 = at::vec::maximum(m0, Vec::loadu(row + t));
  m0 = at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3));
  if (t < n) m0 = at::vec::maximum(m0, Vec::loadu(row + n - V));  // the last V again: a maximum takes a value twice
  return at::vec::vec_reduce_all<float>(larger, m0);
}

// The sum of a vector's lanes.
inline float lanes_sum(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

inline Tile softmax_tile(float* row, int64_t n, const bool* mask, float cap, float scale, bool with_dot, float floor) {
  const float lowest = std::numeric_limits<float>::lowest();
  if (n <= 0) return Tile{};
  float step = scale;  // scaled on the way: max(scale x) = scale max(x) where scale > 0
  if (cap > 0 || mask != nullptr || !(scale > 0)) {  // else scaled first, as eager scales before it caps and masks
    for (int64_t t = 0; t < n; ++t) {
      float x = row[t] * scale;
      if (cap > 0) x = std::tanh(x / cap) * cap;
      row[t] = mask == nullptr || mask[t] ? x : x + lowest;
    }
    step = 1.f;
  }
  const float largest = row_max(row, n);
  const float top = std::max(largest * step, floor);  // scale > 0: the largest scaled score, exactly
  const Vec vtop(top), vstep(step);
  Vec vsum(0.f), vdot(0.f);
  int64_t t = 0;
  if (with_dot) {
    for (; t + Vec::size() <= n; t += Vec::size()) {
      Vec shifted = at::vec::fmsub(Vec::loadu(row + t), vstep, vtop);
      Vec e = shifted.exp_u20();
      vsum = vsum + e;
      vdot = at::vec::fmadd(e, shifted, vdot);
      e.store(row + t);
    }
  } else {
    for (; t + Vec::size() <= n; t += Vec::size()) {
      Vec e = at::vec::fmsub(Vec::loadu(row + t), vstep, vtop).exp_u20();
      vsum = vsum + e;
      e.store(row + t);
    }
  }
  float sum = lanes_sum(vsum);
  float dot = lanes_sum(vdot);
  for (; t < n; ++t) {
    float shifted = row[t] * step - top;
    float e = std::exp(shifted);
    sum += e;
    dot += e * shifted;
    row[t] = e;
  }
  return Tile{top, sum, with_dot ? dot : 0.f};
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

// The sums of e[0..n) and of e[i] (start + i step) into sum and dot, in a vector's lanes: a window's exps and their
// distances (start and step whole numbers, exact in float). Two running pairs (as row_max, for the adds' latency).
inline void sum_and_ramp(const float* e, int64_t n, float start, float step, Vec& sum, Vec& dot) {
  constexpr int64_t V = Vec::size();
  Vec ramp = Vec::arange(start, step), more_ramp = ramp + Vec(step * V), more_sum(0.f), more_dot(0.f);
  const Vec stride(2 * step * V);
  int64_t i = 0;
  for (; i + 2 * V <= n; i += 2 * V) {
    const Vec x = Vec::loadu(e + i), y = Vec::loadu(e + i + V);
    sum = sum + x;
    more_sum = more_sum + y;
    dot = at::vec::fmadd(x, ramp, dot);
    more_dot = at::vec::fmadd(y, more_ramp, more_dot);
    ramp = ramp + stride;
    more_ramp = more_ramp + stride;
  }
  sum = sum + more_sum;
  dot = dot + more_dot;
  for (; i < n; i += V) {  // the rest a vector at a time, the last one's missing lanes 0
    const Vec x = i + V <= n ? Vec::loadu(e + i) : Vec::loadu(e + i, n - i);
    sum = sum + x;
    dot = at::vec::fmadd(x, ramp, dot);
    ramp = ramp + Vec(step * V);
  }
}

// target += row * scale (a row's probabilities, its exps divided by their sum).
inline void add_into(float* target, const float* row, int64_t n, float scale) {
  const Vec factor(scale);
  at::vec::map2([factor](Vec a, Vec b) { return at::vec::fmadd(b, factor, a); }, target, target, row, n);
}

// A row's special keys in one tile from which their exps are gathered and summed by vectors (below: one at a time).
constexpr int64_t kGatherFrom = 16;

// sum a[i] b[i] over i < n.
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t V = Vec::size();
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + V <= n; i += V) sum = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), sum);
  if (i < n) sum = at::vec::fmadd(Vec::loadu(a + i, n - i), Vec::loadu(b + i, n - i), sum);
  return lanes_sum(sum);
}

// The sum of row[0..n) in a vector's lanes, four running sums added at the end (as row_max, for the adds' latency).
inline Vec sum_lanes(const float* row, int64_t n) {
  constexpr int64_t V = Vec::size();
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t t = 0;
  for (; t + 4 * V <= n; t += 4 * V) {
    s0 = s0 + Vec::loadu(row + t);
    s1 = s1 + Vec::loadu(row + t + V);
    s2 = s2 + Vec::loadu(row + t + 2 * V);
    s3 = s3 + Vec::loadu(row + t + 3 * V);
  }
  for (; t + V <= n; t += V) s0 = s0 + Vec::loadu(row + t);
  if (t < n) s0 = s0 + Vec::loadu(row + t, n - t);
  return (s0 + s1) + (s2 + s3);
}

// The n rows of a head (ld floats apart, d used) as contiguous rows.
void copy_rows(const float* from, int64_t ld, int64_t n, int64_t d, float* to) {
  for (int64_t t = 0; t < n; ++t) std::copy(from + t * ld, from + t * ld + d, to + t * d);
}

// A tile's rows of scores lie ld floats apart: its keys rounded up to a cache line, and an odd number of lines, so that
// its rows (512 or 1024 floats: 2 or 4 KiB apart unpadded) do not all fall into the same few sets of the caches.
constexpr int64_t kRowPad = 32;  // ld <= keys + kRowPad (the caller's buffer allows for it)

inline int64_t row_stride(int64_t keys) {
  const int64_t lines = (keys + 15) / 16;
  return 16 * (lines % 2 == 0 ? lines + 1 : lines);
}

// Maps start:stop of the call (map m: sample m / H, query head m % H); scores: a tile's, R x (K + kRowPad) floats (R:
// block_rows, at most Tq, at least 1; K: block_keys, at most Tk, at least 1); then with copy_kv 2 x Tk x D floats more
// for a key/value head's rows.
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
  // The example's sums: each (row bin, column bin) cell's probabilities, divided by its cell count once a map.
  std::vector<double> bin_sums(pooled.side_rows * pooled.side_columns);
  std::vector<int64_t> first_row_bin(pooled.rows);  // the first row bin holding row s (bins only move forward)
  for (int64_t s = 0, i = 0; s < pooled.rows; ++s) {
    while (pooled.row_bins[2 * i + 1] <= s) ++i;
    first_row_bin[s] = i;
  }
  const int64_t rows_per_block = std::max<int64_t>(1, std::min<int64_t>(tq, c.block_rows));
  // Keys are taken a tile at a time: its scores, exps, product with V and sums into each row's accumulators while the
  // tile is in cache; the tile's rows lie one after another in a buffer of their own.
  const int64_t tile_keys = std::max<int64_t>(1, std::min<int64_t>(tk, c.block_keys > 0 ? c.block_keys : tk));
  // With copy_kv, a key/value head's rows (strided in the model's (B, T, H, D) layout) are copied into contiguous
  // rows once a range of maps reaches the head: every block of query rows of every query head of its group reads them
  // again, and read strided they cost more (measured in docs/performance.md; the caller decides when a copy pays).
  float* const k_rows = c.copy_kv ? scores + rows_per_block * (tile_keys + kRowPad) : nullptr;
  float* const v_rows = c.copy_kv ? k_rows + tk * dim : nullptr;
  int64_t held = -1;  // the (sample, key/value head) whose rows k_rows and v_rows hold
  const int64_t max_tiles = (tk + tile_keys - 1) / tile_keys;
  std::vector<Tile> tiles_of(rows_per_block * max_tiles);
  std::vector<float> running(rows_per_block);  // each row's largest score so far: its output's scale
  std::vector<float> factors(max_tiles);  // a row's tiles' exps to its own: exp(the tile's top - the row's top)
  std::vector<Window> windows(rows_per_block);
  // Each block row's accumulators, its exps' sums relative to its largest score so far (rescaled with its output):
  // over its windows (N), itself, its previous and next key and sum e d (the offsets' columns, from 0); the special
  // keys' part of the windows and self (at_special), their groups (at_groups) and on a [SEP] row its [SEP] keys
  // (at_sep); the example's column bins (at_example).
  const int64_t n_windows = st.on ? st.windows : 0, at_special = n_windows + 4, at_groups = at_special + n_windows + 1,
                at_sep = at_groups + (st.on ? st.group_count : 0), at_example = at_sep + 1,
                width = at_example + (pooled.on ? pooled.side_columns : 0);
  std::vector<double> accumulators(rows_per_block * width);
  // The sample's windows: window g holds distances bounds[g] .. bounds[g + 1] - 1 (d N / L >= g: d >= ceil(g L / N));
  // window_of[d] for a special key's distance d < L (N: itself).
  std::vector<int64_t> bounds(n_windows + 1);
  std::vector<int32_t> window_of;
  int64_t bounds_length = -1;  // the length bounds and window_of are for
  // The sample's slots (in key order) as weights: a row of one-hots for each group, then its [SEP] slots'; and a
  // tile's special keys' exps for one row, gathered where a tile holds many of them (then summed by window runs and
  // weighted by group: no add per key into memory, which waits on the one before it).
  const int64_t slots = st.on ? st.slots : 0, group_count = st.on ? st.group_count : 0;
  std::vector<float> slot_weights((group_count + 1) * slots);
  std::vector<float> special_exps(slots);
  int64_t weights_for = -1;  // the sample slot_weights are for
  // Where a block's keys fit one tile, a row's exps are final once its tile is done: its probabilities are added
  // straight into the map's per-offset sums (D[T - 1 + t - s] += p), folded into its windows at the map's end (a
  // short row's windows hold a few keys each: a sum of each would cost more than the row's one shifted add).
  std::vector<float> offsets(st.on ? 2 * tk - 1 : 0);
  std::vector<float> special_offsets(slots > 0 ? 2 * tk - 1 : 0);  // the special keys' part of the offsets
  std::vector<double> columns(slots);  // each slot's (in key order) probabilities, summed over those rows
  // Each block row's pattern cells' exps, taken from their keys' tiles (relative to the tile's top), row r's entry i at
  // r * most_cells + i.
  int64_t most_cells = 0;
  for (int64_t s = 0; cells.on && s < tq; ++s) most_cells = std::max(most_cells, cells.rows[s + 1] - cells.rows[s]);
  std::vector<float> cell_exps(rows_per_block * most_cells);
  const float cap = static_cast<float>(softcap), fscale = static_cast<float>(scale);
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
    const int64_t* keys_of = nullptr;  // the sample's used slots' keys, ascending
    double *sums = nullptr, *special = nullptr, *special_groups = nullptr;
    double total = 0, sep = 0;
    if (st.on) {
      real = st.lengths[b];
      used = st.counts[b];
      keys_of = st.positions + b * st.slots;
      sums = st.sums + m * (n_windows + 4);
      special = st.special + m * (n_windows + 1);
      special_groups = st.special_groups + m * st.group_count;
      std::fill(sums, sums + n_windows + 4, 0.0);
      std::fill(special, special + n_windows + 1, 0.0);
      std::fill(special_groups, special_groups + st.group_count, 0.0);
      std::fill(offsets.begin(), offsets.end(), 0.f);
      if (used > 0) {
        std::fill(special_offsets.begin(), special_offsets.end(), 0.f);
        std::fill(columns.begin(), columns.end(), 0.0);
      }
      if (b != weights_for) {
        for (int64_t j = 0; j < used; ++j) {
          for (int64_t g = 0; g < group_count; ++g) slot_weights[g * slots + j] = st.groups[b * slots + j] == g;
          slot_weights[group_count * slots + j] = st.slot_sep[b * slots + j];
        }
        weights_for = b;
      }
      if (real != bounds_length) {
        for (int64_t g = 0; g <= n_windows; ++g) bounds[g] = (g * real + n_windows - 1) / n_windows;
        window_of.resize(real);
        for (int64_t d = 0; d < real; ++d)
          window_of[d] = static_cast<int32_t>(d == 0 ? n_windows : std::min(d * n_windows / real, n_windows - 1));
        bounds_length = real;
      }
    }
    double* mass = cells.on ? cells.masses + m * cells.count : nullptr;
    if (cells.on) std::fill(mass, mass + cells.count, 0.0);
    const bool example_map = pooled.on && b == pooled.sample;
    if (example_map) std::fill(bin_sums.begin(), bin_sums.end(), 0.0);
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
      for (int64_t r = 0; r < rows; ++r) {  // the keys each row's softmax reads: its run, or all (masked) keys < n
        const int64_t n = causal ? std::min(keys, first + r + 1) : keys;
        if (!has_mask) windows[r] = Window{0, n, true};
        else if (!windows[r].whole) windows[r] = Window{0, n, false};
        running[r] = -std::numeric_limits<float>::infinity();
      }
      const int64_t tiles = (keys + tile_keys - 1) / tile_keys, ld = row_stride(std::min(tile_keys, keys));
      const bool single = tiles == 1;  // each row's exps final after its tile (see offsets)
      if (!single || example_map) std::fill(accumulators.begin(), accumulators.begin() + rows * width, 0.0);
      int64_t first_bin = 0;  // the tile's first column bin of the example (bins only move forward)
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t k0 = tile * tile_keys, width_k = std::min(tile_keys, keys - k0), k1 = k0 + width_k;
        // S_tile (rows x width_k, ld) = Q_blk K_tile^T (scaled in softmax_tile): S^T = K Q^T.
        gemm('T', 'N', width_k, rows, dim, 1.f, km + k0 * k_ld, k_ld, qm + first * c.q_strides[2], c.q_strides[2],
             0.f, scores, ld);
        // The tile's special slots (in key order), and its example column bins.
        const int64_t slot_lo = st.on ? std::lower_bound(keys_of, keys_of + used, k0) - keys_of : 0;
        const int64_t slot_hi = st.on ? std::lower_bound(keys_of + slot_lo, keys_of + used, k1) - keys_of : 0;
        if (example_map) {
          while (first_bin < pooled.side_columns && pooled.column_bins[2 * first_bin + 1] <= k0) ++first_bin;
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t s = first + r, n = causal ? std::min(keys, s + 1) : keys;
          float* part = scores + r * ld;
          const Window& window = windows[r];
          const int64_t lo = std::clamp(window.lo - k0, int64_t{0}, width_k);
          const int64_t hi = std::clamp(window.hi - k0, lo, width_k);
          const bool* mask_row = window.whole ? nullptr : mm + s * mask_row_stride + k0;
          const Tile t = softmax_tile(part + lo, hi - lo, mask_row, cap, fscale, st.on, running[r]);
          tiles_of[r * max_tiles + tile] = t;
          std::fill(part, part + lo, 0.f);  // keys outside the row's run are exactly 0
          std::fill(part + hi, part + width_k, 0.f);
          if (cells.on) {  // the row's cells on this tile's keys
            const int64_t from = cells.rows[s];
            for (int64_t e = from; e < cells.rows[s + 1]; ++e) {
              const int64_t key = cells.keys[e] - k0;
              if (key >= 0 && key < width_k) cell_exps[r * most_cells + e - from] = part[key];
            }
          }
          if (t.sum == 0.f) continue;  // no key of this row in the tile
          double* a = accumulators.data() + r * width;
          if (t.top > running[r] && running[r] > -std::numeric_limits<float>::infinity()) {
            // its output and accumulators so far, to the row's new top
            const float rescale = std::exp(running[r] - t.top);
            float* o = om + s * c.out_strides[1];
            const Vec factor(rescale);
            at::vec::map([factor](Vec x) { return x * factor; }, o, o, dim);
            for (int64_t i = 0; i < width; ++i) a[i] *= rescale;
          }
          running[r] = t.top;
          if (st.on && s < real) {
            // The real keys of this tile (t < L, and t < n: a causal row's later keys are 0), by window and side.
            const int64_t from = k0, to = std::min(k1, std::min(real, n));
            if (single && to > from) {  // its probabilities, where they lie in the map's offsets
              add_into(offsets.data() + (tk - 1 - s) + from, part + (from - k0), to - from, 1.f / t.sum);
            } else if (to > from) {
              Vec dot(0.f);
              const auto add = [&](int64_t lo_key, int64_t hi_key, int64_t index, bool left) {
                lo_key = std::max(lo_key, from), hi_key = std::min(hi_key, to);
                if (hi_key <= lo_key) return;
                Vec sum(0.f);
                sum_and_ramp(part + (lo_key - k0), hi_key - lo_key, static_cast<float>(left ? s - lo_key : lo_key - s),
                             left ? -1.f : 1.f, sum, dot);
                a[index] += lanes_sum(sum);
              };
              // window g holds distances near .. far - 1 on either side; only the windows of this tile's distances
              const auto near = [&](int64_t g) { return std::max<int64_t>(bounds[g], 1); };
              const int64_t left = std::min(to, s), right = std::max(from, s + 1);  // keys from..left-1, right..to-1
              if (from < left) {
                for (int64_t g = window_of[s - left + 1]; g <= window_of[s - from]; ++g)
                  add(s - bounds[g + 1] + 1, s - near(g) + 1, g, true);
              }
              if (right < to) {
                for (int64_t g = window_of[right - s]; g <= window_of[to - 1 - s]; ++g)
                  add(s + near(g), s + bounds[g + 1], g, false);
              }
              a[n_windows + 3] += lanes_sum(dot);
              if (from <= s && s < to) a[n_windows] += part[s - k0];
              if (from <= s - 1 && s - 1 < to) a[n_windows + 1] += part[s - 1 - k0];
              if (from <= s + 1 && s + 1 < to) a[n_windows + 2] += part[s + 1 - k0];
            }
            // The special keys (real) of this tile before n. A few: added one at a time. More: their exps gathered,
            // summed by runs in one window (the slots are in key order, a window's keys one run on either side),
            // weighted by group and [SEP] (one add at a time into memory waits on the one before it).
            const int64_t count = std::lower_bound(keys_of + slot_lo, keys_of + slot_hi, n) - keys_of - slot_lo;
            const int64_t* keys_here = keys_of + slot_lo;
            const bool sep_row = count > 0 && st.query_sep[b * tq + s];
            if (single) {  // their probabilities, into the special offsets and their slots' columns
              const float inverse = 1.f / t.sum;
              for (int64_t i = 0; i < count; ++i) {
                const int64_t key = keys_here[i], slot = b * slots + slot_lo + i;
                const float value = part[key - k0] * inverse;
                columns[slot_lo + i] += value;
                special_offsets[tk - 1 + key - s] += value;
                if (sep_row && st.slot_sep[slot]) sep += value;
              }
            } else if (count < kGatherFrom) {
              for (int64_t i = 0; i < count; ++i) {
                const int64_t key = keys_here[i], slot = b * slots + slot_lo + i;
                const double e = part[key - k0];
                a[at_special + window_of[key > s ? key - s : s - key]] += e;
                if (st.groups[slot] >= 0) a[at_groups + st.groups[slot]] += e;
                if (sep_row && st.slot_sep[slot]) a[at_sep] += e;
              }
            } else {
              float* e = special_exps.data();
              for (int64_t i = 0; i < count; ++i) e[i] = part[keys_here[i] - k0];
              for (int64_t i = 0, j = 0; i < count; i = j) {
                const int64_t key = keys_here[i], w = window_of[key > s ? key - s : s - key];
                const int64_t end = key < s    ? s - std::max<int64_t>(bounds[w], 1) + 1  // w's keys left of s end
                                    : key == s ? s + 1
                                               : s + bounds[w + 1];
                j = std::lower_bound(keys_here + i, keys_here + count, end) - keys_here;
                a[at_special + w] += lanes_sum(sum_lanes(e + i, j - i));
              }
              const float* weights = slot_weights.data() + slot_lo;
              for (int64_t g = 0; g < group_count; ++g) a[at_groups + g] += dot(e, weights + g * slots, count);
              if (sep_row) a[at_sep] += dot(e, weights + group_count * slots, count);
            }
          }
          if (example_map && s < pooled.rows) {  // the example's column bins on this tile's keys (past n: 0)
            const int64_t end = std::min(k1, n);
            for (int64_t j = first_bin; j < pooled.side_columns && pooled.column_bins[2 * j] < end; ++j) {
              const int64_t from = std::max(pooled.column_bins[2 * j], k0);
              const int64_t to = std::min(pooled.column_bins[2 * j + 1], end);
              if (to > from) a[at_example + j] += lanes_sum(sum_lanes(part + (from - k0), to - from));
            }
          }
        }
        // O_blk (rows x D, ld c.out_strides[1]) += E_tile V_tile, the exps relative to each row's top so far
        // (FlashAttention's online rescaling): column-major O^T = V^T E^T.
        gemm('N', 'N', dim, rows, width_k, 1.f, vm + k0 * v_ld, v_ld, scores, ld, tile == 0 ? 0.f : 1.f,
             om + first * c.out_strides[1], c.out_strides[1]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = first + r;
        const int64_t n = causal ? std::min(keys, s + 1) : keys;
        // The row's sum of exps relative to its largest score, and its entropy H = log l - sum e (s - top) / l, from
        // its tiles' (each tile's exps relative to its own top: factors[tile] = exp(tile's top - row's top)).
        const float top = running[r];
        double total_exps = 0, dot = 0;
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const Tile& t = tiles_of[r * max_tiles + tile];
          factors[tile] = t.sum == 0.f ? 0.f : t.top == top ? 1.f : std::exp(t.top - top);
          const double shift = static_cast<double>(t.top) - top, factor = factors[tile];
          if (t.sum == 0.f) continue;
          total_exps += factor * t.sum;
          dot += factor * (t.dot + shift * t.sum);
        }
        const float sum = static_cast<float>(total_exps);
        const double h_row = std::log(total_exps) - dot / total_exps;
        const float inverse = 1.f / sum;
        float* o = om + s * c.out_strides[1];
        at::vec::map([inverse](Vec x) { return x * Vec(inverse); }, o, o, dim);
        const double* a = accumulators.data() + r * width;  // relative to the row's top
        const double to_probability = inverse;
        if (st.on && s < real) {
          total += h_row;
          if (!single) {  // (a single tile's rows added theirs into the offsets)
            for (int64_t i = 0; i < n_windows + 4; ++i) sums[i] += a[i] * to_probability;
          }
          if (!single && used > 0) {
            for (int64_t i = 0; i <= n_windows; ++i) special[i] += a[at_special + i] * to_probability;
            for (int64_t i = 0; i < group_count; ++i) special_groups[i] += a[at_groups + i] * to_probability;
            sep += a[at_sep] * to_probability;
          }
        }
        if (example_map && s < pooled.rows) {  // into every row bin holding s
          for (int64_t i = first_row_bin[s]; i < pooled.side_rows && pooled.row_bins[2 * i] <= s; ++i) {
            double* cell = bin_sums.data() + i * pooled.side_columns;
            for (int64_t j = 0; j < pooled.side_columns; ++j) cell[j] += a[at_example + j] * to_probability;
          }
        }
        if (cells.on) {
          const float* exps = cell_exps.data() + r * most_cells;  // the row's cells' exps, entry by entry
          for (int64_t e = cells.rows[s], i = 0; e < cells.rows[s + 1]; ++e, ++i) {
            const int64_t key = cells.keys[e];
            if (key >= n) continue;  // a causal map's later key (or one past the block's keys): 0
            // -1: the row's whole mass; a key: its exp (to its tile's top) to the row's top
            const float value = key < 0 ? sum * inverse : exps[i] * factors[key / tile_keys] * inverse;
            mass[cells.kinds[e]] += static_cast<double>(value);
          }
        }
      }
    }
    if (example_map) {  // a cell's mean: its sum over its rows and columns, divided by their numbers
      for (int64_t i = 0; i < pooled.side_rows; ++i) {
        const double rows_in = static_cast<double>(pooled.row_bins[2 * i + 1] - pooled.row_bins[2 * i]);
        for (int64_t j = 0; j < pooled.side_columns; ++j) {
          const double columns_in = static_cast<double>(pooled.column_bins[2 * j + 1] - pooled.column_bins[2 * j]);
          pooled.maps[(h * pooled.side_rows + i) * pooled.side_columns + j] +=
              bin_sums[i * pooled.side_columns + j] / rows_in / columns_in;
        }
      }
    }
    if (st.on) {
      st.entropy[m] = total;
      st.seps[m] = sep;
      // the single-tile rows' offsets and special offsets, by window (offset_columns), and their columns by group
      Vec dot(0.f);
      for (int64_t g = 0; g < n_windows && real > 0; ++g) {  // offsets -(far - 1) .. -near and near .. far - 1
        const int64_t near = std::max<int64_t>(bounds[g], 1), far = bounds[g + 1];
        if (far <= near) continue;
        Vec sum(0.f);
        sum_and_ramp(offsets.data() + tk - far, far - near, static_cast<float>(far - 1), -1.f, sum, dot);
        sum_and_ramp(offsets.data() + tk - 1 + near, far - near, static_cast<float>(near), 1.f, sum, dot);
        sums[g] += lanes_sum(sum);
        if (used > 0) {
          special[g] += lanes_sum(sum_lanes(special_offsets.data() + tk - far, far - near) +
                                  sum_lanes(special_offsets.data() + tk - 1 + near, far - near));
        }
      }
      sums[n_windows + 3] += lanes_sum(dot);
      if (real > 0) {
        sums[n_windows] += offsets[tk - 1];
        if (used > 0) special[n_windows] += special_offsets[tk - 1];
      }
      if (real > 1) {
        sums[n_windows + 1] += offsets[tk - 2];
        sums[n_windows + 2] += offsets[tk];
      }
      for (int64_t j = 0; j < used; ++j) {
        if (st.groups[b * slots + j] >= 0) special_groups[st.groups[b * slots + j]] += columns[j];
      }
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

// Maps 0..maps - 1 on `workers` of torch's own threads (its OpenMP team: threads of another pool ran beside it while
// its threads spun waiting for work), each taking `step` maps at a time as it frees up (a slowed thread holds up no
// one), into its own `floats` of scores.
extern "C" int headcat_attend_threads(const Call* call, float* scores, int64_t floats, int64_t maps, int64_t step,
                                      int64_t workers) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    for (int64_t w = first; w < last; ++w) {
      for (int64_t start = next.fetch_add(step); start < maps && !failed; start = next.fetch_add(step)) {
        try {
          attend(*call, scores + w * floats, start, std::min(start + step, maps));
        } catch (const std::bad_alloc&) {
          failed = true;
        }
      }
    }
  });
  return failed ? 1 : 0;
}

// Whether headcat_attend_threads runs on torch's threads: built with OpenMP (as torch's own parallel_for is), else it
// would run its workers one after another, and the caller runs headcat_attend on threads of its own instead.
extern "C" int headcat_parallel() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// The caller checks its copy of Call's layout, and the padding it allows a tile's rows of scores, against these.
extern "C" int64_t headcat_call_size() { return sizeof(Call); }
extern "C" int64_t headcat_row_pad() { return kRowPad; }
