/* backend.h: the compute backend interface: ONE table of function pointers that the model
 * runner (engine/runner.c) drives, implemented by kernels/cpu/ (fp32 reference) and
 * kernels/cuda/ (bf16 activations, cuBLAS GEMMs).
 *
 * Buffers. Every tensor the runner touches lives in a backend buffer, an opaque pointer
 * (struct kvs_dbuf *) returned by alloc(). Its element type is fixed by its kind:
 *   KVS_BUF_ACT  activations in the backend's compute type (CPU: fp32, CUDA: bf16 or fp32:
 *                the backend's choice; the runner never reads them directly);
 *   KVS_BUF_F32  fp32 (RoPE inverse frequencies, anything that must stay fp32);
 *   KVS_BUF_I32  int32 (token ids, positions, slot mappings, block tables, ...);
 *   KVS_BUF_KV   KV-cache storage in the backend's KV type (CPU: fp32, CUDA: bf16).
 * Sizes and offsets are always in ELEMENTS of the buffer's kind. Host data moves only through
 * upload()/download() (download converts to fp32 / int32 host arrays).
 * Weights are uploaded once with upload_weight(), which converts the model's tensor (bf16, f16
 * or f32 in the safetensors mmap) to the backend's weight format and returns an opaque handle.
 *
 * Shapes. n = number of token rows in the step (all sequences of the batch concatenated, in
 * batch order). All 2-D tensors are row-major; "[n][d]" means n rows of d contiguous elements.
 * Q is [n][n_heads][head_dim], K and V are [n][n_kv_heads][head_dim], i.e. head h of row t
 * starts at element (t * n_heads + h) * head_dim.
 *
 * KV pool layout (per layer, one KVS_BUF_KV buffer for K and one for V, each
 * [n_blocks][n_kv_heads][block_size][head_dim]): the slot of token position p of a sequence
 * with block table bt is (bt[p / block_size], p % block_size); "slot id" = block *
 * block_size + offset. Keys are stored rotated (RoPE) by the position the runner gave them
 * (segment-relative, see DESIGN "KV-cache subsystem").
 *
 * Semantics shared by all ops:
 *   - Ops are enqueued in order on the backend's single stream; results are visible to later
 *     ops. download() and sync() wait for completion. Ops never allocate.
 *   - Results must be deterministic and batch invariant: the value computed for one row must
 *     not depend on the other rows in the step, on n, or on the thread count (fixed reduction
 *     order per row). The CPU backend is the fp32 reference for every CUDA op.
 *   - Ops do not validate their arguments (the runner validated the batch); bad arguments are
 *     bugs. Errors: ops return void; allocation/upload return NULL / negative errno.
 *
 * Testing a backend: tests/unit/test_cpu_ops.c checks each CPU op against a double reference;
 * another backend's test runs the same op on both backends with the same random inputs and
 * compares (fp32 backends: ~1e-6 relative; bf16 activations: ~1e-2).
 *
 * Ownership: create() returns a backend that free() destroys (with every buffer and weight it
 * still holds). free_buf()/free_weight() release single objects (NULL is a no-op).
 */
#ifndef KVS_BACKEND_H
#define KVS_BACKEND_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

struct kvs_tensor_view;
struct kvs_dbuf;                  /* opaque device buffer (defined by each backend) */
struct kvs_dweight;               /* opaque uploaded weight (defined by each backend) */
struct kvs_backend;               /* opaque backend instance (defined by each backend) */
struct kvs_graph;                 /* opaque recorded step (graph_* ops, optional) */

enum kvs_buf_kind { KVS_BUF_ACT = 0, KVS_BUF_F32 = 1, KVS_BUF_I32 = 2, KVS_BUF_KV = 3 };

/* Sequences of a recorded decode step (engine/runner.c): a batch is rounded up to the next of
 * these, so a backend that prepares per row count (the CUDA backend times its cuBLASLt GEMMs
 * when a weight is uploaded) knows the counts decode steps will use. */
static const int kvs_graph_buckets[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512};
#define KVS_N_GRAPH_BUCKETS ((int)(sizeof kvs_graph_buckets / sizeof kvs_graph_buckets[0]))

/* Per-step attention metadata, all KVS_BUF_I32 buffers already uploaded by the runner (uploads,
 * never written by an op of the step: a backend may read them before the previous op's outputs
 * are ready, as the CUDA decode attention does to overlap its set-up with the previous kernel).
 * Sequence s owns q rows [q_start[s], q_start[s+1]); row q_start[s] + i is the token at
 * position pos[s] + i and attends causally to positions 0 .. pos[s] + i of sequence s,
 * whose slots are named by block_tables[s * max_blocks + j] (j < ceil((pos[s]+n_s)/block_size)).
 * rot_offsets (may be NULL = all zero) has the same shape as block_tables: keys of block j of
 * sequence s are attended as if rotated by rot_offsets[s * max_blocks + j] more positions than
 * they were stored with (deferred RoPE for cached segments; implemented by rotating q backward
 * by that offset for the blocks concerned, with the same inv_freq as rope()).
 * block_valid (may be NULL = every slot valid) has the same shape too: only the first
 * block_valid[s * max_blocks + j] slots of block j are keys; the rest (the unused tail of a cached
 * document's last block, whose contents are undefined) are skipped entirely, never multiplied
 * by zero. */
struct kvs_attn_meta {
    int n_seqs;
    int max_blocks;               /* row stride of block_tables / rot_offsets */
    struct kvs_dbuf *q_start;     /* [n_seqs + 1] */
    struct kvs_dbuf *pos;         /* [n_seqs] */
    struct kvs_dbuf *block_tables;/* [n_seqs][max_blocks] */
    struct kvs_dbuf *rot_offsets; /* [n_seqs][max_blocks] or NULL */
    struct kvs_dbuf *block_valid; /* [n_seqs][max_blocks] or NULL: valid leading slots per block */
    struct kvs_dbuf *inv_freq;    /* F32 [head_dim / 2], for rot_offsets */
    /* host copies of the same arrays (always valid during the call): lets a backend plan its
     * launch (e.g. longest context) without a device round trip */
    const int32_t *h_q_start;
    const int32_t *h_pos;
    int max_ctx;                  /* max over s of pos[s] + n_s */
    struct kvs_dbuf *block_words; /* NULL, or the compact per-block words (the LazyAttention paper
                                   * packs block id, offset and mask together): I32 pairs
                                   * [n_seqs][max_blocks][2] from kvs_pack_block_words; the three
                                   * arrays above stay set (a backend may use either) */
    int plan_ctx;                 /* 0, or a bound >= every decode row's context that the backend
                                   * plans its decode launch for (a recorded step graph is replayed
                                   * while contexts grow up to it) */
    int skip_lead;                /* advisory, for attention() only: the caller overwrites the rows of
                                   * sequences [0, skip_lead) afterwards (a sparse decode policy's
                                   * one-row sequences in a mixed step), so a backend may leave them
                                   * undefined and skip their work (the CPU tile plan and the CUDA
                                   * decode pass do); every other row is computed exactly as with 0.
                                   * 0: compute every row. Only one-row sequences may be named. */
};

/* Packs n blocks' (block id, rotation offset, valid slots) into words[2 i], words[2 i + 1] =
 * block, offset * 2048 + valid (rot / valid may be NULL: offset 0, block_size slots). Returns 0,
 * or -ERANGE when an offset is outside [-2^20, 2^20) or a valid count outside [0, 2047] (the
 * caller then passes the separate arrays only). Decoding: offset = hi >> 11 (arithmetic),
 * valid = hi & 2047. */
static inline int kvs_pack_block_words(const int32_t *bt, const int32_t *rot, const int32_t *valid, size_t n,
                                       int block_size, int32_t *words)
{
    for (size_t i = 0; i < n; i++) {
        int32_t o = rot ? rot[i] : 0, v = valid ? valid[i] : block_size;
        if (o < -(1 << 20) || o >= (1 << 20) || v < 0 || v > 2047) return -34; /* ERANGE */
        words[2 * i] = bt[i];
        words[2 * i + 1] = (int32_t)(((uint32_t)o << 11) | (uint32_t)v);
    }
    return 0;
}

/* Token spans for attention_spans (KV-strategy primitives, engine/kv/kv.h): for each query row
 * t and KV head g, n_spans[t][g] ranges [start, end) of the row's sequence's positions, sorted
 * ascending and disjoint (the caller guarantees it). Positions map to slots through the
 * sequence's block table (struct kvs_attn_meta), so a span may cover any number of blocks. */
struct kvs_span_list {
    int max_spans;                /* capacity per (row, kv head): stride of spans */
    struct kvs_dbuf *n_spans;     /* I32 [n][n_kv_heads] */
    struct kvs_dbuf *spans;       /* I32 [n][n_kv_heads][max_spans][2]: start, end */
    const int32_t *h_n_spans;     /* host copies of both (valid during the call): launch planning */
    const int32_t *h_spans;
};

struct kvs_backend_ops {
    const char *name;             /* "cpu", "cuda" */

    /* ---- lifetime ---------------------------------------------------------------------- */
    /* n_threads: CPU worker threads (0 = number of cores); ignored by GPU backends. */
    struct kvs_backend *(*create)(int n_threads, char *err, size_t errlen);
    void (*free)(struct kvs_backend *b);
    /* Bytes of memory available for the KV pool right now (CPU: MemAvailable; CUDA: free device
     * memory). */
    size_t (*mem_available)(struct kvs_backend *b);
    /* Bytes per element of a kind on this backend. */
    size_t (*elem_size)(struct kvs_backend *b, enum kvs_buf_kind kind);
    void (*sync)(struct kvs_backend *b);

    /* ---- memory ------------------------------------------------------------------------ */
    /* n elements of kind, uninitialised. NULL on failure (out of memory). */
    struct kvs_dbuf *(*alloc)(struct kvs_backend *b, enum kvs_buf_kind kind, size_t n);
    void (*free_buf)(struct kvs_backend *b, struct kvs_dbuf *buf);
    /* dst[off .. off+n) = src (host fp32 for ACT/F32/KV, host int32 for I32). */
    void (*upload)(struct kvs_backend *b, struct kvs_dbuf *dst, size_t off, const void *src, size_t n);
    /* dst (host fp32 for ACT/F32/KV, host int32 for I32) = src[off .. off+n); waits. */
    void (*download)(struct kvs_backend *b, void *dst, const struct kvs_dbuf *src, size_t off, size_t n);
    /* Sets n elements from off to zero. */
    void (*zero)(struct kvs_backend *b, struct kvs_dbuf *buf, size_t off, size_t n);

    /* Converts a model tensor (1-D vector or 2-D [rows][cols] matrix, any kvs_dtype) to the
     * backend's weight format. NULL + message on failure. */
    struct kvs_dweight *(*upload_weight)(struct kvs_backend *b, const struct kvs_tensor_view *t,
                                         char *err, size_t errlen);
    void (*free_weight)(struct kvs_backend *b, struct kvs_dweight *w);

    /* ---- ops (all shapes in elements; see the header comment) --------------------------- */
    /* out[t][:] = emb[tokens[t]][:]; emb [vocab][dim], tokens I32 [n], out ACT [n][dim]. */
    void (*embed)(struct kvs_backend *b, const struct kvs_dweight *emb, const struct kvs_dbuf *tokens,
                  int n, int dim, struct kvs_dbuf *out);

    /* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; x, out ACT [n][dim]; w [dim]. The sum of
     * squares is accumulated in fp32 (or wider). out may equal x. */
    void (*rmsnorm)(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                    float eps, int n, int dim, struct kvs_dbuf *out);

    /* Fused residual add + rmsnorm: res[t] += delta[t]; out[t] = rmsnorm(res[t]) * w.
     * res, delta, out ACT [n][dim] (distinct buffers). */
    void (*add_rmsnorm)(struct kvs_backend *b, struct kvs_dbuf *res, const struct kvs_dbuf *delta,
                        const struct kvs_dweight *w, float eps, int n, int dim, struct kvs_dbuf *out);

    /* Per-head rmsnorm in place (Qwen3 q_norm / k_norm): for each row t and head h,
     * x[t][h][:] = rmsnorm(x[t][h][:]) * w; x ACT [n][n_heads][head_dim], w [head_dim]. */
    void (*head_rmsnorm)(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dweight *w,
                         float eps, int n, int n_heads, int head_dim);

    /* y = x @ W^T (+ bias): x ACT [n][in], W [out][in] (the Hugging Face Linear layout),
     * bias [out] or NULL, y ACT [n][out] (distinct from x). Each y[t][o] is one dot product
     * with a fixed summation order. */
    void (*matmul)(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                   const struct kvs_dweight *bias, int n, int in, int out, struct kvs_dbuf *y);

    /* RoPE in place, neox half-split: for each row t, head h, i < head_dim/2, with
     * p = pos[t] + (rot ? rot[t] : 0) and angle = (float)p * inv_freq[i] (one fp32 multiply, as
     * transformers computes it), cos and sin of that fp32 angle:
     *   a = x[t][h][i], c = x[t][h][i + head_dim/2]
     *   x[t][h][i] = a cos - c sin;  x[t][h][i + head_dim/2] = c cos + a sin.
     * x ACT [n][n_heads][head_dim]; pos, rot I32 [n] (rot may be NULL: the per-token
     * segment-base hook, may be negative); inv_freq F32 [head_dim/2] (kvs_rope_inv_freq). */
    void (*rope)(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dbuf *pos,
                 const struct kvs_dbuf *rot, const struct kvs_dbuf *inv_freq, int n, int n_heads,
                 int head_dim);

    /* Writes K/V rows into their cache slots: for each row t, slot = slots[t] (block *
     * block_size + offset), for each kv head h: kc[block][h][offset][:] = k[t][h][:], same for v.
     * k, v ACT [n][n_kv_heads][head_dim]; slots I32 [n]; kc, vc one layer's KV buffers. */
    void (*kv_write)(struct kvs_backend *b, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                     const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                     struct kvs_dbuf *kc, struct kvs_dbuf *vc);

    /* Paged causal attention over the cache (prefill chunks and decode rows mixed; see
     * struct kvs_attn_meta). q ACT [n][n_heads][head_dim]; query head h reads kv head
     * h / (n_heads / n_kv_heads) (GQA); scores scaled by `scale` (1/sqrt(head_dim)), softmax
     * computed online in fp32 over positions in increasing order; out ACT [n][n_heads][head_dim].
     * The step's own K/V must already be written (kv_write) before this op. */
    void (*attention)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                      const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, int n, int n_heads,
                      int n_kv_heads, int head_dim, int block_size, float scale, struct kvs_dbuf *out);

    /* out[t][i] = silu(gate[t][i]) * up[t][i], silu(x) = x / (1 + exp(-x)); gate, up, out ACT
     * [n][ff]; out may equal gate. */
    void (*swiglu)(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up,
                   int n, int ff, struct kvs_dbuf *out);

    /* out[i][:] = x[rows[i]][:]; x ACT [n_x][dim], rows I32 [m], out ACT [m][dim]. Picks the
     * rows that need logits before the LM head. */
    void (*gather_rows)(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dbuf *rows,
                        int m, int dim, struct kvs_dbuf *out);

    /* Copies KV block src to dst in one layer's K and V buffers (copy-on-write). */
    void (*kv_copy_block)(struct kvs_backend *b, struct kvs_dbuf *kc, struct kvs_dbuf *vc, int src,
                          int dst, int n_kv_heads, int block_size, int head_dim);

    /* Logits copy-out: host[m][vocab] (fp32) = logits ACT [m][vocab]; waits. */
    void (*logits_to_host)(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                           float *host);

    /* ---- optional: step graphs (NULL where the backend has none: CPU) --------------------
     * graph_begin records, instead of running, the ops enqueued until graph_end (no upload,
     * download, zero, alloc or sync in between); graph_end returns the recording (NULL + message
     * on failure); graph_launch replays it: the same ops with the same arguments on the same
     * buffers, whose contents are read at replay time (upload new inputs first). Ownership:
     * graph_free releases a recording (NULL is a no-op); free() does not. */
    void (*graph_begin)(struct kvs_backend *b);
    struct kvs_graph *(*graph_end)(struct kvs_backend *b, char *err, size_t errlen);
    void (*graph_launch)(struct kvs_backend *b, struct kvs_graph *g);
    void (*graph_free)(struct kvs_backend *b, struct kvs_graph *g);

    /* ---- optional: fused ops (NULL: the runner composes them from the ops above) -----------
     * Each gives the results of its composition, within the backend's own rounding (the CUDA
     * backend's are bitwise equal to its separate ops', except matmul_swiglu above the decode
     * GEMM's rows with ff a multiple of 8: there gate and up are rounded to bf16 before SwiGLU,
     * as a bf16 PyTorch model has them, which halves the bytes between the GEMMs and SwiGLU;
     * and over weights laid out by fuse_weights, whose joint GEMM may take another cuBLAS kernel
     * than the separate ones: fp32 rounding level); they exist so a decode step reads x
     * once and launches once where the layer has several projections of the same input, and
     * so the smallest kernels of a step do not each pay a launch. */
    /* For p < n_parts (1 .. 3): y[p] = x @ W[p]^T (+ bias[p]), as matmul(x, w[p], bias[p], n,
     * in, out[p], y[p]) computes it; bias may be NULL (no biases) or hold NULL entries. */
    void (*matmul_multi)(struct kvs_backend *b, const struct kvs_dbuf *x, int n_parts,
                         const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n,
                         int in, const int *out, struct kvs_dbuf *const *y);
    /* gate = silu(x @ Wg^T) * (x @ Wu^T), as matmul, matmul, swiglu: x ACT [n][in], w_gate and
     * w_up [ff][in], gate ACT [n][ff] (the result); up ACT [n][ff] is scratch (undefined after). */
    void (*matmul_swiglu)(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w_gate,
                          const struct kvs_dweight *w_up, int n, int in, int ff, struct kvs_dbuf *gate,
                          struct kvs_dbuf *up);
    /* rope(q, pos, NULL), rope(k, pos, NULL), kv_write(k, v, slots, ...) in one op (same results):
     * q ACT [n][n_heads][head_dim], k and v ACT [n][n_kv_heads][head_dim]; q and k are rotated in
     * place as rope() does, then k and v are written to their slots as kv_write() does. */
    void (*rope_kv_write)(struct kvs_backend *b, struct kvs_dbuf *q, struct kvs_dbuf *k, const struct kvs_dbuf *v,
                          const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq, const struct kvs_dbuf *slots,
                          int n, int n_heads, int n_kv_heads, int head_dim, int block_size, struct kvs_dbuf *kc,
                          struct kvs_dbuf *vc);

    /* ---- ops added later (appended so that positional tables stay valid) ----------------- */
    /* Greedy pick on the device, so a greedy step downloads m token ids instead of m x vocab
     * logits: out[out_off + i] = the index of the maximum of logits[i][0 .. vocab) for i < m,
     * where the lowest index wins among equal maxima (-0.0 == +0.0), NaN entries never win, and
     * -1 means the row has no entry above -inf (all NaN / -inf: nothing can be picked; the
     * sampler's greedy path fails on such a row too, engine/sampler.c). The values compared are
     * those logits_to_host() would return, so the pick equals the sampler's greedy pick on the
     * downloaded row. logits ACT [m][vocab]; out I32, out_off in elements. The result is exact,
     * hence independent of the reduction order. */
    void (*argmax_rows)(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                        struct kvs_dbuf *out, size_t out_off);
    /* Optional (NULL: nothing to gain). Lays the n (2 .. 3) matrices w[0..n), all with the same
     * number of columns, out back to back in one allocation, in that order, so that matmul_multi
     * (q, k, v) and matmul_swiglu (gate, up) over them can run one GEMM instead of n: at 16-256
     * rows a projection with few output columns (k and v) leaves most of a GPU idle on its own.
     * Each w[i] keeps its values and stays a weight like any other for every op; free_weight
     * frees each as before (the storage goes with the last). Results of the fused ops may then
     * differ from the separate matmuls' at fp32 rounding level (another GEMM kernel); nothing
     * else changes. Load time (allocates, copies, synchronises). Returns 0, or a negative errno
     * (-ENOMEM: no memory for the joint copy; -EINVAL: not fusable) with the weights unchanged. */
    int (*fuse_weights)(struct kvs_backend *b, struct kvs_dweight *const *w, int n);
    /* Optional (NULL: the runner calls the two ops). matmul_multi(x, 3, w, bias, n, in,
     * {n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim}, {q, k, v}) then
     * rope_kv_write(q, k, v, pos, inv_freq, slots, n, n_heads, n_kv_heads, head_dim, block_size,
     * kc, vc) in one op, with their results (q, k rotated, v, the cache slots): with q/k/v fused
     * (fuse_weights) a backend takes the joint GEMM's output to the RoPE and the cache write
     * without first splitting it into q, k and v. w = {wq, wk, wv}; bias as matmul_multi's. */
    void (*matmul_rope_kv_write)(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *const *w,
                                 const struct kvs_dweight *const *bias, int n, int in, struct kvs_dbuf *q,
                                 struct kvs_dbuf *k, struct kvs_dbuf *v, const struct kvs_dbuf *pos,
                                 const struct kvs_dbuf *inv_freq, const struct kvs_dbuf *slots, int n_heads,
                                 int n_kv_heads, int head_dim, int block_size, struct kvs_dbuf *kc, struct kvs_dbuf *vc);
    /* Optional (NULL: the runner calls the two ops). matmul_swiglu(x, w_gate, w_up, n, in, ff,
     * gate, up) then matmul(gate, w_down, NULL, n, ff, in, y), with the latter's result in y;
     * gate and up are scratch (undefined after): a backend that rounds the SwiGLU output for the
     * down projection anyway need not write it at full precision. w_down [in][ff], y ACT [n][in]. */
    void (*matmul_swiglu_down)(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w_gate,
                               const struct kvs_dweight *w_up, const struct kvs_dweight *w_down, int n, int in, int ff,
                               struct kvs_dbuf *gate, struct kvs_dbuf *up, struct kvs_dbuf *y);
    /* ---- KV-strategy primitives (engine/kv/kv.h; appended) --------------------------------
     * Every sparse or reuse decode policy builds on these two. */
    /* Attention of each query row over explicit spans of its own sequence only: row t of
     * sequence s (m->q_start) at position pos[s] + i attends, with query head h reading KV head
     * g = h / (n_heads / n_kv_heads), to the keys at the positions of sp's spans for (t, g) that
     * are <= its own position (causal), honouring m's rot_offsets and block_valid as attention()
     * does (slots past a block's valid count are skipped). Softmax in fp32 over the selected
     * positions in increasing order. out ACT [n][n_heads][head_dim] = the normalized output;
     * lse F32 [n][n_heads] = ln sum exp(scale q.k) over the selected keys (natural log). A head
     * with no selected key gets out = 0 and lse = -inf. One span [0, pos + i + 1) per row and
     * head gives attention()'s result (within the backend's rounding) plus its lse. */
    void (*attention_spans)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                            const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, const struct kvs_span_list *sp,
                            int n, int n_heads, int n_kv_heads, int head_dim, int block_size, float scale,
                            struct kvs_dbuf *out, struct kvs_dbuf *lse);
    /* Merges two partial attentions over disjoint key sets, in place into a: per row t and head
     * h, l = logaddexp(lse_a, lse_b); o_a = e^(lse_a - l) o_a + e^(lse_b - l) o_b; lse_a = l
     * (both -inf: o_a = 0, lse_a = -inf). o_a, o_b ACT [n][n_heads][head_dim]; lse F32 [n][n_heads]. */
    void (*attn_merge)(struct kvs_backend *b, struct kvs_dbuf *o_a, struct kvs_dbuf *lse_a, const struct kvs_dbuf *o_b,
                       const struct kvs_dbuf *lse_b, int n, int n_heads, int head_dim);

    /* ---- tensor parallelism (engine/runner_tp.c; appended, all optional) ------------------
     * A tensor-parallel runner holds one backend per rank, each driven by its own thread (the
     * thread that created it, or rank 0's caller); a backend without these ops cannot be a rank
     * and parallel.tensor > 1 is refused on it with -ENOSYS. */
    /* create() on device `device` (GPU index; the calling thread's current device becomes it).
     * NULL: the backend has one device only (create() is used; CPU). */
    struct kvs_backend *(*create_device)(int device, int n_threads, char *err, size_t errlen);
    /* Joins the n backends bs[0..n) (rank i = bs[i], all created by this op table, n >= 2) into a
     * group for allreduce_sum of at most max_elems elements. Called once from one thread after
     * every rank exists; the group lives until the last of its backends is freed. 0, or a
     * negative errno with a message (-ENOSYS: this build has no collective library). */
    int (*tp_group)(struct kvs_backend *const *bs, int n, size_t max_elems, char *err, size_t errlen);
    /* buf[0 .. n) (ACT) = the sum over the group's ranks of each one's buf[0 .. n). Every rank
     * calls it with the same n at the same point of its op sequence, each from its own thread.
     * Enqueued like any op (a recorded graph captures it). All ranks end with the same values. */
    void (*allreduce_sum)(struct kvs_backend *b, struct kvs_dbuf *buf, size_t n);
    /* argmax_rows, plus vals[out_off + i] (F32) = the winning value (what logits_to_host returns
     * for it; anything when the id is -1): a vocabulary-split LM head merges the ranks' picks
     * by value (ties: the lower rank, whose ids are lower). */
    void (*argmax_rows_val)(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                            struct kvs_dbuf *out, struct kvs_dbuf *vals, size_t out_off);

    /* ---- asynchronous steps (engine/runner.c kvs_runner_forward_begin; appended, optional:
     * all three or none) ---------------------------------------------------------------------
     * A step's greedy picks feed the next step's tokens on the device, and the host fetches the
     * picks without waiting for the steps queued after them. */
    /* tokens[pairs[2 i]] = ids[pairs[2 i + 1]] for i < n, or 0 where that id is negative (a row
     * with nothing to pick: its request ends, the row is discarded). tokens, ids, pairs I32. */
    void (*ids_to_tokens)(struct kvs_backend *b, const struct kvs_dbuf *ids, const struct kvs_dbuf *pairs, int n,
                          struct kvs_dbuf *tokens);
    /* Queues a copy of src[0 .. n) (I32, n <= KVS_FETCH_MAX) into the backend's host-side fetch
     * area `slot` (0 or 1) behind the ops queued so far; returns without waiting. */
    void (*fetch_begin)(struct kvs_backend *b, const struct kvs_dbuf *src, size_t n, int slot);
    /* Waits for slot's copy only (not for ops queued after it), then dst[0 .. n) = its values. */
    void (*fetch_end)(struct kvs_backend *b, int slot, int32_t *dst, size_t n);

    /* ---- numerics (appended, optional) ------------------------------------------------------
     * Batch-invariant numerics (config key batch_invariant): on > 0, every later step computes a
     * decode row with the same operations in the same order whatever the batch around it (its
     * size, the other rows' contexts, a recorded graph's capacity); 0: the backend's default,
     * which may plan by batch for speed. NULL: the backend is batch-invariant always (CPU). */
    void (*set_batch_invariant)(struct kvs_backend *b, int on);
};

/* Capacity of a fetch area (fetch_begin), in int32 elements. */
#define KVS_FETCH_MAX 65536

/* The greedy pick that argmax_rows defines, on one host row: the first maximum (lowest index
 * among equal maxima), NaN skipped; -1 when nothing is above -inf. The CPU backend's op and
 * the sampler's greedy path (engine/sampler.c) both use it, so they cannot drift apart. */
static inline int32_t kvs_argmax_row(const float *x, int n)
{
    int32_t best = -1;
    float bv = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        const float v = x[i];
        if (v != v) continue;
        if (best < 0 || v > bv) {
            best = i;
            bv = v;
        }
    }
    return best >= 0 && bv == -INFINITY ? -1 : best;
}

/* The CPU backend (always built). */
extern const struct kvs_backend_ops kvs_cpu_backend;
/* The CUDA backend: kernels/cuda/ defines `const struct kvs_backend_ops kvs_cuda_backend` (with C
 * linkage) and declares it in kernels/cuda/cuda_backend.h; kvs_backend_pick finds it when that
 * header exists and the build has nvcc (KVS_HAVE_CUDA=1). device "auto" prefers it when it
 * reports a usable GPU (create() returning NULL falls back to the CPU: the caller's job). */

/* The backend a device name means ("auto", "cpu", "cuda"; kernels/backend_pick.c): NULL with a
 * message for an unknown name (-EINVAL) or a backend this build lacks (-ENOSYS). */
const struct kvs_backend_ops *kvs_backend_pick(const char *device, char *err, size_t errlen);
/* 0 when backend o can run attention with this head shape, else -ENOTSUP with a message. */
int kvs_backend_supports_model(const struct kvs_backend_ops *o, int n_heads, int n_kv_heads, int head_dim, char *err,
                               size_t errlen);

#endif
