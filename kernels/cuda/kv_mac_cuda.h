/* kv_mac_cuda.h: the CUDA table of MAC-Attention's kernels (kernels/kv_mac.h), defined in
 * kernels/cuda/kv_mac.cu. Only with KVS_HAVE_CUDA=1 (kernels/kv_mac_pick.c hands it out). */
#ifndef KVS_KV_MAC_CUDA_H
#define KVS_KV_MAC_CUDA_H

#include "kernels/kv_mac.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif
extern const struct kvs_mac_kernels kvs_mac_kernels_cuda;
#ifdef __cplusplus
}
#endif
#endif

#endif
