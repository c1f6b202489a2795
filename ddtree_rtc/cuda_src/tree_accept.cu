// DDTree acceptance walk (docs/architecture.md section 1, step 5), same rules as
// ddtree_rtc/reference/tree_accept.py: from the root, move to the child whose token equals the
// target's choice at the current node (lowest node index if several would); the first unmatched
// choice is the bonus token. One warp per request, four requests per block.
//
// tree_accept_table_kernel: every load (num_nodes included) is issued at once into registers, so the
// kernel makes one dependent trip to memory; each node v then offers itself to its parent u (u < v,
// tokens[v] == choices[u]) by a shared atomicMin into next[u], and the walk is a chain of at most
// max_depth shared loads. (Variants tried and dropped: benchmarks/README.md.)
namespace {

constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
constexpr int MAX_SLOTS = 513;  // 1 + the largest budget
constexpr int SLOTS_PER_LANE = (MAX_SLOTS + 31) / 32;
constexpr unsigned FULL = 0xffffffffu;
constexpr int NONE = 0x7fffffff;

}  // namespace

// The outputs from the finished walk: lane k holds the k-th accepted node (my_node), the
// walk ended at a node whose choice is the bonus token. Every lane of the warp calls it.
__device__ __forceinline__ void write_walk(const int* tok, int bon, int my_node, int len, int b, int lane,
                                           int width, int* __restrict__ accepted, int* __restrict__ accept_len,
                                           int* __restrict__ emitted, int* __restrict__ bonus) {
  const int next_node = __shfl_down_sync(FULL, my_node, 1);
  if (lane < width) {
    const long long o = (long long)b * width + lane;
    accepted[o] = lane < len ? my_node : -1;
    emitted[o] = lane < len - 1 ? tok[next_node] : (lane == len - 1 ? bon : -1);
  }
  if (lane == 0) {
    accept_len[b] = len;
    bonus[b] = bon;
  }
}

// tokens, parents, choices [B, n_slots] int32; num_nodes [B]; width = max_depth + 1 <= 17.
// Outputs: accepted, emitted [B, width] (-1 padded), accept_len, bonus [B]. Grid ceil(B / 4), block 128.
extern "C" __global__ void __launch_bounds__(THREADS, 1) tree_accept_table_kernel(
    const int* __restrict__ tokens, const int* __restrict__ parents, const int* __restrict__ num_nodes,
    const int* __restrict__ choices, int B, int n_slots, int width, int* __restrict__ accepted,
    int* __restrict__ accept_len, int* __restrict__ emitted, int* __restrict__ bonus) {
  __shared__ int tok[WARPS][MAX_SLOTS], cho[WARPS][MAX_SLOTS], next[WARPS][MAX_SLOTS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x * WARPS + warp;
  if (b >= B) return;  // the whole warp leaves; nothing below synchronises the block
  const long long base = (long long)b * n_slots;
  const int nn_raw = num_nodes[b];
  int t[SLOTS_PER_LANE], p[SLOTS_PER_LANE], c[SLOTS_PER_LANE];
#pragma unroll
  for (int j = 0; j < SLOTS_PER_LANE; ++j) {
    const int i = lane + 32 * j;
    if (i < n_slots) {
      t[j] = tokens[base + i];
      p[j] = parents[base + i];
      c[j] = choices[base + i];
    }
  }
  const int nn = min(max(nn_raw, 1), n_slots);
#pragma unroll
  for (int j = 0; j < SLOTS_PER_LANE; ++j) {
    const int i = lane + 32 * j;
    if (i < nn) {
      tok[warp][i] = t[j];
      cho[warp][i] = c[j];
      next[warp][i] = NONE;
    }
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < SLOTS_PER_LANE; ++j) {
    const int i = lane + 32 * j;
    if (i < nn) {
      const int u = p[j];
      if (u >= 0 && u < i && t[j] == cho[warp][u]) atomicMin(&next[warp][u], i);
    }
  }
  __syncwarp();

  int u = 0, len = 1, my_node = lane == 0 ? 0 : -1;  // lane k holds the k-th accepted node
  while (len < width) {
    const int v = next[warp][u];
    if (v == NONE) break;
    if (lane == len) my_node = v;
    ++len;
    u = v;
  }
  write_walk(tok[warp], cho[warp][u], my_node, len, b, lane, width, accepted, accept_len, emitted, bonus);
}
