# kvserve build. `make` builds build/kvserve (+ tools), `make test` runs the CPU suite,
# `make test-gpu` the GPU suite (on a GPU machine), `make run` serves SmolLM2-135M-Instruct (`make run-demo` the demo model).
#
# Source layout drives the build, so adding a file needs no Makefile edit:
#   base/ engine/ engine/kv/ engine/text/ models/ kernels/ kernels/cpu/ server/ *.c -> build/libkvserve.a
#   tools/ bench/ *.c (not mains)                         -> build/libkvstools.a (eval harness, bench helpers)
#   any *_main.c                                          -> build/<name> (name: file minus _main.c, '_' -> '-')
#   kernels/cuda/*.cu, kernels/cuda/dev/*.cu              -> linked in when nvcc is found (CUDA=0 forces off)
#   tests/unit/test_*.c                                   -> build/tests/test_*   (run by tests/run)
#   tests/gpu/test_*.c, *.cu                              -> build/tests-gpu/test_* (run by make test-gpu)
#   tests/fuzz/fuzz_*.c                                   -> build/fuzz/fuzz_* (clang libFuzzer, `make fuzz`)

SHELL := /bin/bash
MAKEFLAGS += -j$(shell nproc) --no-print-directory
CC ?= cc
NVCC ?= nvcc
SAN ?= 0

ifeq ($(SAN),1)
BUILD ?= build/san
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
CUDA := 0
else
BUILD ?= build
SANFLAGS :=
endif

ifeq ($(origin CUDA),undefined)
CUDA := $(if $(shell command -v $(NVCC) 2>/dev/null),1,0)
endif

CFLAGS ?= -O2 -g
CFLAGS += -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -pthread -I. -MMD -MP $(SANFLAGS)
LDLIBS := -lmicrohttpd -lcjson -luv -lpcre2-8 -lutf8proc -lopenblas -lm -lpthread -ldl
LDFLAGS += $(SANFLAGS) -pthread

CUDA_HOME ?= $(patsubst %/bin/,%,$(dir $(shell command -v $(NVCC) 2>/dev/null)))
NVCCFLAGS ?= -O3 -std=c++17 -I. -Xcompiler -Wall,-Wextra,-Werror \
  -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90

LIB_SRCS := $(filter-out %_main.c,$(wildcard base/*.c engine/*.c engine/kv/*.c engine/text/*.c models/*.c kernels/*.c \
  kernels/cpu/*.c server/*.c))
TOOL_SRCS := $(filter-out %_main.c,$(wildcard tools/*.c bench/*.c))
MAIN_SRCS := $(wildcard */*_main.c */*/*_main.c)
# cuDNN (prefill-attention kind 26, kernels/cuda/cuda_attn_cudnn.cu), optional and off by default:
# `make CUDA=1 CUDNN=/dir` with cuDNN 9's headers in /dir/include (the PyPI wheel nvidia-cudnn-cu12
# unpacked: nvidia/cudnn) and the cuDNN frontend's headers in CUDNN_FE (default /dir/include; the
# wheel nvidia-cudnn-frontend: include/). libcudnn.so.9 is opened at run time (LD_LIBRARY_PATH).
CUDNN ?=
CUDNN_FE ?= $(CUDNN)/include
CUDNN_CU := kernels/cuda/cuda_attn_cudnn.cu
CU_SRCS := $(if $(filter 1,$(CUDA)),$(filter-out $(if $(CUDNN),,$(CUDNN_CU)),$(wildcard kernels/cuda/*.cu kernels/cuda/dev/*.cu)),)
TEST_SRCS := $(wildcard tests/unit/test_*.c)
GPU_TEST_SRCS := $(wildcard tests/gpu/test_*.c tests/gpu/test_*.cu)

# NCCL (tensor parallelism, kernels/cuda/cuda_tp.cu): built in when nccl.h sits with nvcc's headers
# (the CUDA toolkit's NCCL, or Debian's libnccl-dev: /usr/include); libnccl.so.2 is opened at run time
NCCL_H := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h))
ifeq ($(CUDA),1)
NVCCFLAGS += $(if $(NCCL_H),-DKVS_HAVE_NCCL=1 -I$(dir $(NCCL_H)),)
NVCCFLAGS += $(if $(CUDNN),-DKVS_HAVE_CUDNN=1,)
CFLAGS += -DKVS_HAVE_CUDA=1 -I$(CUDA_HOME)/include
LDLIBS += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcublasLt -lcudart -lstdc++
else
CFLAGS += -DKVS_HAVE_CUDA=0
endif

LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/obj/%.o) $(CU_SRCS:%.cu=$(BUILD)/obj/%.o)
MAIN_BINS := $(foreach f,$(MAIN_SRCS),$(BUILD)/$(subst _,-,$(patsubst %_main.c,%,$(notdir $(f)))))
TEST_BINS := $(TEST_SRCS:tests/unit/%.c=$(BUILD)/tests/%)
GPU_TEST_BINS := $(patsubst tests/gpu/%.cu,$(BUILD)/tests-gpu/%,$(patsubst tests/gpu/%.c,$(BUILD)/tests-gpu/%,$(GPU_TEST_SRCS)))
LIB := $(BUILD)/libkvserve.a
TOOL_OBJS := $(TOOL_SRCS:%.c=$(BUILD)/obj/%.o)
TOOL_LIB := $(BUILD)/libkvstools.a

.PHONY: all setup test test-gpu run run-demo fuzz bench clean format tests-build
all: setup $(MAIN_BINS)

setup:
	@scripts/setup

$(LIB): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	@rm -f $@
	ar rcs $@ $^

$(TOOL_LIB): $(TOOL_OBJS)
	@mkdir -p $(dir $@)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/obj/%.o: %.c | setup
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu | setup
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

# the cuDNN headers only for the file that uses them (-isystem: the frontend's own warnings are not ours)
# (first: a CUDA toolkit may carry cuDNN headers of its own, which CUDNN= must win over)
$(BUILD)/obj/$(CUDNN_CU:.cu=.o): NVCCFLAGS := -I$(CUDNN)/include -isystem $(CUDNN_FE) $(NVCCFLAGS)

# one rule per main: build/<name> from <dir>/<name>_main.c
define MAIN_RULE
$(BUILD)/$(subst _,-,$(patsubst %_main.c,%,$(notdir $(1)))): $(BUILD)/obj/$(1:.c=.o) $(TOOL_LIB) $(LIB)
	$$(CC) $$(LDFLAGS) $$^ -o $$@ $$(LDLIBS)
endef
$(foreach f,$(MAIN_SRCS),$(eval $(call MAIN_RULE,$(f))))

$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/tests-gpu/%: $(BUILD)/obj/tests/gpu/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

# with nvcc (CI too) the GPU test programs are compiled with the rest, so they never rot
tests-build: setup $(MAIN_BINS) $(TEST_BINS) $(if $(filter 1,$(CUDA)),$(GPU_TEST_BINS))

# The README's test command. SAN=1 runs the same suite under ASan+UBSan.
test: tests-build
	@BUILD=$(BUILD) SAN=$(SAN) tests/run

test-gpu: setup $(MAIN_BINS) $(GPU_TEST_BINS)
	@BUILD=$(BUILD) tests/run-gpu

# `make run`: the daemon only (no test venv, no tools); when nvcc was found but no GPU driver
# is present the CUDA kernels are skipped (minutes of nvcc for a build that could not use them).
# It serves SmolLM2-135M-Instruct (fetched by scripts/setup into models/cache); when that fetch
# failed (offline) it says so and serves the embedded demo model, which `make run-demo` serves.
HAVE_GPU_DRIVER := $(shell { [ -e /dev/nvidiactl ] || nvidia-smi -L; } >/dev/null 2>&1 && echo 1)
SMOLLM2 := models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
RUN_BUILD = cuda=$(CUDA); \
	if [ "$$cuda" = 1 ] && [ "$(origin CUDA)" = file ] && [ -z "$(HAVE_GPU_DRIVER)" ]; then \
	  echo "make run: nvcc found but no GPU driver: building the CPU-only daemon (make run CUDA=1 builds the CUDA kernels anyway)"; \
	  cuda=0; \
	fi; \
	KVS_SETUP_PY=0 $(MAKE) CUDA=$$cuda $(BUILD)/kvserve
run:
	@$(RUN_BUILD) && \
	if [ -f $(SMOLLM2) ]; then exec $(BUILD)/kvserve --config config/smollm2.json; \
	else echo "make run: $(SMOLLM2) is missing (the fetch failed or the machine is offline): serving the embedded demo model instead" >&2; \
	exec $(BUILD)/kvserve --config config/default.json; fi

run-demo:
	@$(RUN_BUILD) && exec $(BUILD)/kvserve --config config/default.json

FUZZ_SECONDS ?= 60
fuzz: setup
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz

bench: all
	@scripts/bench-cpu

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cu')

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
.SECONDARY:
