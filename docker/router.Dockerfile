# syntax=docker/dockerfile:1
# The kvroute router, built from this repository's source. The same image runs the emulated
# SGLang worker (`kvroute emulate`) of the compose file's `emulated` profile.
#
#   docker build -f docker/router.Dockerfile -t kvroute-router .      # from the repo root
#   docker run -p 8000:8000 -e KVROUTE_WORKER_URLS=http://gpu-1:30000,http://gpu-2:30000 \
#       -e KVROUTE_ADMIN_TOKEN=... kvroute-router
#
# Configuration is the KVROUTE_* environment (router_service/settings.py): worker URLs,
# policy, Redis, admin token, timeouts. Flags on the command line override it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Only what the wheel needs: the build context is filtered by .dockerignore as well.
WORKDIR /opt/kvroute/src
COPY pyproject.toml setup.py README.md ./
COPY kvroute ./kvroute
COPY router_service ./router_service
COPY models ./models
COPY engine_ext ./engine_ext
COPY sim ./sim

# Every runtime dependency ships as a manylinux wheel for CPython 3.11: no compiler needed
# (kvroute's optional C loops for RLT eviction are skipped here; the router never evicts).
# The source tree is removed after the install; the user owns only its home and the
# model-snapshot directory (KVROUTE_MODEL_SNAPSHOT_PATH=/var/lib/kvroute/models.kvrm).
RUN pip install --no-cache-dir . \
    && kvroute --version \
    && rm -rf /opt/kvroute/src \
    && groupadd --system --gid 10001 kvroute \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kvroute kvroute \
    && install -d -o kvroute -g kvroute /var/lib/kvroute

# Numeric, so a runtime that checks runAsNonRoot (Kubernetes) can verify it without /etc/passwd.
USER 10001:10001
WORKDIR /home/kvroute
EXPOSE 8000

# Python instead of curl (the slim image has none). /health is 503 while no worker is healthy
# or while draining, so Docker reports the replica unhealthy then. The emulated workers use
# the same image on port 30000: they set KVROUTE_HEALTH_URL.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('KVROUTE_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=4)"]

CMD ["kvroute", "serve", "--host", "0.0.0.0", "--port", "8000"]
