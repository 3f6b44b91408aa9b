# weightq's images, two targets of one Dockerfile (docker-compose.yml, from `weightq compose`, builds both):
#   web     the gateway and Flower: `pip install weightq[flower]`, no torch
#   worker  the engine: torch, transformers, xgrammar and a C/C++ compiler
# The worker's torch is PyPI's torch==2.13.0, the CUDA build, by default. The CPU image is the explicit variant:
#   docker build --target worker --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
# (`weightq compose --cpu N` sets it). Both worker images carry g++: on the CPU, COMPILE=auto compiles the
# paged runner (inductor's C++ and our decode kernel); on CUDA, triton builds its launcher with the C compiler.
FROM python:3.11-slim AS web
WORKDIR /srv/weightq
COPY pyproject.toml README.md ./
COPY app app
COPY tasks tasks
COPY engine engine
COPY batcher batcher
COPY examples examples
RUN pip install --no-cache-dir ".[flower]"
ENV WEIGHTQ_HOME=/data/weightq HF_HOME=/data/hf
EXPOSE 8000 5555
CMD ["weightq", "gateway", "--host", "0.0.0.0"]

FROM web AS worker
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
# empty: PyPI (CUDA); https://download.pytorch.org/whl/cpu: the CPU build
ARG TORCH_INDEX=
# Structured output: xgrammar without its triton requirement, which the CPU path never imports (the CUDA
# torch brings triton anyway); see the Makefile.
RUN pip install --no-cache-dir "torch==2.13.0" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
 && pip install --no-cache-dir ".[worker]" \
 && pip install --no-cache-dir --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2" \
 && python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
CMD ["weightq", "worker", "-l", "INFO"]
