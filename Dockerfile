# One image for every service of docker-compose.yml (worker, gateway, flower); the command picks the role.
# The worker extra is the engine (torch, transformers); a gateway-only image could leave it out.
# GPU workers: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 and EXTRAS=worker,flower,cuda.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=worker,flower
WORKDIR /srv/weightq
COPY pyproject.toml README.md ./
COPY app app
COPY tasks tasks
COPY engine engine
COPY batcher batcher
COPY bench bench
COPY examples examples
RUN pip install --no-cache-dir "torch==2.13.0" --extra-index-url "$TORCH_INDEX" \
 && pip install --no-cache-dir -e ".[$EXTRAS]" \
 && pip install --no-cache-dir --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
ENV WEIGHTQ_HOME=/data/weightq HF_HOME=/data/hf
EXPOSE 8000 5555
CMD ["weightq", "up", "--host", "0.0.0.0"]
