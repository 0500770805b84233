/* kv_paris.h: the kernels of ParisKV's top-k retrieval (kv.decode=paris,
 * engine/kv/kv_decode_paris.c; notes in docs/STRATEGIES.md §2), one table of function pointers
 * per backend: the CPU reference (kernels/cpu/kv_paris.c, plain C) and the CUDA kernels
 * (kernels/cuda/kv_paris.cu: the same operations in the same order, so the same bits for codes,
 * tiers, votes and estimates, up to the compilers' library sqrt, and the same selection). The exact
 * attention over the chosen positions is the backend's attention_spans (backend.h); these
 * kernels only encode keys and produce the spans.
 *
 * Encoding of one key k (head_dim d, a power of two >= 8; B = d / 8 blocks of m = 8):
 *   k^ = k / |k|; k~ = H diag(s) k^ / sqrt(d)   (SRHT, one round: the signs s in {+1,-1}^d come
 *   from kvs_paris_signs(seed), then a fast Walsh-Hadamard transform, normalized so that it is
 *   orthogonal: norms and inner products are preserved);
 *   per block b: cid_b = bit j set when k~_b[j] < 0 (the analytic centroid {+-1/sqrt 8}^8 of
 *   that sign pattern); r_b = |k~_b|; u = k~_b / r_b; per coordinate a 4-bit code = (sign << 3)
 *   | t, t the 3-bit Lloyd-Max index of |u_j| (KVS_PARIS_LM_THRESH), whose value is v_j =
 *   +-KVS_PARIS_LM_CENTER[t]; alpha_b = <v, u>; weight w_b = |k| r_b / alpha_b (0 when r_b or
 *   alpha_b is 0). A zero key encodes as all zeros (w = 0).
 * Estimate of <k, qbar> for a query q~ = SRHT(qbar / |qbar|) in blocks q_b:
 *   est = |qbar| sum_b w_b <v_b, q_b>.  With v = u (no quantization, kvs_paris_estimate_u) this
 *   is |qbar| |k| sum_b r_b <u_b, q_b> = <k, qbar> up to rounding.
 *
 * Layout (per layer; slot = physical KV slot = block * block_size + offset, so the index is
 * paged exactly like the K/V it describes and is rewritten whenever a request (re)encodes its
 * positions; the encoding is a pure function of the key, so prefix-shared blocks get the same
 * bytes from every request that encodes them):
 *   codes I32 [n_slots][n_kv_heads][W], W = kvs_paris_words(d): bytes 0 .. B-1 the cluster
 *         ids, bytes B .. B + d/2 - 1 the 4-bit codes (coordinate 2i in the low nibble of byte
 *         B + i, 2i + 1 in the high nibble), little-endian within each word;
 *   w     F32 [n_slots][n_kv_heads][B] (fp32 on every backend, so CPU and CUDA select alike);
 *   counts I32 [max_slots][n_layers][n_kv_heads][B][256]: per request slot, how many of its
 *         encoded keys fall into each (block, centroid), the input of the coarse vote.
 *
 * Coarse vote (the [code] variant of STRATEGIES.md: TIERS WEIGHTED BY KEY COUNT, not "top-rho
 * centroids"; chosen because it adapts the centroids kept to how the keys spread over them):
 *   per block b, cluster scores s_c = <q_b, sign_c>, ordered descending (ties: lower c first);
 *   cum(c) = keys of the request in clusters ordered before c; tier threshold T_j =
 *   ceil(n_r rho t_j), t = {.05, .15, .30, .50, .75, 1}; c scores #{j : cum(c) < T_j} (0..6);
 *   vote(i) = sum over b of the score of cid_{i,b} (0 .. 6B).
 * Selection, per decode row and KV head (the group's query heads share one selection because
 * they share the K/V that is read; qbar is the mean of the group's post-RoPE query rows):
 *   keep the top ceil(beta n_r) retrieval tokens by vote (ties: lower position), rerank them by
 *   est, keep the top min(topk, that) by est (ties: lower position; floats compare as
 *   kvs_paris_order_key). Spans (backend.h kvs_span_list), ascending and merged when adjacent:
 *   [0, sink) + each chosen position + [sink + n_r, ctx). The retrieval zone of a row is
 *   positions [sink, sink + n_r); everything after it (local window and update buffer) is
 *   always attended.
 *
 * Ownership: the tables are static; buffers are the caller's. Errors: ops return void (bad
 * arguments are bugs); kvs_paris_kernels_for returns NULL with a message (-ENOSYS).
 */
#ifndef KVS_KV_PARIS_H
#define KVS_KV_PARIS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVS_PARIS_M 8            /* block length */
#define KVS_PARIS_NC 256         /* centroids per block (2^M sign patterns) */
#define KVS_PARIS_TIERS 6
#define KVS_PARIS_SEED 42u

/* Lloyd-Max quantizer of |u_j| for u uniform on the unit sphere of R^8 (STRATEGIES.md §2) */
static const float KVS_PARIS_LM_THRESH[7] = {.0843f, .1698f, .2578f, .3499f, .4487f, .5585f, .6901f};
static const float KVS_PARIS_LM_CENTER[8] = {.0420f, .1266f, .2130f, .3025f, .3973f, .5001f, .6169f, .7633f};
static const double KVS_PARIS_TIER_FRAC[KVS_PARIS_TIERS] = {.05, .15, .30, .50, .75, 1.0};

/* I32 words per (slot, KV head) in the codes buffer */
static inline int kvs_paris_words(int head_dim) { return (head_dim / KVS_PARIS_M + head_dim / 2 + 3) / 4; }

/* Per selection row (I32 [n][KVS_PARIS_ROW_N]): row r is sequence r of m (the lead decode rows). */
enum {
    KVS_PARIS_ROW_SLOT = 0,      /* request slot (index of counts) */
    KVS_PARIS_ROW_NR,            /* retrieval tokens n_r (encoded); 0: the row is skipped */
    KVS_PARIS_ROW_SINK,          /* sink tokens */
    KVS_PARIS_ROW_CTX,           /* context (pos + 1) */
    KVS_PARIS_ROW_KEEP,          /* ceil(beta n_r): candidates kept by vote */
    KVS_PARIS_ROW_TOPK,          /* final top-k (<= keep) */
    KVS_PARIS_ROW_T0,            /* the 6 tier thresholds ceil(n_r rho t_j) */
    KVS_PARIS_ROW_N = KVS_PARIS_ROW_T0 + KVS_PARIS_TIERS,
};

/* Encode job (I32 [n][4]): sequence s of m, request slot, positions [from, to). */
enum { KVS_PARIS_JOB_SEQ = 0, KVS_PARIS_JOB_SLOT, KVS_PARIS_JOB_FROM, KVS_PARIS_JOB_TO, KVS_PARIS_JOB_N };

struct kvs_paris_kernels {
    const char *name;
    /* 0, or -ENOSYS with a message when these kernels cannot take head_dim (NULL: any). */
    int (*supports)(int head_dim, char *err, size_t errlen);
    /* Encodes, for each job, the keys of positions [from, to) of its sequence (kc: one layer's
     * K pool, read through m's block tables) into codes / w at their index slots, and adds them
     * to counts[slot][layer]. The index slot of position p is it[p / block_size] * block_size +
     * p % block_size with it the sequence's row of idx_tables (I32 [n_seqs][m->max_blocks]), or
     * of m's block tables when idx_tables is NULL (the index paged like the pool; with host
     * offload the policy pages it by host page instead, so that it outlives the pool blocks, and
     * select then gets a meta whose block tables are the same index tables). h_jobs: host copy
     * of jobs. signs F32 [head_dim]. */
    void (*encode)(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                   const struct kvs_dbuf *idx_tables, const struct kvs_dbuf *jobs, const int32_t *h_jobs, int n_jobs,
                   int layer, int n_layers, int n_kv_heads, int head_dim, int block_size, const struct kvs_dbuf *signs,
                   struct kvs_dbuf *codes, struct kvs_dbuf *w, struct kvs_dbuf *counts);
    /* Selection for rows 0 .. n-1 (rows: I32 [n][KVS_PARIS_ROW_N], h_rows its host copy; q ACT
     * [.][n_heads][head_dim], row r's query is q row r). Writes n_spans I32 [n][n_kv_heads],
     * spans I32 [n][n_kv_heads][max_spans][2] (max_spans >= topk + 2), and, when sel / coarse are
     * not NULL, the chosen positions I32 [n][n_kv_heads][max_topk] (ascending; -1 past topk)
     * and the top-topk positions by vote alone (the coarse stage's recall). Rows with n_r = 0
     * get the one span [0, ctx). */
    void (*select)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_attn_meta *m,
                   const struct kvs_dbuf *rows, const int32_t *h_rows, int n, int layer, int n_layers, int n_heads,
                   int n_kv_heads, int head_dim, int block_size, const struct kvs_dbuf *signs,
                   const struct kvs_dbuf *codes, const struct kvs_dbuf *w, const struct kvs_dbuf *counts, int max_spans,
                   int max_topk, struct kvs_dbuf *n_spans, struct kvs_dbuf *spans, struct kvs_dbuf *sel,
                   struct kvs_dbuf *coarse);
    /* The exact top-topk retrieval positions by <k, qbar> (the recall reference), same ties
     * and output layout as sel. */
    void (*exact_topk)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                       const struct kvs_attn_meta *m, const int32_t *h_rows, int n, int n_heads, int n_kv_heads,
                       int head_dim, int block_size, int max_topk, struct kvs_dbuf *out);
    /* ---- host offload of the retrieval zone (kv.paris.offload) ------------------------------
     * Host pages: page p holds block_size positions of one request for every layer, K and V
     * apart, in the KV pool's element type (kv_elem_bytes: CPU fp32, CUDA bf16), laid out as
     * the pool: host_k[p][layer][n_kv_heads][block_size][head_dim] (host_v alike). A request's
     * page table pages[slot][j] (I32 [max_slots][page_stride], -1: none) names the page of its
     * positions [j block_size, (j + 1) block_size). */
    int kv_elem_bytes;
    /* Host memory the kernels read and write in place (CUDA: cudaHostAlloc, mapped and portable;
     * with unified addressing the host pointer is the device pointer, read over PCIe/NVLink:
     * UVA), or NULL with a message. CPU: plain memory (the same memory). */
    void *(*host_alloc)(struct kvs_backend *b, size_t bytes, char *err, size_t errlen);
    void (*host_free)(struct kvs_backend *b, void *p);
    /* Writes layer `layer`'s K/V of each job's positions [from, to) (read from kc / vc through
     * m's block tables) to the pages of the job's slot; positions whose page is -1 are skipped. */
    void (*write_out)(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                      const struct kvs_attn_meta *m, const struct kvs_dbuf *jobs, const int32_t *h_jobs, int n_jobs,
                      int layer, int n_layers, int n_kv_heads, int head_dim, int block_size,
                      const struct kvs_dbuf *pages, int page_stride, void *host_k, void *host_v);
    /* The gather: for rows 0 .. n-1 and each KV head, the positions of the spans (n_spans /
     * spans as select wrote them, ascending) are copied in order to the row's staging positions
     * 0, 1, ...: staging block r * stage_blocks + i of stage_k / stage_v (the pool's layout)
     * holds staging positions [i block_size, (i + 1) block_size). A position of the retrieval
     * zone [sink, sink + n_r) whose page (pages[slot][p / block_size]) is not -1 is read from
     * the host page (over UVA on CUDA), every other from the pool. The caller makes sure the
     * positions fit (stage_blocks block_size per row) and gives attention_spans the staging
     * block tables and spans [0, count). */
    void (*gather)(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                   const struct kvs_attn_meta *m, const struct kvs_dbuf *rows, const int32_t *h_rows, int n, int layer,
                   int n_layers, int n_kv_heads, int head_dim, int block_size, const struct kvs_dbuf *n_spans,
                   const struct kvs_dbuf *spans, int max_spans, const struct kvs_dbuf *pages, int page_stride,
                   const void *host_k, const void *host_v, struct kvs_dbuf *stage_k, struct kvs_dbuf *stage_v,
                   int stage_blocks);
    /* A KV buffer (the pool's element type) over host memory the kernels read in place: elements
     * [off, off + n) of host (from host_alloc), so that the backend's attention_spans can read host
     * pages through block tables (block b of the view = elements [b E, (b + 1) E) from off, E =
     * n_kv_heads block_size head_dim: with off = layer E, page p of that layer is block p n_layers).
     * Chunked prefill of a request whose retrieval zone already left the pool attends over it
     * this way. The view does not own the memory: host_view_free frees only the view. NULL when
     * the backend cannot (the policy then refuses offload at create). */
    struct kvs_dbuf *(*host_view)(struct kvs_backend *b, void *host, size_t off, size_t n);
    void (*host_view_free)(struct kvs_backend *b, struct kvs_dbuf *view);
};

/* Total order of floats for selection (as kvs_quest_order_key). */
static inline uint32_t kvs_paris_order_key(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* ---- the math of one vector (CPU reference; the tests and the bench use them directly) ---- */
/* signs[d] in {+1, -1} from seed (splitmix64, bit 0 of each draw) */
void kvs_paris_signs(uint32_t seed, int d, float *signs);
/* x <- H diag(signs) x / sqrt(d) in place (d a power of two) */
void kvs_paris_srht(float *x, const float *signs, int d);
/* Encodes key k: cid[B], code[d] (one 4-bit code per byte here), w[B]; returns |k|. */
float kvs_paris_encode_key(const float *k, const float *signs, int d, uint8_t *cid, uint8_t *code, float *w);
/* Rotated unit query qt[d] and |qbar| from qbar[d]. */
float kvs_paris_query(const float *qbar, const float *signs, int d, float *qt);
/* est from the codes (d 4-bit codes, one per byte) and weights */
float kvs_paris_estimate(const uint8_t *code, const float *w, const float *qt, float qnorm, int d);
/* est with no quantization: v = u, alpha = 1 (the exactness test: equals <k, qbar>) */
double kvs_paris_estimate_u(const float *k, const float *signs, const float *qt, float qnorm, int d);
/* Per-block centroid scores of one request (0..6) from its counts [B][256] and thresholds T[6]:
 * tier[b][c]. */
void kvs_paris_tiers(const float *qt, const int32_t *counts, const int32_t *T, int d, uint8_t *tier);
/* Adaptive (beta, rho) by retrieval length n_r (STRATEGIES.md §2 [code]). */
void kvs_paris_adaptive(int n_r, double *beta, double *rho);

/* The CPU reference (always built) and the CUDA kernels (KVS_HAVE_CUDA builds). */
extern const struct kvs_paris_kernels kvs_paris_kernels_cpu;
extern const struct kvs_paris_kernels kvs_paris_kernels_cuda;

/* CUDA builds only (kernels/cuda/kv_paris.cu; the bench's breakdown): 1 makes select record
 * events around its kernels; the last select's times of prep (qbar, SRHT, tiers), vote, keep
 * (top beta n by vote), rerank and top-k + spans in ms, or -1 before any profiled select. */
void kvs_paris_cuda_profile(int on);
int kvs_paris_cuda_last_phases(float ms[5]);

/* The table for backend o, or NULL with a message (-ENOSYS). */
const struct kvs_paris_kernels *kvs_paris_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
