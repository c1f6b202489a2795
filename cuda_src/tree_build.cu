// DDTree best-first tree build (DESIGN.md section 4), bit-identical to the Python heapq reference
// in ddtree_rtc/reference/tree_build.py. One block of 128 threads per request.
//
// The heap holds at most one entry per tree node: the node's next unpopped child (rank 0 when the
// node is popped, rank r+1 after its child r is popped, which is exactly the reference's "sibling
// push"). So "slot i" = candidate child of node i, kept in shared memory (order key, score, rank,
// node i's last popped child) and owned by lane i % 32 of warp 0, which runs the pop loop (J slots
// per lane, J*32 >= max_budget + 1). Each lane caches its best slot; a pop is a warp argmax over
// the cached bests, the winner lane writes the node and updates its two slots (next sibling, new
// node's first child), then rescans its J slots.
//
// Order: larger score first (scores are float64, accumulated with the reference's exact operation
// order: child = score + lq[d][0], sibling = (score - lq[d-1][r]) + lq[d-1][r+1]; no multiply, so
// nothing can be contracted into an FMA); equal scores (+0 == -0) fall back to the rank tuples,
// lexicographic with a prefix first, compared as integer codes (10 bits per depth, 3 words).
//
// After the loop all 128 threads write the outputs, including every unused slot up to max_budget.
//
// The level variant (tree_build_level_j*) first tries a parallel build that is exact whenever the
// scores it meets are monotone (every generated child / next sibling scores <= its predecessor, as
// sorted log-probs <= 0 give up to rounding). It grows a pool of candidates depth by depth: at
// depth d every pool node of depth d-1 walks its child chain (first child, then siblings) in one
// thread while the score stays >= tau, tau = the budget-th best pool score so far (ties kept).
// Then the pool's first `budget` entries in (score desc, rank tuple asc) order are the heap's pops,
// in that order: the pool is prefix-closed, monotone, and every successor of a kept entry that is
// not kept scores below all kept ones (it was cut below a tau <= the final budget-th score, or it
// is in the pool and ranks later), so the heap, popping its minimum, pops exactly those in sorted
// order. A non-monotone step or a full pool sets a flag and the request falls back to the heap
// loop above, so the result is exact either way.

#ifndef TREE_PROFILE
#define TREE_PROFILE 0
#endif
#if TREE_PROFILE
// Diagnostics build only: SM clock at the phase boundaries of each block (0 start, 1 staged, 2 built,
// 3 written; 4 and 5 the heap loop's start and end when it runs).
__device__ long long tree_prof[8 * 1024];
#define TREE_STAMP(i) \
  if (threadIdx.x == 0 && blockIdx.x < 1024) tree_prof[8 * blockIdx.x + (i)] = clock64()
#else
#define TREE_STAMP(i)
#endif

namespace {

constexpr int THREADS = 128;
constexpr unsigned FULL = 0xffffffffu;
constexpr int MAX_WORDS = (512 + 1 + 63) / 64;  // mask words for the largest budget
constexpr float FLT_MAX_F = 3.402823466e+38f;

// Monotone map double -> u64 (larger double, larger key); +0 and -0 map alike, as they compare equal.
// -inf maps to 0x000fffff'ffffffff and every finite double above it, so key 0 marks an empty heap slot
// (every score is finite: log-probs are clamped to +-FLT_MAX, at most 16 of them summed).
__device__ __forceinline__ unsigned long long ord64(double x) {
  long long b = x == 0.0 ? 0ll : __double_as_longlong(x);
  return b < 0 ? ~(unsigned long long)b : (unsigned long long)b | 0x8000000000000000ull;
}

constexpr int CODE_WORDS = 3;       // rank-tuple code: 6 fields of 10 bits per word, depth <= 18
constexpr int CODE_FIELD_BITS = 10;  // rank + 1 <= 512 < 1024; 0 = no rank (a shorter tuple)
constexpr int CODE_FIELDS = 6;

struct Smem {
  double* score;      // [N] node score
  int* parent;        // [N]
  int* rank;          // [N]
  int* depth;         // [N]
  int* first_child;   // [N]
  int* next_sibling;  // [N]
  unsigned long long* code;  // [N * CODE_WORDS] the node's rank tuple, fields most significant first
  unsigned long long* ckey;  // [N] heap slot i (node i's next unpopped child): its order key, 0 = none
  double* cscore;     // [N] that candidate's score
  int* crank;         // [N] its rank
  int* clast;         // [N] node i's last popped child (-1: none yet)
  float* lq;          // [L * ks] sanitized log-probs, row stride ks
  int* ids;           // [L * ks] their token ids
};

__device__ __forceinline__ Smem carve(unsigned char* base, int n_slots, int L, int ks) {
  Smem s;
  s.score = reinterpret_cast<double*>(base);
  s.code = reinterpret_cast<unsigned long long*>(s.score + n_slots);
  s.ckey = s.code + n_slots * CODE_WORDS;
  s.cscore = reinterpret_cast<double*>(s.ckey + n_slots);
  s.crank = reinterpret_cast<int*>(s.cscore + n_slots);
  s.clast = s.crank + n_slots;
  s.parent = s.clast + n_slots;
  s.rank = s.parent + n_slots;
  s.depth = s.rank + n_slots;
  s.first_child = s.depth + n_slots;
  s.next_sibling = s.first_child + n_slots;
  s.lq = reinterpret_cast<float*>(s.next_sibling + n_slots);
  s.ids = reinterpret_cast<int*>(s.lq + L * ks);
  return s;
}

// Rank tuples as integers: the node at depth d with ranks (r1, ..., rd) has field i = r_i + 1 (word
// (i-1) / 6, most significant field first) and zeros after, so comparing the words in order is the
// tuple order with a prefix first (the reference's heap order on equal scores). A candidate "child
// r of node a" is a's code with field depth(a) + 1 set to r + 1.
__device__ __forceinline__ int code_word(int d) { return (d - 1) / CODE_FIELDS; }  // d = candidate depth >= 1
__device__ __forceinline__ unsigned long long field(int d, int r) {
  return (unsigned long long)(r + 1) << (CODE_FIELD_BITS * (CODE_FIELDS - 1 - (d - 1) % CODE_FIELDS));
}

struct Limits {
  int kc, ks, depth_limit, n_slots;
};

// The candidate of slot i: its tuple code word w (node i's code with field depth(i) + 1 = rank + 1).
__device__ __forceinline__ unsigned long long cand_code(const Smem& s, int i, int w) {
  const int d = s.depth[i] + 1;
  unsigned long long c = s.code[i * CODE_WORDS + w];
  if (code_word(d) == w) c |= field(d, s.crank[i]);
  return c;
}

__device__ __forceinline__ bool slot_less(const Smem& s, int a, int b) {  // equal keys only
#pragma unroll
  for (int w = 0; w < CODE_WORDS; ++w) {
    const unsigned long long ca = cand_code(s, a, w), cb = cand_code(s, b, w);
    if (ca != cb) return ca < cb;
  }
  return false;
}

// The heap loop of the reference, one warp. The heap holds at most one entry per node: node i's
// next unpopped child, "slot i", kept in shared memory (key, score, rank, last popped child) and
// owned by lane i % 32. Each lane caches its best slot (largest key, then the smaller tuple code).
// A pop: two warp max reductions over the cached keys (high, then low word; exact ties go to the
// tuple codes); the winner lane records the node, moves slot p on to its next sibling and opens
// the new node's slot with its first child (both scores in the reference's exact operation
// order), then rescans its J slots; the new node's lane compares the new slot with its best.
// One warp runs alone, so a pop costs its dependent chain: ~1000 SM cycles on the H200 (J = 3), where
// one dependent REDUX, SHFL, VOTE or LDS step of a lone warp measured 110-145 cycles; preparing each
// lane's pop ahead of time (the loads off the chain) measured 10% slower.
template <int J>
__device__ void heap_loop(const Smem& s, const Limits& lim, int budget, int& n_out) {
  const int lane = threadIdx.x & 31;
  const int ns = lim.n_slots;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int i = lane + 32 * j;
    if (i < ns) s.ckey[i] = 0ull;
  }
  if (lane == 0 && budget > 0 && lim.depth_limit > 0) {  // (-lq[0][0], (0,), 0, 1, 0)
    const double c = (double)s.lq[0];
    s.ckey[0] = ord64(c);
    s.cscore[0] = c;
    s.crank[0] = 0;
    s.clast[0] = -1;
  }
  __syncwarp();
  unsigned long long bk = 0ull;  // this lane's best slot key (0: none) and index
  int bi = 0;
  auto rescan = [&]() {
    unsigned long long k[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int i = lane + 32 * j;
      k[j] = i < ns ? s.ckey[i] : 0ull;
    }
    bk = 0ull;
    bi = lane;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int i = lane + 32 * j;
      if (k[j] > bk) {
        bk = k[j];
        bi = i;
      } else if (k[j] != 0ull && k[j] == bk && slot_less(s, i, bi)) {
        bi = i;
      }
    }
  };
  rescan();
  TREE_STAMP(4);
  int n = 0;
  while (n < budget) {
    const unsigned hi = (unsigned)(bk >> 32), lo = (unsigned)bk;
    const unsigned max_hi = __reduce_max_sync(FULL, hi);
    if (max_hi == 0u) break;  // every slot is empty: the heap is exhausted
    const unsigned max_lo = __reduce_max_sync(FULL, hi == max_hi ? lo : 0u);
    unsigned tied = __ballot_sync(FULL, hi == max_hi && lo == max_lo);
    if (tied & (tied - 1u)) {  // equal scores (warp-uniform): the smallest tuple code wins
#pragma unroll
      for (int w = 0; w < CODE_WORDS; ++w) {
        const bool in = (tied >> lane) & 1u;  // still tied after the words before
        const unsigned long long c = in ? cand_code(s, bi, w) : ~0ull;
        const unsigned ch = (unsigned)(c >> 32), cl = (unsigned)c;
        const unsigned mh = __reduce_min_sync(FULL, ch);
        const unsigned ml = __reduce_min_sync(FULL, ch == mh ? cl : ~0u);
        tied &= __ballot_sync(FULL, ch == mh && cl == ml);
        if (!(tied & (tied - 1u))) break;
      }
    }
    const int win = __ffs(tied) - 1;
    const int node = ++n;
    if (lane == win) {
      const int p = bi;
      const double score = s.cscore[p];
      const int r = s.crank[p], prev = s.clast[p], d = s.depth[p] + 1;
      s.score[node] = score;
      s.parent[node] = p;
      s.rank[node] = r;
      s.depth[node] = d;
      const int cw = code_word(d);
#pragma unroll
      for (int w = 0; w < CODE_WORDS; ++w) {
        unsigned long long c = s.code[p * CODE_WORDS + w];
        if (cw == w) c |= field(d, r);
        s.code[node * CODE_WORDS + w] = c;
      }
      if (r == 0) s.first_child[p] = node;
      else s.next_sibling[prev] = node;
      const float* row = s.lq + (d - 1) * lim.ks;
      if (r + 1 < lim.kc) {  // slot p offers its next child
        const double sib = (score - (double)row[r]) + (double)row[r + 1];
        s.ckey[p] = ord64(sib);
        s.cscore[p] = sib;
        s.crank[p] = r + 1;
        s.clast[p] = node;
      } else {
        s.ckey[p] = 0ull;
      }
      if (d < lim.depth_limit) {  // the new node's slot offers its first child
        const double c = score + (double)row[lim.ks];
        s.ckey[node] = ord64(c);
        s.cscore[node] = c;
        s.crank[node] = 0;
        s.clast[node] = -1;
      } else {
        s.ckey[node] = 0ull;
      }
    }
    __syncwarp();  // slot and node records are visible to every lane
    if (lane == win) {
      rescan();
    } else if (lane == (node & 31)) {
      const unsigned long long k = s.ckey[node];
      if (k > bk || (k != 0ull && k == bk && slot_less(s, node, bi))) {
        bk = k;
        bi = node;
      }
    }
  }
  TREE_STAMP(5);
  n_out = n;
}


struct Pool {
  double* score;  // [cap] candidate score
  int* parent;    // [cap] parent entry (-1: the root)
  int* pred;      // [cap] previous sibling entry, or the parent for rank 0
  int* rank;      // [cap]
  int* depth;     // [cap]
  int* node;      // [cap] node index once ranked, -1 if not kept
};

__device__ __forceinline__ Pool carve_pool(unsigned char* base, int cap) {
  Pool q;
  // Align by offsetting base itself (not through an integer) so the compiler keeps these in shared
  // memory (LDS/STS) rather than falling back to generic loads; base is 4-byte aligned.
  q.score = reinterpret_cast<double*>(base + (reinterpret_cast<size_t>(base) & 4));
  q.parent = reinterpret_cast<int*>(q.score + cap);
  q.pred = q.parent + cap;
  q.rank = q.pred + cap;
  q.depth = q.rank + cap;
  q.node = q.depth + cap;
  return q;
}

// Rank-tuple order of two distinct pool entries (the pool twin of the heap's tuple codes).
__device__ __noinline__ bool pool_tuple_less(const Pool& q, int a, int b) {
  int da = q.depth[a], db = q.depth[b];
  const bool a_shorter = da < db;
  for (; da > db; --da) a = q.parent[a];
  for (; db > da; --db) b = q.parent[b];
  if (a == b) return a_shorter;
  while (q.parent[a] != q.parent[b]) {
    a = q.parent[a];
    b = q.parent[b];
  }
  return q.rank[a] < q.rank[b];
}

struct LevelShared {
  int count;                      // pool entries claimed (may pass cap: then `bad`)
  int bad;                        // non-monotone step or full pool: fall back to the heap loop
  unsigned long long tau_acc[2];  // per-level atomicMin of ord64(score), alternating buffers
};

// Returns the number of nodes written into `s`, or -1 to fall back. All THREADS threads call it.
__device__ int level_build(const Smem& s, const Pool& q, LevelShared& sh, int cap, int kc, int ks,
                           int depth_limit, int budget) {
  const int tid = threadIdx.x;
  unsigned long long tau = 0ull;  // ord64 key: candidates below it are cut; 0 cuts nothing
  int begin = 0, end = 0;
  if (tid == 0) sh.bad = 0;
  __syncthreads();
  // Depth 1, all kc ranks at once (tau cuts nothing yet, kc < cap): there the sibling recurrence
  // is exact, (s - lq[r]) + lq[r+1] with s == lq[r] gives +0 + lq[r+1], so rank r scores lq[0][0]
  // for r = 0 and 0.0 + lq[0][r] after (only the sign of a zero differs from lq[0][r]).
  for (int r = tid; r < kc; r += THREADS) {
    const double sc = r == 0 ? (double)s.lq[0] : __dadd_rn(0.0, (double)s.lq[r]);
    if (r > 0 && sc > (r == 1 ? (double)s.lq[0] : __dadd_rn(0.0, (double)s.lq[r - 1]))) sh.bad = 1;
    q.score[r] = sc;
    q.parent[r] = -1;
    q.pred[r] = r - 1;
    q.rank[r] = r;
    q.depth[r] = 1;
  }
  if (tid == 0) sh.count = kc;
  for (int d = 1; d <= depth_limit; ++d) {
    if (tid == 0) sh.tau_acc[d & 1] = ~0ull;  // last read two barriers ago, next used after one
    const int n_par = d == 1 ? 0 : end - begin;
    const float* row = s.lq + (d - 1) * ks;
    for (int i = tid; i < n_par; i += THREADS) {
      const int p = begin + i;
      const double ps = q.score[p];
      double sc = ps + (double)row[0];
      if (sc > ps) {
        sh.bad = 1;
        break;
      }
      if (ord64(sc) < tau) continue;
      int pred = p;
      for (int r = 0;; ++r) {
        const int e = atomicAdd(&sh.count, 1);
        if (e >= cap) {
          sh.bad = 1;
          break;
        }
        q.score[e] = sc;
        q.parent[e] = p;
        q.pred[e] = pred;
        q.rank[e] = r;
        q.depth[e] = d;
        pred = e;
        if (r + 1 >= kc) break;
        const double s2 = (sc - (double)row[r]) + (double)row[r + 1];
        if (s2 > sc) {
          sh.bad = 1;
          break;
        }
        if (ord64(s2) < tau) break;
        sc = s2;
      }
    }
    __syncthreads();
    const int bad = sh.bad, count = sh.count;
    if (!bad && count > end && count >= budget) {
      // tau = the budget-th best score: fewer than `budget` entries beat it
      for (int e = tid; e < count; e += THREADS) {
        const double se = q.score[e];
        int better = 0;
        for (int x = 0; x < count; ++x) better += q.score[x] > se;
        if (better < budget) atomicMin(&sh.tau_acc[d & 1], ord64(se));
      }
    }
    __syncthreads();  // also: every thread has read count / bad before the next level claims entries
    if (bad) return -1;
    if (count == end) break;  // nothing at depth d: nothing deeper either
    begin = end;
    end = count;
    if (end >= budget) tau = sh.tau_acc[d & 1];
  }
  const int n_pool = end, n = min(budget, n_pool);
  for (int e = tid; e < n_pool; e += THREADS) {
    const double se = q.score[e];
    int before = 0;
    for (int x = 0; x < n_pool; ++x) {
      const double sx = q.score[x];
      before += sx > se || (sx == se && x != e && pool_tuple_less(q, x, e));
    }
    q.node[e] = before < n ? before + 1 : -1;
  }
  __syncthreads();
  for (int e = tid; e < n_pool; e += THREADS) {
    const int node = q.node[e];
    if (node < 0) continue;
    const int pe = q.parent[e], r = q.rank[e];
    const int p = pe < 0 ? 0 : q.node[pe];  // kept: the kept set is prefix-closed
    s.score[node] = q.score[e];
    s.parent[node] = p;
    s.rank[node] = r;
    s.depth[node] = q.depth[e];
    if (r == 0) s.first_child[p] = node;
    else s.next_sibling[q.node[q.pred[e]]] = node;
  }
  return n;
}

template <int J, bool LEVEL>
__device__ __forceinline__ void build(const float* __restrict__ logq, const int* __restrict__ ids,
                                      int L, int K, const int* __restrict__ root_tokens,
                                      const int* __restrict__ budgets, const int* __restrict__ depths,
                                      const int* __restrict__ prefix_lens, int max_budget, int ks,
                                      int W, int cap, int* tokens, int* parents, int* node_depth,
                                      int* positions, int* num_nodes, unsigned long long* mask,
                                      int* first_child, int* next_sibling, double* scores) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int n_popped;
  __shared__ LevelShared level_sh;
  TREE_STAMP(0);
  const int b = blockIdx.x, tid = threadIdx.x;
  const int n_slots = max_budget + 1;
  const Smem s = carve(smem_raw, n_slots, L, ks);
  const int budget = min(max(budgets[b], 0), max_budget);
  const int depth_limit = min(max(depths[b], 0), L);
  const int prefix = prefix_lens[b], root = root_tokens[b];
  const int kc = min(K, max(budget, 1));  // ranks >= budget are never popped (kc <= ks)

  // Stage the whole [L, ks] tiles: independent of this request's limits, so these loads go out
  // together with the ones above instead of after them.
  const long long in0 = (long long)b * L * K;
  for (int i = tid; i < L * ks; i += THREADS) {
    const int d = i / ks, c = i - d * ks;
    const float v = logq[in0 + d * K + c];
    s.lq[i] = v != v ? -FLT_MAX_F : fminf(fmaxf(v, -FLT_MAX_F), FLT_MAX_F);
    s.ids[i] = ids[in0 + d * K + c];
  }
  for (int i = tid; i < n_slots; i += THREADS) {
    s.first_child[i] = -1;
    s.next_sibling[i] = -1;
  }
  if (tid == 0) {
    s.depth[0] = 0;
    s.parent[0] = -1;
    s.score[0] = 0.0;
#pragma unroll
    for (int w = 0; w < CODE_WORDS; ++w) s.code[w] = 0ull;
  }
  __syncthreads();
  TREE_STAMP(1);
  int n_level = -1;
  if (LEVEL && budget > 0 && depth_limit > 0) {
    const Pool q = carve_pool(reinterpret_cast<unsigned char*>(s.ids + L * ks), cap);
    n_level = level_build(s, q, level_sh, cap, kc, ks, depth_limit, budget);  // block-uniform
    if (tid == 0 && n_level >= 0) n_popped = n_level;
  }
  if (n_level < 0 && tid < 32) {
    int n = 0;
    heap_loop<J>(s, Limits{kc, ks, depth_limit, n_slots}, budget, n);
    if (tid == 0) n_popped = n;
  }
  __syncthreads();
  TREE_STAMP(2);

  const int n_nodes = n_popped + 1;
  const long long row0 = (long long)b * n_slots;
  for (int i = tid; i < n_slots; i += THREADS) {
    const long long o = row0 + i;
    unsigned long long words[MAX_WORDS];
#pragma unroll
    for (int w = 0; w < MAX_WORDS; ++w) words[w] = 0ull;
    if (i < n_nodes) {
      const int d = s.depth[i];
      tokens[o] = i == 0 ? root : s.ids[(d - 1) * ks + s.rank[i]];
      parents[o] = s.parent[i];
      node_depth[o] = d;
      positions[o] = prefix + d;
      scores[o] = s.score[i];
      first_child[o] = s.first_child[i];
      next_sibling[o] = s.next_sibling[i];
      for (int a = i; a >= 0; a = s.parent[a]) {  // ancestors, self included (<= 17 steps)
#pragma unroll
        for (int w = 0; w < MAX_WORDS; ++w)
          if (w == (a >> 6)) words[w] |= 1ull << (a & 63);
      }
    } else {
      tokens[o] = -1;
      parents[o] = -1;
      node_depth[o] = -1;
      positions[o] = -1;
      scores[o] = __longlong_as_double(0x7ff8000000000000ll);
      first_child[o] = -1;
      next_sibling[o] = -1;
    }
    unsigned long long* m = mask + o * W;
#pragma unroll
    for (int w = 0; w < MAX_WORDS; ++w)
      if (w < W) m[w] = words[w];
  }
  if (tid == 0) num_nodes[b] = n_nodes;
#if TREE_PROFILE
  __syncthreads();
#endif
  TREE_STAMP(3);
}

}  // namespace

// logq [B, L, K] fp32, ids [B, L, K] int32; root_tokens, budgets, depths, prefix_lens [B] int32.
// Outputs [B, 1 + max_budget] (mask [B, 1 + max_budget, W]). Grid B, block 128, dynamic shared
// memory (1 + max_budget) * 76 + L * ks * 8 bytes, ks = max(1, min(K, max_budget)), plus
// cap * 28 + 8 bytes of pool for the level variant (cap is ignored by the heap-only one).
#define TREE_BUILD_ENTRY(NAME, J, LEVEL)                                                            \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                    \
      const float* __restrict__ logq, const int* __restrict__ ids, int L, int K,                    \
      const int* __restrict__ root_tokens, const int* __restrict__ budgets,                         \
      const int* __restrict__ depths, const int* __restrict__ prefix_lens, int max_budget, int ks,  \
      int W, int cap, int* tokens, int* parents, int* node_depth, int* positions, int* num_nodes,   \
      unsigned long long* mask, int* first_child, int* next_sibling, double* scores) {              \
    build<J, LEVEL>(logq, ids, L, K, root_tokens, budgets, depths, prefix_lens, max_budget, ks, W,  \
                    cap, tokens, parents, node_depth, positions, num_nodes, mask, first_child,      \
                    next_sibling, scores);                                                          \
  }

TREE_BUILD_ENTRY(tree_build_j3, 3, false)
TREE_BUILD_ENTRY(tree_build_j9, 9, false)
TREE_BUILD_ENTRY(tree_build_j17, 17, false)
TREE_BUILD_ENTRY(tree_build_level_j3, 3, true)
TREE_BUILD_ENTRY(tree_build_level_j9, 9, true)
TREE_BUILD_ENTRY(tree_build_level_j17, 17, true)
