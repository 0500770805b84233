/* kv_storage_lean.h: what a decode policy with kernels of its own (kv.decode = mac) may read of
 * kv.storage = lean's static pages (engine/kv/kv_storage_lean.c), so that its kernels can
 * dequantize them on read instead of going through the format's attention ops.
 *
 * Ownership: the storage keeps the pages; the pointer is valid until the storage is destroyed.
 * Errors: NULL when the view is not a lean storage's or the storage is in the dynamic mode
 * (kv.lean.mode = dynamic: tokens live in per-request tiers, not at block-table slots). */
#ifndef KVS_KV_STORAGE_LEAN_H
#define KVS_KV_STORAGE_LEAN_H

#include "engine/kv/kv.h"
#include "kernels/kv_lean.h"

/* The page buffer of v's layer (kernels/kv_lean.h layout) and its format in *f, or NULL. */
const struct kvs_dbuf *kvs_kv_lean_static_pages(const struct kvs_kv_view *v, struct kvs_lean_fmt *f);

#endif
