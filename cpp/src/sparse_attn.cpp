// infllmv2_sparse_attn_{fwd,bwd}: validation and dispatch over the generated sparse_attn units.
#include <cstdint>
#include <cstring>
#include <string>

#include "registry.h"
#include "runtime.h"

using namespace infllmv2;

namespace {

constexpr int kBlock = 64;   // keys per selected block
constexpr int kMaxTopk = 128;  // entries per selection row the kernels hold in shared memory
constexpr int kChunks = 64;  // slices of a sequence's queries counted apart by bwd_members (dsl CHUNKS)
// bwd_dkdv shares the first kSplitBlocks key blocks of sequences of more than kPiece queries
// among thread blocks of kPiece packed query rows each (dsl SPLIT_BLOCKS, PIECE)
constexpr int kSplitBlocks = 4;
constexpr int kPiece = 8192;
constexpr int kMaxHeadDim = 128;

struct Shape {
  int32_t batch;
  int64_t total_q, total_k;
  int32_t max_seqlen_q, max_seqlen_k, heads, heads_k, head_dim, topk;
  infllmv2_dtype dtype;
  float softmax_scale;
};

infllmv2_status check_shape(const char* op, const Shape& s) {
  infllmv2_status st = check_group_layout(op, s.dtype, s.head_dim, s.batch, s.heads, s.heads_k);
  if (st != INFLLMV2_OK) return st;
  if (s.topk < 1 || s.topk > kMaxTopk)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: topk must be in [1, %d], got %d", op, kMaxTopk, s.topk);
  return check_attn_sizes(op, s.total_q, s.total_k, s.max_seqlen_q, s.max_seqlen_k, s.softmax_scale);
}

float scale_log2(const Shape& s) { return attn_scale_log2(s.softmax_scale, s.head_dim); }

std::string desc(const Shape& s) {
  return config_desc(s.dtype, s.head_dim);
}

template <class Unit>
auto matcher(const Shape& s) {
  return [&s](const Unit& u) { return u.dtype == s.dtype && u.head_dim == s.head_dim; };
}

// Of the units in `table` that `serves`, the one whose `key` is largest among its arch's.
template <class Unit, class Serves, class Key>
auto largest_serving(const Unit* table, Serves serves, Key key) {
  return [table, serves, key](const Unit& u) {
    if (!serves(u)) return false;
    for (const Unit* o = table; o->name != nullptr; ++o)
      if (std::strcmp(o->arch, u.arch) == 0 && key(*o) > key(u) && serves(*o)) return false;
    return true;
  };
}

// An arch may have, besides the forward and dQ units for every group size, one with smaller
// tiles for large groups (min_groups > 1: the forward's runs two tiles a cluster, dQ's fits more
// tiles an SM): of an arch's units in `table` that serve the group size, the one with the
// largest min_groups.
template <class Unit>
auto group_matcher(const Shape& s, const Unit* table) {
  return largest_serving(
      table,
      [&s](const Unit& u) {
        return u.dtype == s.dtype && u.head_dim == s.head_dim && s.heads / s.heads_k >= u.min_groups;
      },
      [](const Unit& u) { return u.min_groups; });
}

// dK/dV: an arch may have, besides the unit for every group size (boxes 0), one for G = boxes
// (its rows load as TMA boxes of one token's heads): that one where G equals its boxes.
template <class Unit>
auto boxes_matcher(const Shape& s, const Unit* table) {
  return largest_serving(
      table,
      [&s](const Unit& u) {
        return u.dtype == s.dtype && u.head_dim == s.head_dim && (u.boxes == 0 || u.boxes == s.heads / s.heads_k);
      },
      [](const Unit& u) { return u.boxes; });
}

// Query tiles of T tokens covering the longest sequence, rounded up to whole clusters.
int query_tiles(int32_t max_seqlen_q, int T, int cluster) {
  const int tiles = (max_seqlen_q + T - 1) / T;
  return (tiles + cluster - 1) / cluster * cluster;
}

}  // namespace

extern "C" INFLLMV2_API infllmv2_status infllmv2_sparse_attn_fwd(
    const void* q, const void* k, const void* v, const int32_t* topk_idx, const int32_t* cu_seqlens_q,
    const int32_t* cu_seqlens_k, void* out, float* lse, int32_t batch, int64_t total_q, int64_t total_k,
    int32_t max_seqlen_q, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t topk, infllmv2_dtype dtype,
    float softmax_scale, cudaStream_t stream) {
  static const char* op = "infllmv2_sparse_attn_fwd";
  clear_error();
  Shape s{batch, total_q, total_k, max_seqlen_q, 0, heads, heads_k, head_dim, topk, dtype, softmax_scale};
  infllmv2_status st = check_shape(op, s);
  if (st != INFLLMV2_OK) return st;
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 &&
      (st = check_device_pointers(op, dev, {{"q", q}, {"topk_idx", topk_idx}, {"out", out}, {"lse", lse}})) != INFLLMV2_OK)
    return st;
  if (total_k > 0 && (st = check_device_pointers(op, dev, {{"k", k}, {"v", v}})) != INFLLMV2_OK) return st;
  // rows move by 16-byte vector loads and stores, K/V blocks by TMA on sm_90a
  if ((st = check_aligned(op, {{"q", q}, {"k", k}, {"v", v}, {"out", out}})) != INFLLMV2_OK) return st;

  const infllmv2_sparse_attn_fwd_unit* unit = nullptr;
  st = pick_unit(op, infllmv2_sparse_attn_fwd_units, dev, group_matcher(s, infllmv2_sparse_attn_fwd_units), desc(s),
                 &unit);
  if (st != INFLLMV2_OK || total_q == 0 || max_seqlen_q == 0) return st;
  const int groups = heads / heads_k, T = tile_tokens(unit->block_m, unit->t_max, groups);
  int rc = unit->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<int32_t*>(topk_idx),
                      const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k), out, lse, batch,
                      query_tiles(max_seqlen_q, T, unit->cluster), groups, T, scale_log2(s), (int)total_q, heads,
                      (int)total_k, heads_k, topk, batch + 1, stream);
  return launch_result(op, unit->name, rc, unit->last_error);
}

namespace {

// Workspace, each region at a 256-byte boundary: Delta (attn_delta_bytes); each query row's
// (LSE, Delta) pair, fp32 (total_q, heads, 2), which bwd_dkdv reads; bwd_members' int32
// counts (heads_k, kChunks, n_gb), the lists' offsets (heads_k, n_gb + 1) and the lists
// (heads_k, total_q * topk), where n_gb = total_k / kBlock + batch indexes every sequence's
// key blocks and one spare (see dsl bwd_members); then, where a sequence may have more than
// kPiece queries, bwd_dkdv's partial dK/dV: fp32 (kSplitBlocks, heads_k, pieces of the packed
// queries, 2 sides, dK/dV, kBlock, head_dim), sized for head_dim 128.
int64_t key_block_indices(int64_t total_k, int32_t batch) { return total_k / kBlock + batch; }
int64_t packed_pieces(int64_t total_q) { return (total_q + kPiece - 1) / kPiece; }
size_t partial_bytes(int64_t total_q, int32_t heads_k) {
  if (total_q <= kPiece) return 0;  // no sequence is long enough to be split
  return (size_t)kSplitBlocks * heads_k * packed_pieces(total_q) * 2 * 2 * kBlock * kMaxHeadDim * sizeof(float);
}

// Byte offsets of the regions above (partial 0 when there is none) and the total.
struct BwdLayout {
  size_t stats, counts, offsets, members, partial, total;
};
// Where the rows' (LSE, Delta) pairs start (after Delta) and end: the whole workspace when
// there is no member index.
size_t stats_start(int64_t total_q, int32_t heads) { return align256(attn_delta_bytes(total_q, heads)); }
size_t stats_end(int64_t total_q, int32_t heads) {
  return stats_start(total_q, heads) + (size_t)total_q * (size_t)heads * 2 * sizeof(float);
}
BwdLayout bwd_layout(int64_t total_q, int64_t total_k, int32_t batch, int32_t heads, int32_t heads_k, int32_t topk) {
  BwdLayout l;
  const size_t n_gb = (size_t)key_block_indices(total_k, batch);
  l.stats = stats_start(total_q, heads);
  l.counts = align256(stats_end(total_q, heads));
  l.offsets = align256(l.counts + (size_t)heads_k * kChunks * n_gb * sizeof(int32_t));
  l.members = align256(l.offsets + (size_t)heads_k * (n_gb + 1) * sizeof(int32_t));
  const size_t members_end = l.members + (size_t)heads_k * (size_t)total_q * (size_t)topk * sizeof(int32_t);
  const size_t partial = partial_bytes(total_q, heads_k);
  l.partial = partial ? align256(members_end) : 0;
  l.total = partial ? l.partial + partial : members_end;
  return l;
}

}  // namespace

extern "C" INFLLMV2_API size_t infllmv2_sparse_attn_bwd_workspace_size(int64_t total_q, int64_t total_k, int32_t batch,
                                                                       int32_t heads, int32_t heads_k, int32_t topk) {
  if (total_q <= 0 || heads <= 0) return 0;
  // no key block or no selection: no index
  if (heads_k <= 0 || total_k <= 0 || batch <= 0 || topk <= 0) return stats_end(total_q, heads);
  return bwd_layout(total_q, total_k, batch, heads, heads_k, topk).total;
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_sparse_attn_bwd(
    const void* q, const void* k, const void* v, const void* out, const void* dout, const float* lse,
    const int32_t* topk_idx, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, void* dq, void* dk, void* dv,
    void* workspace, size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
    int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t topk, infllmv2_dtype dtype,
    float softmax_scale, cudaStream_t stream) {
  static const char* op = "infllmv2_sparse_attn_bwd";
  clear_error();
  Shape s{batch, total_q, total_k, max_seqlen_q, max_seqlen_k, heads, heads_k, head_dim, topk, dtype, softmax_scale};
  infllmv2_status st = check_shape(op, s);
  if (st != INFLLMV2_OK) return st;
  // the index's list positions are int32
  if (total_q * (int64_t)topk > INT32_MAX)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: total_q * topk must be at most %d, got %lld", op, INT32_MAX,
                (long long)(total_q * (int64_t)topk));
  const size_t need = infllmv2_sparse_attn_bwd_workspace_size(total_q, total_k, batch, heads, heads_k, topk);
  if (workspace_size < need)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: workspace_size is %zu bytes, infllmv2_sparse_attn_bwd_workspace_size() asks for %zu", op,
                workspace_size, need);
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(op, dev, {{"q", q}, {"out", out}, {"dout", dout}, {"lse", lse},
                                                    {"topk_idx", topk_idx}, {"dq", dq}, {"workspace", workspace}})) !=
                         INFLLMV2_OK)
    return st;
  if (total_k > 0 && (st = check_device_pointers(op, dev, {{"k", k}, {"v", v}, {"dk", dk}, {"dv", dv}})) != INFLLMV2_OK)
    return st;
  if ((st = check_aligned(op, {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"dout", dout}, {"dq", dq}, {"dk", dk},
                               {"dv", dv}})) != INFLLMV2_OK)
    return st;

  const infllmv2_sparse_attn_bwd_preprocess_unit* pre = nullptr;
  const infllmv2_sparse_attn_bwd_dq_unit* udq = nullptr;
  const infllmv2_sparse_attn_bwd_dkdv_unit* udkdv = nullptr;
  const infllmv2_sparse_attn_bwd_members_unit* umem = nullptr;
  const infllmv2_sparse_attn_bwd_members_scan_unit* uscan = nullptr;
  const infllmv2_sparse_attn_bwd_dkdv_reduce_unit* ured = nullptr;
  if ((st = pick_unit(op, infllmv2_sparse_attn_bwd_members_units, dev,
                      [](const infllmv2_sparse_attn_bwd_members_unit&) { return true; }, "member index", &umem)) !=
          INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_sparse_attn_bwd_members_scan_units, dev,
                      [](const infllmv2_sparse_attn_bwd_members_scan_unit&) { return true; }, "member index", &uscan)) !=
          INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_sparse_attn_bwd_preprocess_units, dev,
                      matcher<infllmv2_sparse_attn_bwd_preprocess_unit>(s), desc(s), &pre)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_sparse_attn_bwd_dq_units, dev, group_matcher(s, infllmv2_sparse_attn_bwd_dq_units),
                      desc(s), &udq)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_sparse_attn_bwd_dkdv_units, dev,
                      boxes_matcher(s, infllmv2_sparse_attn_bwd_dkdv_units), desc(s), &udkdv)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_sparse_attn_bwd_dkdv_reduce_units, dev,
                      matcher<infllmv2_sparse_attn_bwd_dkdv_reduce_unit>(s), desc(s), &ured)) != INFLLMV2_OK)
    return st;
  if (umem->chunks != kChunks || uscan->chunks != kChunks)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s / %s count %d / %d slices a sequence, this library expects %d", op,
                umem->name, uscan->name, umem->chunks, uscan->chunks, kChunks);
  if (udkdv->split_blocks != kSplitBlocks || udkdv->piece != kPiece)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s splits %d key blocks in pieces of %d queries, this library expects %d, %d",
                op, udkdv->name, udkdv->split_blocks, udkdv->piece, kSplitBlocks, kPiece);
  if (total_k > 0 && max_seqlen_k > 0 && (total_q == 0 || max_seqlen_q == 0)) {
    // No query saw any key: the key gradients are zero, and no kernel would write them.
    const size_t bytes = (size_t)total_k * heads_k * head_dim * 2;
    cudaError_t e1 = cudaMemsetAsync(dk, 0, bytes, stream), e2 = cudaMemsetAsync(dv, 0, bytes, stream);
    if (e1 != cudaSuccess || e2 != cudaSuccess)
      return fail(INFLLMV2_ERR_CUDA, "%s: zeroing dk/dv failed: %s", op, cudaGetErrorString(e1 != cudaSuccess ? e1 : e2));
    return INFLLMV2_OK;
  }
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;
  float* delta = static_cast<float*>(workspace);
  const int groups = heads / heads_k;
  const float sl2 = scale_log2(s);
  const bool keys = total_k > 0 && max_seqlen_k > 0;
  const BwdLayout l = bwd_layout(total_q, total_k, batch, heads, heads_k, topk);
  char* ws = static_cast<char*>(workspace);
  float* stats = reinterpret_cast<float*>(ws + l.stats);
  int32_t* counts = reinterpret_cast<int32_t*>(ws + l.counts);
  int32_t* offsets = reinterpret_cast<int32_t*>(ws + l.offsets);
  int32_t* members = reinterpret_cast<int32_t*>(ws + l.members);
  const int n_gb = (int)key_block_indices(total_k, batch), n_entries = (int)(total_q * topk);
  const int max_kblocks = (max_seqlen_k + kBlock - 1) / kBlock;
  // bwd_members reads only the selections. Where a second stream can be had it builds the
  // member lists there, beside bwd_preprocess and bwd_dq, and bwd_dkdv waits for it: its three
  // launches are latency-bound (a few thread blocks an SM, one barrier a query row) and took
  // 1.7 ms at 32K x 8 and 3.0 ms at 128K x 2 in line. Beside them bwd_dq runs up to 3 ms
  // slower, so the backward gains less (H100, median of 5: 131.9 -> 129.3 ms at 128K x 2,
  // unchanged at 32K x 8).
  // Once the lists are launched on the side stream, the caller's stream waits for them before
  // bwd_dkdv and on every way out, an error's included: they write into the caller's workspace.
  SideBranch lists(stream);
  if (keys) {
    cudaStream_t ms = stream;
    if (cudaError_t e = lists.fork(dev.index, &ms); e != cudaSuccess)
      return fail(INFLLMV2_ERR_CUDA, "%s: forking the member-list stream failed: %s", op, cudaGetErrorString(e));
    // a sequence owns its key blocks' indices and one spare
    const int windows = (max_kblocks + 1 + umem->window - 1) / umem->window;
    // count (fill 0), turn the counts into list slots, write the lists (fill 1)
    auto members_pass = [&](int fill) {
      return umem->call(const_cast<int32_t*>(topk_idx), const_cast<int32_t*>(cu_seqlens_q),
                        const_cast<int32_t*>(cu_seqlens_k), counts, members, batch, windows, fill, heads_k,
                        (int)total_q, topk, batch + 1, n_gb, n_entries, ms);
    };
    if ((st = launch_result(op, umem->name, members_pass(0), umem->last_error)) != INFLLMV2_OK) return st;
    int rc = uscan->call(counts, offsets, const_cast<int32_t*>(cu_seqlens_k), batch, heads_k, n_gb, batch + 1, ms);
    if ((st = launch_result(op, uscan->name, rc, uscan->last_error)) != INFLLMV2_OK) return st;
    if ((st = launch_result(op, umem->name, members_pass(1), umem->last_error)) != INFLLMV2_OK) return st;
  }
  int rc = pre->call(const_cast<void*>(out), const_cast<void*>(dout), const_cast<float*>(lse), delta, stats,
                     (int)total_q, heads, stream);
  if ((st = launch_result(op, pre->name, rc, pre->last_error)) != INFLLMV2_OK) return st;
  int T = tile_tokens(udq->block_m, udq->t_max, groups);
  rc = udq->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(dout),
                 const_cast<float*>(lse), delta, const_cast<int32_t*>(topk_idx), const_cast<int32_t*>(cu_seqlens_q),
                 const_cast<int32_t*>(cu_seqlens_k), dq, batch, query_tiles(max_seqlen_q, T, udq->cluster), groups, T, sl2,
                 (int)total_q, heads, (int)total_k, heads_k, topk, batch + 1, stream);
  if ((st = launch_result(op, udq->name, rc, udq->last_error)) != INFLLMV2_OK) return st;
  if (!keys) return INFLLMV2_OK;
  if (cudaError_t e = lists.join(); e != cudaSuccess)
    return fail(INFLLMV2_ERR_CUDA, "%s: joining the member-list stream failed: %s", op, cudaGetErrorString(e));
  T = tile_tokens(udkdv->block_m, udkdv->t_max, groups);
  // a sequence of L > kPiece queries overlaps at most ceil(L / kPiece) + 1 pieces
  const bool split = max_seqlen_q > kPiece && total_q > kPiece;
  const int pieces = split ? (max_seqlen_q + kPiece - 1) / kPiece + 1 : 1;
  // split implies total_q > kPiece, so the layout has the partial slots
  float* partial = split ? reinterpret_cast<float*>(static_cast<char*>(workspace) + l.partial)
                         : delta;  // never indexed: with pieces == 1 the kernel splits nothing
  const int n_pieces = split ? (int)packed_pieces(total_q) : 1;
  rc = udkdv->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(dout),
                   stats, offsets, members, const_cast<int32_t*>(cu_seqlens_q),
                   const_cast<int32_t*>(cu_seqlens_k), dk, dv, partial, batch, max_kblocks, pieces, groups, T, sl2,
                   (int)total_q, heads, (int)total_k, heads_k, n_gb + 1, n_entries, batch + 1, n_pieces, stream);
  if ((st = launch_result(op, udkdv->name, rc, udkdv->last_error)) != INFLLMV2_OK || !split) return st;
  rc = ured->call(partial, const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k), dk, dv, batch,
                  (int)total_q, heads_k, n_pieces, batch + 1, (int)total_k, stream);
  return launch_result(op, ured->name, rc, ured->last_error);
}
