/* tokenizer_internal.h: the inside of struct kvs_tokenizer, shared by the tokenizer_*.c files.
 *
 * tokenizer_load.c parses tokenizer.json (+ configs) into this struct; tokenizer_text.c holds
 * UTF-8, byte-level and hashing helpers; tokenizer_bpe.c the merge core; tokenizer.c the
 * encode pipeline (added tokens -> normalizer -> pre-tokenizer -> BPE -> post-processor),
 * decode and streaming decode. Everything here is owned by the tokenizer and freed by
 * kvs_tokenizer_free. Nothing in it is mutated after load (thread-safe reads).
 */
#ifndef KVS_TOKENIZER_INTERNAL_H
#define KVS_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/text/tokenizer.h"

/* ---- growable byte / id buffers (per call scratch) ---- */
struct tk_buf {
    char *p;
    size_t n, cap;
};
struct tk_ids {
    int32_t *p;
    size_t n, cap;
};
int tk_buf_put(struct tk_buf *b, const void *s, size_t n);    /* 0 or -ENOMEM */
int tk_ids_push(struct tk_ids *v, int32_t id);                  /* 0 or -ENOMEM */

/* ---- string -> id hash (open addressing; keys point into memory owned elsewhere) ---- */
struct tk_strmap_ent {
    const char *s;
    uint32_t len;
    int32_t val;
};
struct tk_strmap {
    struct tk_strmap_ent *e; /* [cap], s == NULL: empty */
    uint32_t cap;            /* power of two */
    uint32_t n;
};
int tk_strmap_init(struct tk_strmap *m, uint32_t expected);
/* Inserts (keeps the first value when the key exists; returns 1 then). 0 inserted, -ENOMEM. */
int tk_strmap_put(struct tk_strmap *m, const char *s, uint32_t len, int32_t val);
int32_t tk_strmap_get(const struct tk_strmap *m, const char *s, size_t len); /* -1 if absent */
void tk_strmap_free(struct tk_strmap *m);

/* ---- merge table: (left id, right id) -> (rank, merged id) ---- */
struct tk_merge_ent {
    uint64_t key;   /* (left << 32) | right; UINT64_MAX = empty */
    int32_t rank;
    int32_t id;
};
struct tk_mergemap {
    struct tk_merge_ent *e;
    uint32_t cap, n;
};
int tk_mergemap_init(struct tk_mergemap *m, uint32_t expected);
int tk_mergemap_put(struct tk_mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t id);
const struct tk_merge_ent *tk_mergemap_get(const struct tk_mergemap *m, int32_t a, int32_t b);
void tk_mergemap_free(struct tk_mergemap *m);

/* ---- UTF-8 ---- */
/* Length of the valid UTF-8 sequence at s (1..4) with its code point, or -k where k >= 1 is the
 * length of the maximal invalid subpart (what one U+FFFD replaces, as Rust's from_utf8_lossy
 * and Python's errors="replace" do). When the bytes end inside a sequence that could still be
 * valid, returns 0 (incomplete). */
int tk_utf8_next(const uint8_t *s, size_t n, uint32_t *cp);
/* Appends the lossy UTF-8 form of s to out (invalid subparts become U+FFFD). */
int tk_utf8_lossy(struct tk_buf *out, const char *s, size_t n);
int tk_utf8_valid(const char *s, size_t n);
int tk_utf8_put(char *out, uint32_t cp); /* writes 1..4 bytes */
int tk_is_whitespace(uint32_t cp);       /* Unicode White_Space */

/* GPT-2 byte <-> unicode mapping */
uint32_t tk_byte_to_cp(uint8_t b);
int tk_cp_to_byte(uint32_t cp); /* -1 if cp is not one of the 256 */

/* ---- pipeline descriptions parsed from tokenizer.json ---- */
enum tk_norm_kind { TK_NORM_NFC, TK_NORM_NFD, TK_NORM_NFKC, TK_NORM_NFKD, TK_NORM_PREPEND, TK_NORM_REPLACE };
struct tk_norm {
    enum tk_norm_kind kind;
    char *a;    /* PREPEND: text; REPLACE: literal pattern */
    char *b;    /* REPLACE: replacement */
    size_t alen, blen;
};

enum tk_split_behavior { TK_SPLIT_REMOVED, TK_SPLIT_ISOLATED, TK_SPLIT_MERGED_PREV, TK_SPLIT_MERGED_NEXT, TK_SPLIT_CONTIGUOUS };
enum tk_pre_kind { TK_PRE_SPLIT, TK_PRE_BYTELEVEL, TK_PRE_METASPACE, TK_PRE_DIGITS };
struct tk_pre {
    enum tk_pre_kind kind;
    pcre2_code *re;               /* SPLIT (and BYTELEVEL with use_regex) */
    enum tk_split_behavior behavior;
    int invert;
    int add_prefix_space;         /* BYTELEVEL */
    int prepend_scheme;           /* METASPACE: 0 never, 1 first, 2 always */
    int split;                    /* METASPACE */
    int individual_digits;        /* DIGITS */
    char replacement[8];          /* METASPACE: UTF-8 of the replacement char */
};

enum tk_dec_kind { TK_DEC_NONE, TK_DEC_BYTELEVEL, TK_DEC_PIECES };

struct tk_added {
    char *content;
    uint32_t len;
    int32_t id;
    uint8_t special, lstrip, rstrip, single_word, normalized;
};

/* A byte trie over added-token contents for leftmost-longest matching: edges live in a
 * hash keyed by (node, byte), reusing the merge table's layout. */
struct tk_trie {
    struct tk_mergemap edges;   /* (node, byte) -> child node in .id */
    int32_t *term;              /* [n_nodes]: value of the entry ending here, or -1 */
    int32_t n_nodes;
    uint8_t first[256];         /* 1 if some entry starts with this byte */
};

/* Word -> ids cache for short pre-tokenized words (direct-mapped, behind a mutex: the only
 * mutable state of a loaded tokenizer; the results are the same with or without it). */
#define TK_CACHE_SLOTS 32768
#define TK_CACHE_WORD 23
#define TK_CACHE_IDS 7
struct tk_cache_slot {
    uint8_t wlen, nids;           /* wlen 0: empty */
    char word[TK_CACHE_WORD];
    int32_t ids[TK_CACHE_IDS];
};
struct tk_cache;

struct kvs_tokenizer {
    /* tokens, indexed by id: [n_ids] */
    int32_t n_ids;              /* max id + 1 */
    char **tok_str;             /* token text as in the file (NULL for holes) */
    uint32_t *tok_len;
    char **tok_dec;             /* decoded bytes of the token (the decoder's per-token form) */
    uint32_t *tok_dec_len;
    int16_t *tok_byte;          /* byte value of a <0xXX> byte-fallback token, else -1 */
    uint8_t *tok_special;       /* special added token */

    struct tk_strmap vocab;     /* model vocab: token -> id */
    struct tk_mergemap merges;
    int byte_level;             /* BPE input is the GPT-2 byte mapping of the text */
    int32_t byte_id[256];       /* byte_level: id of each byte's mapped char; SentencePiece: <0xXX> id */
    int byte_fallback;
    int ignore_merges;
    int32_t unk_id;             /* -1 if none */
    int sp_split;               /* no pre-tokenizer, and no token has "▁" after another character:
                                 * words can be cut before each "▁" without changing the result */
    int fuse_unk;

    struct tk_added *added;
    int n_added;
    struct tk_trie trie_raw;    /* added tokens with normalized=false */
    struct tk_trie trie_norm;   /* normalized=true, matched on normalized text */
    char **added_norm;          /* normalized content per added token (NULL if not normalized) */
    uint32_t *added_norm_len;

    struct tk_norm *norms;
    int n_norms;
    struct tk_pre *pres;
    int n_pres;

    enum tk_dec_kind dec_kind;
    int dec_strip_start;        /* PIECES: leading spaces stripped from the whole text */
    int dec_byte_fallback;      /* PIECES: <0xXX> tokens are bytes */
    int dec_join_space;         /* NONE: tokens joined with " " */

    int32_t *pre_ids, *post_ids;  /* post-processor ids around the sequence */
    int n_pre_ids, n_post_ids;

    struct tk_cache *cache;     /* NULL: no cache (allocation failed) */

    int32_t bos;
    int32_t *eos;
    int n_eos;
    int add_bos_default;
};

/* BPE over one pre-tokenized word, appending ids to out (tokenizer_bpe.c). */
int tk_bpe_word(const struct kvs_tokenizer *t, const char *w, size_t n, struct tk_ids *out, void *scratch);
void *tk_bpe_scratch_new(void);
void tk_bpe_scratch_free(void *scratch);

/* Word cache (tokenizer.c). */
struct tk_cache *tk_cache_new(void);
void tk_cache_free(struct tk_cache *c);

/* Trie helpers (tokenizer_load.c builds, tokenizer.c matches). */
int tk_trie_build(struct tk_trie *tr, const char *const *strs, const uint32_t *lens, const int32_t *vals, int n);
void tk_trie_free(struct tk_trie *tr);
/* Length of the longest entry that is a prefix of s and its value in *val, or 0. */
size_t tk_trie_longest(const struct tk_trie *tr, const char *s, size_t n, int32_t *val);

/* Applies the normalizers to s (valid UTF-8) into out (cleared first). */
int tk_normalize(const struct kvs_tokenizer *t, const char *s, size_t n, struct tk_buf *out);

#endif
