// DDTree best-first tree build (DESIGN.md section 4), bit-identical to the Python heapq reference
// in ddtree_rtc/reference/tree_build.py. One block of 128 threads per request.
//
// The heap holds at most one entry per tree node: the node's next unpopped child (rank 0 when the
// node is popped, rank r+1 after its child r is popped, which is exactly the reference's "sibling
// push"). So "slot i" = candidate child of node i. Warp 0 runs the pop loop; slot i lives in lane
// i % 32, register j = i / 32 (J registers per lane, J*32 >= max_budget + 1). Each lane caches its
// best slot together with that candidate's two successors (next sibling, first child), computed
// when the best changes, so a pop is: warp argmax over the cached bests, shuffle the winner's
// data, update two slots, and the winner lane rescans its J registers.
//
// Order: larger score first (scores are float64, accumulated with the reference's exact operation
// order: child = score + lq[d][0], sibling = (score - lq[d-1][r]) + lq[d-1][r+1]; no multiply, so
// nothing can be contracted into an FMA); equal scores (+0 == -0) fall back to the rank tuples,
// lexicographic with a prefix first, compared by climbing both candidates' ancestor chains.
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

namespace {

constexpr int THREADS = 128;
constexpr unsigned FULL = 0xffffffffu;
constexpr int MAX_WORDS = (512 + 1 + 63) / 64;  // mask words for the largest budget
constexpr float FLT_MAX_F = 3.402823466e+38f;
constexpr unsigned EMPTY_HI = 0x000fffffu;  // high word of ord64(-inf)

__device__ __forceinline__ double neg_inf() { return __longlong_as_double(0xfff0000000000000ll); }

// Monotone map double -> u64 (larger double, larger key); +0 and -0 map alike, as they compare equal.
// -inf (an empty slot) maps to 0x000fffff'ffffffff; every finite double's high word is above it.
__device__ __forceinline__ unsigned long long ord64(double x) {
  long long b = x == 0.0 ? 0ll : __double_as_longlong(x);
  return b < 0 ? ~(unsigned long long)b : (unsigned long long)b | 0x8000000000000000ull;
}

struct Smem {
  double* score;      // [N] node score
  int* parent;        // [N]
  int* rank;          // [N]
  int* depth;         // [N]
  int* first_child;   // [N]
  int* next_sibling;  // [N]
  float* lq;          // [L * ks] sanitized log-probs, row stride ks
  int* ids;           // [L * ks] their token ids
};

__device__ __forceinline__ Smem carve(unsigned char* base, int n_slots, int L, int ks) {
  Smem s;
  s.score = reinterpret_cast<double*>(base);
  s.parent = reinterpret_cast<int*>(s.score + n_slots);
  s.rank = s.parent + n_slots;
  s.depth = s.rank + n_slots;
  s.first_child = s.depth + n_slots;
  s.next_sibling = s.first_child + n_slots;
  s.lq = reinterpret_cast<float*>(s.next_sibling + n_slots);
  s.ids = reinterpret_cast<int*>(s.lq + L * ks);
  return s;
}

// Is candidate "child ra of node a" before candidate "child rb of node b" in rank-tuple order?
// Only asked when their scores are equal. Climb the deeper one to the other's depth, then both to
// their common ancestor: the ranks just below it decide; if one is an ancestor of the other, the
// shorter tuple comes first.
__device__ __noinline__ bool tuple_less(const Smem& s, int a, int ra, int b, int rb) {
  int da = s.depth[a] + 1, db = s.depth[b] + 1;
  const bool a_shorter = da < db;
  while (da > db) {
    ra = s.rank[a];
    a = s.parent[a];
    --da;
  }
  while (db > da) {
    rb = s.rank[b];
    b = s.parent[b];
    --db;
  }
  if (a == b && ra == rb) return a_shorter;
  while (a != b) {
    ra = s.rank[a];
    a = s.parent[a];
    rb = s.rank[b];
    b = s.parent[b];
  }
  return ra < rb;
}

// A lane's best slot (score -inf = none) with what popping it would push.
struct LaneBest {
  double score, sib, child;  // candidate score; its next sibling's and first child's (-inf: none)
  int j, rank, lastc, depth;  // register, candidate rank, last popped child, slot node's depth
};

struct Limits {
  int kc, ks, depth_limit;
};

__device__ __forceinline__ void successors(const Smem& s, const Limits& lim, LaneBest& b) {
  const float* row = s.lq + b.depth * lim.ks;  // the candidate sits at depth b.depth + 1
  b.sib = b.rank + 1 < lim.kc ? (b.score - (double)row[b.rank]) + (double)row[b.rank + 1] : neg_inf();
  b.child = b.depth + 1 < lim.depth_limit ? b.score + (double)row[lim.ks] : neg_inf();
}

template <int J>
__device__ __forceinline__ LaneBest rescan(const Smem& s, const Limits& lim, int lane, const double (&sc)[J],
                                           const int (&cr)[J], const int (&lc)[J], const int (&dp)[J]) {
  LaneBest b{neg_inf(), neg_inf(), neg_inf(), -1, 0, -1, 0};
#pragma unroll
  for (int j = 0; j < J; ++j) {
    if (sc[j] == neg_inf()) continue;
    bool take = b.j < 0 || sc[j] > b.score;
    if (!take && sc[j] == b.score) take = tuple_less(s, lane + 32 * j, cr[j], lane + 32 * b.j, b.rank);
    if (take) {
      b.score = sc[j];
      b.j = j;
      b.rank = cr[j];
      b.lastc = lc[j];
      b.depth = dp[j];
    }
  }
  if (b.j >= 0) successors(s, lim, b);
  return b;
}

template <int J>
__device__ void heap_loop(const Smem& s, const Limits& lim, int budget, int& n_out) {
  const int lane = threadIdx.x & 31;
  double sc[J];
  int cr[J], lc[J], dp[J];  // candidate score, its rank, the slot's last popped child, slot depth
#pragma unroll
  for (int j = 0; j < J; ++j) {
    sc[j] = neg_inf();
    cr[j] = 0;
    lc[j] = -1;
    dp[j] = 0;
  }
  if (lane == 0 && budget > 0 && lim.depth_limit > 0) sc[0] = (double)s.lq[0];  // (-lq[0][0], (0,), 0, 1, 0)
  LaneBest best = rescan<J>(s, lim, lane, sc, cr, lc, dp);
  int n = 0;
  while (n < budget) {
    // Warp argmax of (score, then smaller tuple) over the lanes' bests.
    const unsigned long long key = ord64(best.score);
    const unsigned hi = (unsigned)(key >> 32), lo = (unsigned)key;
    const unsigned max_hi = __reduce_max_sync(FULL, hi);
    if (max_hi == EMPTY_HI) break;  // every lane is empty: the heap is exhausted
    unsigned tied = __ballot_sync(FULL, hi == max_hi);
    if (__popc(tied) > 1) {
      const unsigned max_lo = __reduce_max_sync(FULL, hi == max_hi ? lo : 0u);
      tied = __ballot_sync(FULL, hi == max_hi && lo == max_lo);
    }
    int win = __ffs(tied) - 1;
    const int my_slot = lane + 32 * best.j;
    if (__popc(tied) > 1) {  // equal scores: the smaller rank tuple wins (warp-uniform loop)
      int w_slot = __shfl_sync(FULL, my_slot, win), w_rank = __shfl_sync(FULL, best.rank, win);
      for (unsigned rest = tied & (tied - 1); rest; rest &= rest - 1) {
        const int l = __ffs(rest) - 1;
        const int l_slot = __shfl_sync(FULL, my_slot, l), l_rank = __shfl_sync(FULL, best.rank, l);
        if (tuple_less(s, l_slot, l_rank, w_slot, w_rank)) {
          win = l;
          w_slot = l_slot;
          w_rank = l_rank;
        }
      }
    }
    // The winner's data (equal scores may still differ in the sign of zero: take the winner's).
    const double score = __shfl_sync(FULL, best.score, win);
    const double sib = __shfl_sync(FULL, best.sib, win);
    const double child = __shfl_sync(FULL, best.child, win);
    const int p = __shfl_sync(FULL, my_slot, win);
    const int r = __shfl_sync(FULL, best.rank, win);
    const int prev = __shfl_sync(FULL, best.lastc, win);
    const int d = __shfl_sync(FULL, best.depth, win) + 1;
    const int node = ++n;
    if (lane == 0) {
      s.score[node] = score;
      s.parent[node] = p;
      s.rank[node] = r;
      s.depth[node] = d;
      if (r == 0) s.first_child[p] = node;
      else s.next_sibling[prev] = node;
    }
    // Slot p now offers its next child; the new node's slot offers its first child.
    const int pj = p >> 5, nj = node >> 5;
    const bool owns_p = lane == win, owns_node = lane == (node & 31);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (owns_p && j == pj) {
        sc[j] = sib;
        cr[j] = r + 1;
        lc[j] = node;
      }
      if (owns_node && j == nj) {
        sc[j] = child;
        cr[j] = 0;
        lc[j] = -1;
        dp[j] = d;
      }
    }
    __syncwarp();  // the new node's parent / rank / depth are visible to the tie-breaks below
    if (owns_p) {
      best = rescan<J>(s, lim, lane, sc, cr, lc, dp);
    } else if (owns_node && child != neg_inf()) {
      bool take = best.j < 0 || child > best.score;
      if (!take && child == best.score) take = tuple_less(s, node, 0, lane + 32 * best.j, best.rank);
      if (take) {
        best = LaneBest{child, 0.0, 0.0, nj, 0, -1, d};
        successors(s, lim, best);
      }
    }
  }
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
  q.score = reinterpret_cast<double*>((reinterpret_cast<size_t>(base) + 7) & ~size_t(7));
  q.parent = reinterpret_cast<int*>(q.score + cap);
  q.pred = q.parent + cap;
  q.rank = q.pred + cap;
  q.depth = q.rank + cap;
  q.node = q.depth + cap;
  return q;
}

// Rank-tuple order of two distinct pool entries (the pool twin of tuple_less).
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
  }
  __syncthreads();
  int n_level = -1;
  if (LEVEL && budget > 0 && depth_limit > 0) {
    const Pool q = carve_pool(reinterpret_cast<unsigned char*>(s.ids + L * ks), cap);
    n_level = level_build(s, q, level_sh, cap, kc, ks, depth_limit, budget);  // block-uniform
    if (tid == 0 && n_level >= 0) n_popped = n_level;
  }
  if (n_level < 0 && tid < 32) {
    int n = 0;
    heap_loop<J>(s, Limits{kc, ks, depth_limit}, budget, n);
    if (tid == 0) n_popped = n;
  }
  __syncthreads();

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
}

}  // namespace

// logq [B, L, K] fp32, ids [B, L, K] int32; root_tokens, budgets, depths, prefix_lens [B] int32.
// Outputs [B, 1 + max_budget] (mask [B, 1 + max_budget, W]). Grid B, block 128, dynamic shared
// memory (1 + max_budget) * 28 + L * ks * 8 bytes, ks = max(1, min(K, max_budget)), plus
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
