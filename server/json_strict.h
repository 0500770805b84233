/* json_strict.h: what strict JSON (RFC 8259) asks of a request body beyond what cJSON checks:
 * the bytes are valid UTF-8 (no overlong forms, surrogates or code points above U+10FFFF), no
 * NUL byte anywhere, and no raw control character (below 0x20) inside a string; and duplicate
 * object keys resolve as in JavaScript and Python: the last one wins.
 *
 * Ownership: kvs_json_check_bytes writes its message into caller storage; kvs_json_dedupe_keys
 * edits the tree in place (the dropped items are freed). Errors: kvs_json_check_bytes returns
 * 0 or -EINVAL with msg naming the problem and its byte offset.
 */
#ifndef KVS_SERVER_JSON_STRICT_H
#define KVS_SERVER_JSON_STRICT_H

#include <stddef.h>

struct cJSON;

int kvs_json_check_bytes(const char *body, size_t len, char *msg, size_t msglen);
/* Keeps only the last of each set of equal keys (case-sensitive), in every object of the tree. */
void kvs_json_dedupe_keys(struct cJSON *root);

#endif
