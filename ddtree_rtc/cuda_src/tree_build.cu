// DDTree best-first tree build (docs/architecture.md), bit-identical to the Python heapq reference
// in ddtree_rtc/reference/tree_build.py. One block of TREE_THREADS threads (512 as registered) per request.
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
// After the loop all THREADS threads write the outputs, including every unused slot up to max_budget.
//
// The entries (tree_build_prune_j*) first try a parallel build that is exact
// whenever the scores it meets are monotone (every generated child / next sibling scores <= its
// predecessor, as sorted log-probs <= 0 give up to rounding). It grows a pool of candidates depth by
// depth: at depth d every pool node of depth d-1 walks its child chain (first child, then siblings)
// in one thread while the score stays >= tau, a bound that at least `budget` pool entries reach.
// Then the pool's first `budget` entries in (score desc, rank tuple asc) order are the heap's pops,
// in that order: the pool is prefix-closed, monotone, and every successor of a kept entry that is
// not kept scores below all kept ones (it was cut below a tau <= the final budget-th score, or it
// is in the pool and ranks later), so the heap, popping its minimum, pops exactly those in sorted
// order. A non-monotone step or a full pool sets a flag and the request falls back to the heap
// loop above, so the result is exact either way. (Variants tried and dropped: benchmarks/README.md.)

#ifndef TREE_PROFILE
#define TREE_PROFILE 0
#endif
#if TREE_PROFILE
// Diagnostics build only, 32 slots per block: SM clock at the phase boundaries (0 start, 1 staged,
// 2 built, 3 written; 4 and 5 the heap loop's start and end when it runs); the prune variant's pool
// and list sizes in 6 and 7 and the clock after each of its steps from 8 on (see prune_build).
__device__ long long tree_prof[32 * 1024];
#define TREE_STAMP(i) \
  if (threadIdx.x == 0 && blockIdx.x < 1024) tree_prof[32 * blockIdx.x + (i)] = clock64()
#else
#define TREE_STAMP(i)
#endif

namespace {

#ifndef TREE_THREADS
#define TREE_THREADS 512
#endif
constexpr int THREADS = TREE_THREADS;  // a multiple of 32, at most 1024
static_assert(THREADS % 32 == 0 && THREADS >= 64 && THREADS <= 1024, "TREE_THREADS");
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
// One warp runs alone, so a pop costs its dependent chain of warp reductions and shared loads; that
// latency is why the prune build runs first (the cycle counts: benchmarks/README.md, tree_build).
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


// Rank-tuple order of two distinct pool entries, from their parent / rank / depth links (the pool
// twin of the heap's tuple codes).
__device__ __noinline__ bool entry_tuple_less(const int* parent, const int* rank, const int* depth, int a, int b) {
  int da = depth[a], db = depth[b];
  const bool a_shorter = da < db;
  for (; da > db; --da) a = parent[a];
  for (; db > da; --db) b = parent[b];
  if (a == b) return a_shorter;
  while (parent[a] != parent[b]) {
    a = parent[a];
    b = parent[b];
  }
  return rank[a] < rank[b];
}

// ---------------------------------------------------------------- the prune variant
//
// The pool and exactness argument of the file's header, with two quadratic steps avoided. The pool
// grows depth by depth as there, but (1) each parent's child chain is walked twice, once to count
// and once to store, so a warp claims its entries with one scan and one shared atomic instead of
// one atomic per entry, and chains lie contiguously (the previous sibling of entry e is e - 1);
// (2) tau is not the exact budget-th score but a lower bound from one 256-bin histogram of the
// entries' order keys: with bins (key - lo) >> shift (the top bin also taking everything above),
// the lower edge lo + (j << shift) of the highest bin j whose suffix count reaches the budget has
// at least `budget` entries at or above it, which is all the pruning needs (an entry below a bound
// that `budget` others reach can never be popped). At the end, histogram rounds on the bin of the
// bound narrow it (8 bits each) until at most budget + PRUNE_SLACK entries reach it; only those are
// ranked by (score desc, rank tuple asc), all pairs among them.

constexpr int NB = 256;          // bins per histogram round (8 per lane of warp 0)
constexpr int PRUNE_SLACK = 16;  // final list size over the budget that stops narrowing
constexpr int PRUNE_LIST_EXTRA = 63;  // listed entries with tuple codes: 1 + max_budget + this

struct PrunePool {
  double* score;   // [cap] candidate score
  unsigned long long* lkey;  // [cap] the final list's order keys, in list order
  unsigned long long* lcode;  // [lcap * CODE_WORDS] the first lcap listed entries' rank-tuple codes
  int* parent;     // [cap] parent entry (-1: the root)
  int* rank;       // [cap]
  int* depth;      // [cap]
  int* node;       // [cap] a listed entry: how many listed entries rank before it (node = 1 + that)
  int* list;       // [cap] entries reaching the final bound
};

__device__ __forceinline__ PrunePool carve_prune(unsigned char* base, int cap, int lcap) {
  PrunePool q;
  // Align by offsetting base itself (not through an integer) so the compiler keeps these in shared
  // memory (LDS/STS) rather than falling back to generic loads; base is 4-byte aligned.
  q.score = reinterpret_cast<double*>(base + (reinterpret_cast<size_t>(base) & 4));
  q.lkey = reinterpret_cast<unsigned long long*>(q.score + cap);
  q.lcode = q.lkey + cap;
  q.parent = reinterpret_cast<int*>(q.lcode + lcap * CODE_WORDS);
  q.rank = q.parent + cap;
  q.depth = q.rank + cap;
  q.node = q.depth + cap;
  q.list = q.node + cap;
  return q;
}

__device__ __forceinline__ bool prune_tuple_less(const PrunePool& q, int a, int b) {
  return entry_tuple_less(q.parent, q.rank, q.depth, a, b);
}

struct PruneShared {
  int count;  // pool entries claimed (may pass cap: then `bad`)
  int bad;    // non-monotone step or full pool: fall back to the heap loop
  int m;      // entries at or above the last round's bound
  int n_list;
  unsigned long long tau;      // the last round's bound
  unsigned long long min_key;  // smallest key in the pool (a round's base before any bound exists)
  int hist[NB];
};

__device__ __forceinline__ void put_entry(const PrunePool& q, int e, double sc, int p, int r, int d) {
  q.score[e] = sc;
  q.parent[e] = p;
  q.rank[e] = r;
  q.depth[e] = d;
}

// Child chain of a parent scoring ps at depth d: child 0 = ps + row[0], child r + 1 =
// (child r - row[r]) + row[r + 1] (the reference's operations), while the key stays >= tau.
// Returns its length; STORE writes the entries from e0 on. A step that scores above its
// predecessor sets bad (the same in both walks, so both return the same length). (Scoring four
// children at once as fl(ps + row[r]) while TwoSum shows every sum so far exact, where the
// recurrence collapses to that, measured slower on the H200: a lone warp pays per instruction.)
template <bool STORE>
__device__ __forceinline__ int walk_chain(const PrunePool& q, double ps, int p, int d, const float* row, int kc,
                                          unsigned long long tau, int e0, int& bad) {
  double sc = ps + (double)row[0];
  if (sc > ps) {
    bad = 1;
    return 0;
  }
  if (ord64(sc) < tau) return 0;
  float cur = row[0], next = kc > 1 ? row[1] : 0.f;
  for (int r = 0;; ++r) {
    if (STORE) put_entry(q, e0 + r, sc, p, r, d);
    if (r + 1 >= kc) return r + 1;
    const float after = r + 2 < kc ? row[r + 2] : 0.f;  // loaded one step ahead of its use
    const double s2 = (sc - (double)cur) + (double)next;
    if (s2 > sc) {
      bad = 1;
      return r + 1;
    }
    if (ord64(s2) < tau) return r + 1;
    sc = s2;
    cur = next;
    next = after;
  }
}

// Smallest key among entries [0, count) into sh.min_key. All threads call it.
__device__ unsigned long long pool_min_key(const PrunePool& q, PruneShared& sh, int count) {
  if (threadIdx.x == 0) sh.min_key = ~0ull;
  __syncthreads();
  unsigned long long mn = ~0ull;
  for (int e = threadIdx.x; e < count; e += THREADS) mn = min(mn, ord64(q.score[e]));
  atomicMin(&sh.min_key, mn);
  __syncthreads();
  return sh.min_key;
}

// One histogram round over entries [0, count): the new bound lo + (j << shift) (see above), and
// sh.m = the entries reaching it. At least `need` entries must reach lo. All threads call it.
__device__ unsigned long long hist_round(const PrunePool& q, PruneShared& sh, int count, unsigned long long lo,
                                         int shift, int need) {
  for (int e = threadIdx.x; e < count; e += THREADS) {
    const unsigned long long key = ord64(q.score[e]);
    if (key >= lo) {
      const unsigned long long bin = (key - lo) >> shift;
      atomicAdd(&sh.hist[bin < NB - 1 ? (int)bin : NB - 1], 1);
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int h[NB / 32], local = 0;
#pragma unroll
    for (int i = 0; i < NB / 32; ++i) {
      h[i] = sh.hist[lane * (NB / 32) + i];
      local += h[i];
      sh.hist[lane * (NB / 32) + i] = 0;  // ready for the next round (after a barrier)
    }
    int suf = local;  // entries in this lane's bins and above
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_down_sync(FULL, suf, o);
      if (lane + o < 32) suf += v;
    }
    const unsigned ok = __ballot_sync(FULL, suf >= need);
    const int top = ok ? 31 - __clz(ok) : 0;  // the highest lane whose suffix reaches `need`
    if (lane == top) {
      int run = suf - local, j = -1, m = 0;
#pragma unroll
      for (int i = NB / 32 - 1; i >= 0; --i) {
        run += h[i];
        if (j < 0 && run >= need) {
          j = lane * (NB / 32) + i;
          m = run;
        }
      }
      if (j < 0) {  // unreachable while the caller's promise holds; lo itself is then the bound
        j = 0;
        m = run;
      }
      sh.tau = lo + ((unsigned long long)j << shift);
      sh.m = m;
    }
  }
  __syncthreads();
  return sh.tau;
}

__device__ __forceinline__ int span_shift(unsigned long long lo, unsigned long long hi) {
  const int bits = hi > lo ? 64 - __clzll((long long)(hi - lo)) : 0;
  return max(0, bits - 8);  // (hi - lo) >> shift < NB
}

// Returns the number of nodes written into `s`, or -1 to fall back. All THREADS threads call it.
__device__ int prune_build(const Smem& s, const PrunePool& q, PruneShared& sh, int cap, int lcap, int kc,
                           int ks, int depth_limit, int budget) {
  const int tid = threadIdx.x, lane = tid & 31;
#if TREE_PROFILE
  int step = 8;  // the next profile slot (thread 0)
#define PRUNE_STAMP() \
  if (step < 32) TREE_STAMP(step++)
#else
#define PRUNE_STAMP()
#endif
  if (tid == 0) {
    sh.bad = 0;
    sh.count = kc;
    sh.n_list = 0;
  }
  for (int i = tid; i < NB; i += THREADS) sh.hist[i] = 0;
  __syncthreads();
  // Depth 1, all kc ranks at once (kc <= budget <= cap): there the sibling recurrence is exact,
  // (s - lq[r]) + lq[r+1] with s == lq[r] gives +0 + lq[r+1], so rank r > 0 scores 0.0 + lq[0][r].
  int bad1 = 0;
  for (int r = tid; r < kc; r += THREADS) {
    const double sc = r == 0 ? (double)s.lq[0] : __dadd_rn(0.0, (double)s.lq[r]);
    if (r > 0 && sc > (r == 1 ? (double)s.lq[0] : __dadd_rn(0.0, (double)s.lq[r - 1]))) bad1 = 1;
    q.score[r] = sc;
    q.parent[r] = -1;
    q.rank[r] = r;
    q.depth[r] = 1;
  }
  if (bad1) sh.bad = 1;
  __syncthreads();
  if (sh.bad) return -1;
  PRUNE_STAMP();  // depth 1
  // Depth 1 is sorted (checked above): its budget-th score is the budget-th best so far.
  unsigned long long tau = kc >= budget ? ord64(q.score[budget - 1]) : 0ull;
  const unsigned long long hi = ord64(q.score[0]);  // the best score of all (monotone)
  int begin = 0, end = kc, shift = -1;              // shift < 0: no histogram round yet
  for (int d = 2; d <= depth_limit; ++d) {
    const float* row = s.lq + (d - 1) * ks;
    int total = 0, bad = 0;
    for (int p = begin + tid; p < end; p += THREADS)
      total += walk_chain<false>(q, q.score[p], p, d, row, kc, tau, 0, bad);
    int incl = total;  // warp inclusive scan of the chain lengths, then one claim per warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(FULL, incl, o);
      if (lane >= o) incl += v;
    }
    int base = 0;
    if (lane == 31 && incl > 0) base = atomicAdd(&sh.count, incl);
    base = __shfl_sync(FULL, base, 31) + incl - total;
    if (base + total > cap) {
      bad = 1;  // the pool is full: store nothing
    } else if (total > 0) {
      for (int p = begin + tid; p < end; p += THREADS)
        base += walk_chain<true>(q, q.score[p], p, d, row, kc, tau, base, bad);
    }
    if (bad) sh.bad = 1;
    __syncthreads();
    const int count = sh.count;
    if (sh.bad) return -1;
    PRUNE_STAMP();  // depth d generated
    if (count == end) break;  // nothing at depth d: nothing deeper either
    begin = end;
    end = count;
    if (end >= budget) {
      const unsigned long long lo = tau ? tau : pool_min_key(q, sh, end);
      shift = span_shift(lo, hi);
      tau = hist_round(q, sh, end, lo, shift, budget);
      PRUNE_STAMP();  // its bound
    }
  }
  const int count = end, n = min(budget, count);
  if (count > budget) {  // narrow the bound, then list the entries reaching it
    if (shift < 0) {     // no round yet (cannot happen: count > budget needs a round), keep exact
      const unsigned long long lo = tau ? tau : pool_min_key(q, sh, count);
      shift = span_shift(lo, hi);
      tau = hist_round(q, sh, count, lo, shift, budget);
    }
    while (sh.m > budget + PRUNE_SLACK && shift > 0) {  // sh.m, shift: block-uniform
      shift = max(0, shift - 8);
      tau = hist_round(q, sh, count, tau, shift, budget);
    }
  } else {
    tau = 0ull;
  }
  PRUNE_STAMP();  // narrowed
  for (int e0 = tid - lane; e0 < count; e0 += THREADS) {  // warp-uniform trips
    const int e = e0 + lane;
    const unsigned long long key = e < count ? ord64(q.score[e]) : 0ull;
    const bool in = e < count && key >= tau;
    const unsigned in_mask = __ballot_sync(FULL, in);
    int at = 0;
    if (lane == 0 && in_mask) at = atomicAdd(&sh.n_list, __popc(in_mask));
    at = __shfl_sync(FULL, at, 0) + __popc(in_mask & ((1u << lane) - 1u));
    if (in) {
      q.list[at] = e;
      q.lkey[at] = key;
      q.node[e] = 0;
      if (at < lcap) {  // its rank-tuple code, from its ancestors (used if every listed entry has one)
        unsigned long long c0 = 0ull, c1 = 0ull, c2 = 0ull;  // scalars: an indexed array goes to local memory
        for (int a = e; a >= 0; a = q.parent[a]) {  // <= 16 steps
          const int dd = q.depth[a], w = code_word(dd);
          const unsigned long long f = field(dd, q.rank[a]);
          c0 |= w == 0 ? f : 0ull;
          c1 |= w == 1 ? f : 0ull;
          c2 |= w == 2 ? f : 0ull;
        }
        q.lcode[at * CODE_WORDS] = c0;
        q.lcode[at * CODE_WORDS + 1] = c1;
        q.lcode[at * CODE_WORDS + 2] = c2;
      }
    }
  }
  static_assert(CODE_WORDS == 3, "the code words above");
  __syncthreads();
  const int m = sh.n_list;
  PRUNE_STAMP();  // listed
  // Rank the listed entries by (key desc, rank tuple asc): entry i's node is 1 + the entries
  // before it. The m * m comparisons are spread over the block: `h` threads per entry, each
  // taking every h-th other entry, summed with shared atomics (a lone warp per scheduler pays
  // for every instruction it issues, so fewer per thread is what shortens this).
  const bool codes = m <= lcap;  // rank-tuple codes for ties; else pairs walk their ancestors
  const int h = m > 0 ? max(1, min(THREADS / m, 32)) : 1;
  for (int t = tid; t < m * h; t += THREADS) {
    const int i = t % m, part = t / m, e = q.list[i];
    const unsigned long long ke = q.lkey[i];
    int before = 0;
    if (codes) {  // one pass: a larger key, or an equal key with a smaller code (never i itself)
      const unsigned long long e0 = q.lcode[i * CODE_WORDS], e1 = q.lcode[i * CODE_WORDS + 1],
                               e2 = q.lcode[i * CODE_WORDS + 2];
#pragma unroll 4
      for (int x = part; x < m; x += h) {
        const unsigned long long kx = q.lkey[x];
        bool less = kx > ke;
        if (kx == ke) {
          const unsigned long long* cx = q.lcode + x * CODE_WORDS;
          less = cx[0] != e0 ? cx[0] < e0 : cx[1] != e1 ? cx[1] < e1 : cx[2] < e2;
        }
        before += less;
      }
    } else {
      for (int x = part; x < m; x += h) {
        const unsigned long long kx = q.lkey[x];
        before += kx > ke || (kx == ke && x != i && prune_tuple_less(q, q.list[x], e));
      }
    }
    if (before) atomicAdd(&q.node[e], before);
  }
  __syncthreads();
  PRUNE_STAMP();  // ranked
  for (int i = tid; i < m; i += THREADS) {  // the first n in that order are nodes 1..n
    const int e = q.list[i], node = q.node[e] + 1;
    if (node > n) continue;
    const int pe = q.parent[e], r = q.rank[e];
    const int p = pe < 0 ? 0 : q.node[pe] + 1;  // kept: the kept set is prefix-closed
    s.score[node] = q.score[e];
    s.parent[node] = p;
    s.rank[node] = r;
    s.depth[node] = q.depth[e];
    if (r == 0) s.first_child[p] = node;
    else s.next_sibling[q.node[e - 1] + 1] = node;  // chains are contiguous: e - 1 is sibling r - 1
  }
  PRUNE_STAMP();  // nodes written
#undef PRUNE_STAMP
#if TREE_PROFILE
  if (tid == 0 && blockIdx.x < 1024) {
    tree_prof[32 * blockIdx.x + 6] = count;
    tree_prof[32 * blockIdx.x + 7] = m;
  }
#endif
  return n;
}

// Output slot o: a node's fields, or with node = false the empty slot's (-1 everywhere, score NaN).
__device__ __forceinline__ void write_slot(long long o, bool node, int token, int parent, int depth, int position,
                                           double score, int fc, int ns, int* tokens, int* parents,
                                           int* node_depth, int* positions, double* scores, int* first_child,
                                           int* next_sibling) {
  tokens[o] = node ? token : -1;
  parents[o] = node ? parent : -1;
  node_depth[o] = node ? depth : -1;
  positions[o] = node ? position : -1;
  scores[o] = node ? score : __longlong_as_double(0x7ff8000000000000ll);
  first_child[o] = node ? fc : -1;
  next_sibling[o] = node ? ns : -1;
}

template <int J>  // the prune build first, the heap loop on fallback
__device__ __forceinline__ void build(const float* __restrict__ logq, const int* __restrict__ ids,
                                      int L, int K, const int* __restrict__ root_tokens,
                                      const int* __restrict__ budgets, const int* __restrict__ depths,
                                      const int* __restrict__ prefix_lens, int max_budget, int ks,
                                      int W, int cap, int* tokens, int* parents, int* node_depth,
                                      int* positions, int* num_nodes, unsigned long long* mask,
                                      int* first_child, int* next_sibling, double* scores) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int n_popped;
  __shared__ PruneShared prune_sh;
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
  int n_pruned = -1;
  if (budget > 0 && depth_limit > 0) {
    const int lcap = n_slots + PRUNE_LIST_EXTRA;
    const PrunePool q = carve_prune(reinterpret_cast<unsigned char*>(s.ids + L * ks), cap, lcap);
    n_pruned = prune_build(s, q, prune_sh, cap, lcap, kc, ks, depth_limit, budget);  // block-uniform
    if (tid == 0 && n_pruned >= 0) n_popped = n_pruned;
  }
  if (n_pruned < 0 && tid < 32) {
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
      write_slot(o, true, i == 0 ? root : s.ids[(d - 1) * ks + s.rank[i]], s.parent[i], d, prefix + d, s.score[i],
                 s.first_child[i], s.next_sibling[i], tokens, parents, node_depth, positions, scores, first_child,
                 next_sibling);
      for (int a = i; a >= 0; a = s.parent[a]) {  // ancestors, self included (<= 17 steps)
#pragma unroll
        for (int w = 0; w < MAX_WORDS; ++w)
          if (w == (a >> 6)) words[w] |= 1ull << (a & 63);
      }
    } else {
      write_slot(o, false, 0, 0, 0, 0, 0.0, 0, 0, tokens, parents, node_depth, positions, scores, first_child,
                 next_sibling);
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
// Outputs [B, 1 + max_budget] (mask [B, 1 + max_budget, W]). Grid B, block TREE_THREADS, dynamic
// shared memory (1 + max_budget) * 76 + L * ks * 8 bytes, ks = max(1, min(K, max_budget)), plus
// cap * 36 + 8 + (max_budget + 64) * 24 for the candidate pool.
#define TREE_BUILD_ENTRY(NAME, J)                                                                  \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                    \
      const float* __restrict__ logq, const int* __restrict__ ids, int L, int K,                    \
      const int* __restrict__ root_tokens, const int* __restrict__ budgets,                         \
      const int* __restrict__ depths, const int* __restrict__ prefix_lens, int max_budget, int ks,  \
      int W, int cap, int* tokens, int* parents, int* node_depth, int* positions, int* num_nodes,   \
      unsigned long long* mask, int* first_child, int* next_sibling, double* scores) {              \
    build<J>(logq, ids, L, K, root_tokens, budgets, depths, prefix_lens, max_budget, ks, W,  \
                    cap, tokens, parents, node_depth, positions, num_nodes, mask, first_child,      \
                    next_sibling, scores);                                                          \
  }

TREE_BUILD_ENTRY(tree_build_prune_j3, 3)
TREE_BUILD_ENTRY(tree_build_prune_j9, 9)
TREE_BUILD_ENTRY(tree_build_prune_j17, 17)
