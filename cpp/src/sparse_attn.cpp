// infllmv2_sparse_attn_{fwd,bwd}: validation and dispatch over the generated sparse_attn units.
#include <cstring>
#include <string>

#include "registry.h"
#include "runtime.h"

using namespace infllmv2;

namespace {

constexpr int kBlock = 64;   // keys per selected block
constexpr int kMaxTopk = 128;  // entries per selection row the kernels hold in shared memory
constexpr int kMapChunk = 64;  // selection rows per entry of the block map (dsl MAP_CHUNK)
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

int tile_tokens(int block_m, int t_max, int groups) {
  int t = block_m / groups;
  return t < t_max ? t : t_max;
}

std::string desc(const Shape& s) {
  return std::string("dtype=") + dtype_name(s.dtype) + " head_dim=" + std::to_string(s.head_dim);
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

// Workspace: Delta (attn_delta_bytes), then at a 256-byte boundary the block map of
// bwd_block_map, int32 (heads_k, chunks, words), then at a 256-byte boundary, where a sequence
// may have more than kPiece queries, bwd_dkdv's partial dK/dV: fp32 (kSplitBlocks, heads_k,
// pieces of the packed queries, 2 sides, dK/dV, kBlock, head_dim), sized for head_dim 128.
int64_t map_chunks(int64_t total_q, int map_chunk) { return (total_q + map_chunk - 1) / map_chunk; }
int64_t map_words(int32_t max_seqlen_k) { return ((int64_t)max_seqlen_k + kBlock * 32 - 1) / (kBlock * 32); }
size_t map_bytes(int64_t total_q, int32_t heads_k, int32_t max_seqlen_k) {
  return (size_t)heads_k * (size_t)map_chunks(total_q, kMapChunk) * (size_t)map_words(max_seqlen_k) * sizeof(int32_t);
}
int64_t packed_pieces(int64_t total_q) { return (total_q + kPiece - 1) / kPiece; }
size_t partial_bytes(int64_t total_q, int32_t heads_k) {
  if (total_q <= kPiece) return 0;  // no sequence is long enough to be split
  return (size_t)kSplitBlocks * heads_k * packed_pieces(total_q) * 2 * 2 * kBlock * kMaxHeadDim * sizeof(float);
}

// Byte offsets of the regions above (partial 0 when there is none) and the total.
struct BwdLayout {
  size_t map, partial, total;
};
BwdLayout bwd_layout(int64_t total_q, int32_t heads, int32_t heads_k, int32_t max_seqlen_k) {
  BwdLayout l;
  l.map = align256(attn_delta_bytes(total_q, heads));
  const size_t map_end = l.map + map_bytes(total_q, heads_k, max_seqlen_k);
  const size_t partial = partial_bytes(total_q, heads_k);
  l.partial = partial ? align256(map_end) : 0;
  l.total = partial ? l.partial + partial : map_end;
  return l;
}

}  // namespace

extern "C" INFLLMV2_API size_t infllmv2_sparse_attn_bwd_workspace_size(int64_t total_q, int32_t heads, int32_t heads_k,
                                                                       int32_t max_seqlen_k) {
  if (total_q <= 0 || heads <= 0) return 0;
  if (heads_k <= 0 || max_seqlen_k <= 0) return attn_delta_bytes(total_q, heads);  // no key block: no map
  return bwd_layout(total_q, heads, heads_k, max_seqlen_k).total;
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
  const size_t need = infllmv2_sparse_attn_bwd_workspace_size(total_q, heads, heads_k, max_seqlen_k);
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
  const infllmv2_sparse_attn_bwd_block_map_unit* umap = nullptr;
  const infllmv2_sparse_attn_bwd_dkdv_reduce_unit* ured = nullptr;
  if ((st = pick_unit(op, infllmv2_sparse_attn_bwd_block_map_units, dev,
                      [](const infllmv2_sparse_attn_bwd_block_map_unit&) { return true; }, "block map", &umap)) !=
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
  if (umap->map_chunk != kMapChunk)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s maps %d rows a chunk, this library expects %d", op, umap->name,
                umap->map_chunk, kMapChunk);
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
  int rc = pre->call(const_cast<void*>(out), const_cast<void*>(dout), delta, (int)total_q, heads, stream);
  if ((st = launch_result(op, pre->name, rc, pre->last_error)) != INFLLMV2_OK) return st;
  int T = tile_tokens(udq->block_m, udq->t_max, groups);
  rc = udq->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(dout),
                 const_cast<float*>(lse), delta, const_cast<int32_t*>(topk_idx), const_cast<int32_t*>(cu_seqlens_q),
                 const_cast<int32_t*>(cu_seqlens_k), dq, batch, query_tiles(max_seqlen_q, T, udq->cluster), groups, T, sl2,
                 (int)total_q, heads, (int)total_k, heads_k, topk, batch + 1, stream);
  if ((st = launch_result(op, udq->name, rc, udq->last_error)) != INFLLMV2_OK) return st;
  if (total_k == 0 || max_seqlen_k == 0) return INFLLMV2_OK;
  const BwdLayout l = bwd_layout(total_q, heads, heads_k, max_seqlen_k);
  int32_t* map = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + l.map);
  const int chunks = (int)map_chunks(total_q, kMapChunk), words = (int)map_words(max_seqlen_k);
  rc = umap->call(const_cast<int32_t*>(topk_idx), map, heads_k, (int)total_q, topk, chunks, words, stream);
  if ((st = launch_result(op, umap->name, rc, umap->last_error)) != INFLLMV2_OK) return st;
  T = tile_tokens(udkdv->block_m, udkdv->t_max, groups);
  // a sequence of L > kPiece queries overlaps at most ceil(L / kPiece) + 1 pieces
  const bool split = max_seqlen_q > kPiece && total_q > kPiece;
  const int pieces = split ? (max_seqlen_q + kPiece - 1) / kPiece + 1 : 1;
  // split implies total_q > kPiece, so the layout has the partial slots
  float* partial = split ? reinterpret_cast<float*>(static_cast<char*>(workspace) + l.partial)
                         : delta;  // never indexed: with pieces == 1 the kernel splits nothing
  const int n_pieces = split ? (int)packed_pieces(total_q) : 1;
  rc = udkdv->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(dout),
                   const_cast<float*>(lse), delta, const_cast<int32_t*>(topk_idx), map,
                   const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k), dk, dv, partial, batch,
                   (max_seqlen_k + kBlock - 1) / kBlock, pieces, groups, T, sl2, (int)total_q, heads, (int)total_k,
                   heads_k, topk, chunks, words, batch + 1, n_pieces, stream);
  if ((st = launch_result(op, udkdv->name, rc, udkdv->last_error)) != INFLLMV2_OK || !split) return st;
  rc = ured->call(partial, const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k), dk, dv, batch,
                  (int)total_q, heads_k, n_pieces, batch + 1, (int)total_k, stream);
  return launch_result(op, ured->name, rc, ured->last_error);
}
