/* prompt_layout.c: prompt token ids laid out for the KV reuse strategy (prompt_layout.h). */
#include "engine/prompt_layout.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"

/* Appends a segment (takes ids). */
static void add_seg(struct kvs_prompt_set *ps, int32_t *ids, int n)
{
    if (n <= 0) {
        free(ids);
        return;
    }
    ps->segs = kvs_xrealloc(ps->segs, (size_t)(ps->n_segs + 1) * sizeof *ps->segs);
    ps->segs[ps->n_segs++] = (struct kvs_doc_segment){0, ids, n};
    ps->seg_tokens += n;
}

static int32_t *dup_ids(const int32_t *ids, int n)
{
    int32_t *d = kvs_xmalloc(sizeof *d * (size_t)(n > 0 ? n : 1));
    if (n > 0) memcpy(d, ids, sizeof *d * (size_t)n);
    return d;
}

static int fail(const char **param, const char *which, char *err, size_t errlen, int rc, const char *msg)
{
    *param = which;
    return kvs_err(err, errlen, rc, "%s", msg);
}

/* segments layout of a chat request (the header comment) */
static int build_segmented_chat(const struct kvs_prompt_in *in, struct kvs_prompt_set *ps, const char **param,
                                char *err, size_t errlen)
{
    const char **texts = kvs_xcalloc((size_t)(in->n_docs + 1), sizeof *texts);
    struct kvs_chat_span *spans = kvs_xcalloc((size_t)(in->n_docs + 1), sizeof *spans);
    for (int i = 0; i < in->n_docs; i++) texts[i] = in->docs[i].text;
    char rerr[256] = "";
    char *text = kvs_chat_render_spans(in->chat_format, in->messages, in->n_messages, texts, in->n_docs, spans, rerr,
                                       sizeof rerr);
    free(texts);
    if (!text) {
        free(spans);
        return fail(param, "messages", err, errlen, -EINVAL, rerr);
    }
    size_t at = 0, tlen = strlen(text);
    int rc = 0;
    for (int d = 0; d <= in->n_docs && !rc; d++) {
        size_t end = d < in->n_docs ? spans[d].offset : tlen;
        if (end < at || end > tlen) {
            rc = -1;
            break;
        }
        /* template text before document d (or the tail after the last one) */
        char *piece = kvs_xmalloc(end - at + 1);
        memcpy(piece, text + at, end - at);
        piece[end - at] = 0;
        int32_t *ids = NULL;
        int n = end > at ? kvs_tokenizer_encode_alloc(in->tok, piece, 0, 1, &ids) : 0;
        free(piece);
        if (n < 0) {
            rc = -1;
            break;
        }
        if (d == in->n_docs) {
            ps->ids[0] = ids ? ids : kvs_xmalloc(sizeof *ids);
            ps->len[0] = n;
            break;
        }
        add_seg(ps, ids, n);
        const struct kvs_prompt_doc *doc = &in->docs[d];
        if (spans[d].len == doc->text_len) {
            add_seg(ps, dup_ids(doc->tokens, doc->n_tokens), doc->n_tokens);
        } else {
            char *dt = kvs_xmalloc(spans[d].len + 1);
            memcpy(dt, text + spans[d].offset, spans[d].len);
            dt[spans[d].len] = 0;
            int32_t *dids = NULL;
            int dn = spans[d].len ? kvs_tokenizer_encode_alloc(in->tok, dt, 0, 0, &dids) : 0;
            free(dt);
            if (dn < 0) {
                rc = -1;
                break;
            }
            add_seg(ps, dids, dn);
        }
        at = spans[d].offset + spans[d].len;
    }
    free(text);
    free(spans);
    if (rc || ps->len[0] == 0)
        return fail(param, "messages", err, errlen, -EINVAL,
                    rc ? "cannot tokenize the messages" : "nothing follows the documents");
    return 0;
}

static int build_chat(const struct kvs_prompt_in *in, struct kvs_prompt_set *ps, const char **param, char *err,
                      size_t errlen)
{
    if (in->chat_format == KVS_CHAT_UNKNOWN)
        return fail(param, "messages", err, errlen, -EINVAL,
                    "this model has no chat format configured (set model.chat_format)");
    ps->n = 1;
    ps->ids = kvs_xcalloc(1, sizeof *ps->ids);
    ps->len = kvs_xcalloc(1, sizeof *ps->len);
    if (in->doc_segments && in->n_docs > 0) return build_segmented_chat(in, ps, param, err, errlen);
    const char **texts = kvs_xcalloc((size_t)(in->n_docs + 1), sizeof *texts);
    for (int i = 0; i < in->n_docs; i++) texts[i] = in->docs[i].text;
    char rerr[256] = "";
    char *text = kvs_chat_render(in->chat_format, in->messages, in->n_messages, texts, in->n_docs, rerr, sizeof rerr);
    free(texts);
    if (!text) return fail(param, "messages", err, errlen, -EINVAL, rerr);
    int n = kvs_tokenizer_encode_alloc(in->tok, text, 0, 1, &ps->ids[0]);
    free(text);
    if (n < 0) return fail(param, "messages", err, errlen, -EINVAL, "cannot tokenize the messages");
    ps->len[0] = n;
    return 0;
}

int kvs_prompt_build(const struct kvs_prompt_in *in, struct kvs_prompt_set *ps, const char **param, char *err,
                     size_t errlen)
{
    memset(ps, 0, sizeof *ps);
    ps->segment_align = in->doc_segments && in->segment_align > 0 ? in->segment_align : 1;
    *param = NULL;
    if (in->chat) return build_chat(in, ps, param, err, errlen);
    int doc_tokens = 0;
    for (int d = 0; d < in->n_docs; d++) doc_tokens += in->docs[d].n_tokens;
    ps->n = in->n_prompts;
    ps->ids = kvs_xcalloc((size_t)(ps->n > 0 ? ps->n : 1), sizeof *ps->ids);
    ps->len = kvs_xcalloc((size_t)(ps->n > 0 ? ps->n : 1), sizeof *ps->len);
    int bos = in->tok ? kvs_tokenizer_bos(in->tok) : -1;   /* token-id-only model: no BOS known */
    for (int p = 0; p < in->n_prompts; p++) {
        int32_t *ids = NULL;
        int n;
        if (in->prompt_text[p]) {
            n = kvs_tokenizer_encode_alloc(in->tok, in->prompt_text[p], in->add_special_tokens, 1, &ids);
            if (n < 0) return fail(param, "prompt", err, errlen, -EINVAL, "cannot tokenize the prompt");
        } else {
            n = in->prompt_n_ids[p];
            ids = dup_ids(in->prompt_ids[p], n);
        }
        int lead = (n > 0 && bos >= 0 && ids[0] == bos) ? 1 : 0;
        if (doc_tokens && in->doc_segments) {
            /* a leading BOS is a one-token segment of its own, so it stays first (and is itself
             * computed once) */
            if (p == 0) {
                if (lead) add_seg(ps, dup_ids(ids, 1), 1);
                for (int d = 0; d < in->n_docs; d++) add_seg(ps, dup_ids(in->docs[d].tokens, in->docs[d].n_tokens), in->docs[d].n_tokens);
            }
            memmove(ids, ids + lead, sizeof *ids * (size_t)(n - lead));
            n -= lead;
        } else if (doc_tokens) {
            int32_t *all = kvs_xmalloc(sizeof *all * (size_t)(n + doc_tokens));
            int k = 0;
            if (lead) all[k++] = ids[0];
            for (int d = 0; d < in->n_docs; d++) {
                memcpy(all + k, in->docs[d].tokens, sizeof *all * (size_t)in->docs[d].n_tokens);
                k += in->docs[d].n_tokens;
            }
            memcpy(all + k, ids + lead, sizeof *all * (size_t)(n - lead));
            free(ids);
            ids = all;
            n += doc_tokens;
        }
        ps->ids[p] = ids;
        ps->len[p] = n;
        if (n == 0) return fail(param, "prompt", err, errlen, -EINVAL, "the prompt is empty");
    }
    return 0;
}

void kvs_prompt_set_free(struct kvs_prompt_set *p)
{
    for (int i = 0; i < p->n && p->ids; i++) free(p->ids[i]);
    free(p->ids);
    free(p->len);
    for (int i = 0; i < p->n_segs; i++) free((void *)p->segs[i].tokens);
    free(p->segs);
    memset(p, 0, sizeof *p);
}

int64_t kvs_prompt_slots(const struct kvs_prompt_set *p, int i)
{
    int64_t n = p->len[i], a = p->segment_align > 0 ? p->segment_align : 1;
    for (int d = 0; d < p->n_segs; d++) n += (p->segs[d].n_tokens + a - 1) / a * a;
    return n;
}
