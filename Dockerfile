# kvserve in a CUDA runtime image. Build stage compiles with nvcc (Hopper sm_90a + PTX);
# runtime stage carries the daemon, its shared-library dependencies and the demo model.
#   docker build -t kvserve .
#   docker run --gpus all -p 8000:8000 -v /models/x:/model kvserve --model /model --host 0.0.0.0
# Keep the package lists in step with scripts/setup.
ARG CUDA_VERSION=12.8.1
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        build-essential libmicrohttpd-dev libcjson-dev libuv1-dev libpcre2-dev libutf8proc-dev libopenblas-dev \
        bc python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# KVS_SETUP=0: the packages above are what scripts/setup would install for building.
RUN KVS_SETUP=0 make CUDA=1 all

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        libmicrohttpd12t64 libcjson1 libuv1t64 libpcre2-8-0 libutf8proc3 libopenblas0-pthread libcublas-12-8 \
        && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kvserve
COPY --from=build /src/build/kvserve /usr/local/bin/kvserve
COPY --from=build /src/config ./config
COPY --from=build /src/models/demo ./models/demo
EXPOSE 8000
VOLUME ["/model", "/config"]
ENTRYPOINT ["kvserve"]
CMD ["--config", "config/default.json", "--host", "0.0.0.0"]
