/* kv_mac.h: the kernels of MAC-Attention (kv.decode=mac, engine/kv/kv_decode_mac.c), one table
 * per backend: kernels/cpu/kv_mac.c (the plain fp32 reference) and kernels/cuda/kv_mac.cu.
 *
 * State (device buffers the policy owns, one ring per request slot and layer, K entries):
 *   ring_q   KV  [slots][layers][K][n_heads][head_dim]  pre-RoPE queries
 *   ring_o   KV  [slots][layers][K][n_heads][head_dim]  normalized rectified outputs
 * (the KV kind: bf16 on CUDA, as STRATEGIES.md §3 sizes the rings; fp32 on the CPU)
 *   ring_lse F32 [slots][layers][K][n_heads]            their log-sum-exp (natural log)
 *   ring_tag I32 [slots][layers][K]                     position + 1 held by the entry, 0 empty
 * Entry j of a ring holds position p = tag - 1 with p mod K == j. The rectified summary of
 * position p is attention of q_p over [0, p - r] (everything but its last r positions), kept
 * as (o, lse); lse = -inf when that set is empty.
 *
 * Rows (I32 [n][4] per step, uploaded by the policy): seq index in the step's kvs_attn_meta,
 * ring slot (request slot, -1: none), position m of the row, flags (KVS_MAC_F_*).
 *
 * match: for rows with F_MATCH, per q head h, the nearest ring entry to q_pre[t][h] by squared
 * L2 distance (bf16 loads on CUDA, q rounded alike; fp32 sums; ties to the lower entry) among entries holding a position < m; hit
 * iff the distance < thresh2 (= 2 d (1 - tau)^2). p[t][h] = the matched position, else -1
 * (rows without F_MATCH: -1).
 * attend: for rows with F_MAC (decode rows), per q head with s = p >= 0 ? max(p - r + 1, 0) : 0
 * and split = max(s, m - r + 1): A = attention over [s, split), B over [split, m], both with the
 * post-RoPE q, honouring the meta's rot_offsets and block_valid like attention_spans;
 * rest = cached (ring entry of p; none on a miss) merged with A, out = rest merged with B
 * (the merge of backend.h attn_merge); lse = out's log-sum-exp. Rows with F_APPEND also store
 * (q_pre, rest) into entry m mod K with tag m + 1; rows with F_APPEND but not F_MAC (prefill rows)
 * compute rest = A over [0, m - r] only and leave out alone (the policy ran attention() there).
 * No subtraction anywhere (STRATEGIES.md §3's split-tail form): nothing cancels.
 * count: for rows with F_COUNT, the matches of layers [0, n_layers) (p from offset 0: [layer][n]
 * [n_heads]) added to the counters (KVS_MAC_C_*) in acc, on the backend: nothing comes back to
 * the host per step, so a step with MAC can be a recorded graph.
 *
 * K/V format: with lean.kbits = 0 kc / vc are the layer's plain KV pool (backend.h layout); with
 * lean set (kv.storage = lean, a static mode) `pages` holds the layer's LeanKV pages
 * (kernels/kv_lean.h layout, kc / vc unused) and every key and value attend() reads is
 * dequantized on read (x^ = s code - z, fp16 s / z; fp16 values at 16 bits), as LeanKV's own
 * attention does: the CPU reference dequantizes in fp32 exactly as kernels/cpu/kv_lean.c, so a
 * miss over [0, m] with the band past m equals LeanKV's attention bitwise; CUDA stages the
 * dequantized tile in bf16 for its tensor cores (the plain pool's precision). supports_lean
 * says which formats and shapes a backend takes (NULL: none).
 *
 * Ownership: the policy's. Errors: ops return void (bad arguments are bugs); the getter
 * returns NULL with a message when a backend has no MAC kernels.
 */
#ifndef KVS_KV_MAC_H
#define KVS_KV_MAC_H

#include <stddef.h>

#include "kernels/backend.h"
#include "kernels/kv_lean.h"

enum { KVS_MAC_F_MATCH = 1, KVS_MAC_F_MAC = 2, KVS_MAC_F_APPEND = 4, KVS_MAC_F_COUNT = 8 };

/* The counters count() accumulates on the backend, each a uint64 held in two I32 elements of the
 * policy's counter buffer (I32 [2 * KVS_MAC_N_COUNTS], zeroed at create): lookups (q heads of
 * F_MATCH rows), hits, q-head attends, the skipped fraction s / (m + 1) summed in units of
 * 2^-24 (KVS_MAC_SKIP_ONE), and the positions the KV groups read (each group's union span). */
enum { KVS_MAC_C_LOOKUPS, KVS_MAC_C_HITS, KVS_MAC_C_HEADS, KVS_MAC_C_SKIP, KVS_MAC_C_READ, KVS_MAC_N_COUNTS };
#define KVS_MAC_SKIP_ONE 16777216.0

struct kvs_mac_call {
    int layer, n_layers, K, band;
    int n, n_heads, n_kv_heads, head_dim, block_size;
    float scale, thresh2;
    const struct kvs_dbuf *q, *q_pre;       /* ACT [n][n_heads][head_dim], after / before RoPE */
    const struct kvs_dbuf *kc, *vc;         /* this layer's KV pool */
    const struct kvs_attn_meta *m;
    const struct kvs_dbuf *rows;            /* I32 [n][4] */
    struct kvs_dbuf *p;                     /* I32 [n][n_heads], from p_off */
    size_t p_off;
    struct kvs_dbuf *ring_q, *ring_o, *ring_lse, *ring_tag;
    struct kvs_dbuf *out;                   /* ACT [n][n_heads][head_dim] */
    struct kvs_dbuf *lse;                   /* F32 [n][n_heads] */
    struct kvs_dbuf *work;                  /* F32 scratch of work_elems() elements (NULL when 0) */
    size_t work_n;
    struct kvs_lean_fmt lean;               /* kbits 0: kc / vc are the plain pool; else LeanKV pages */
    const struct kvs_dbuf *pages;           /* this layer's LeanKV pages (lean.kbits > 0) */
};

struct kvs_mac_kernels {
    /* 0, or -ENOSYS with a message when this head shape has no kernel */
    int (*supports)(int n_heads, int n_kv_heads, int head_dim, char *err, size_t errlen);
    /* F32 scratch elements attend() needs for steps of up to max_rows rows (0: none) */
    size_t (*work_elems)(int max_rows, int n_heads, int head_dim);
    void (*match)(struct kvs_backend *b, const struct kvs_mac_call *c);
    void (*attend)(struct kvs_backend *b, const struct kvs_mac_call *c);
    void (*count)(struct kvs_backend *b, const struct kvs_mac_call *c, struct kvs_dbuf *acc);
    /* 0 when attend() reads LeanKV pages of format f for this shape, else -ENOSYS + message */
    int (*supports_lean)(struct kvs_lean_fmt f, int n_heads, int n_kv_heads, int head_dim, int block_size, char *err,
                         size_t errlen);
};

#ifdef __cplusplus
extern "C" {
#endif
/* The table for backend o, or NULL + message (-ENOSYS) when it has none. */
const struct kvs_mac_kernels *kvs_mac_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen);

extern const struct kvs_mac_kernels kvs_mac_kernels_cpu;
#ifdef __cplusplus
}
#endif

/* (o_a, lse_a) merged with (o_b, lse_b) in place into a: backend.h attn_merge's formula, shared
 * by the CPU reference so the two cannot drift. */
static inline void kvs_mac_merge(float *o_a, float *lse_a, const float *o_b, float lse_b, int d)
{
    const float la = *lse_a;
    if (la == -INFINITY && lse_b == -INFINITY) {
        for (int i = 0; i < d; i++) o_a[i] = 0.0f;
        return;
    }
    const float mx = la > lse_b ? la : lse_b;
    const float ea = expf(la - mx), eb = expf(lse_b - mx), inv = 1.0f / (ea + eb);
    const float wa = ea * inv, wb = eb * inv;
    for (int i = 0; i < d; i++) o_a[i] = wa * o_a[i] + wb * o_b[i];
    *lse_a = mx + logf(ea + eb);
}

#endif
