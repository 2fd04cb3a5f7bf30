# One image for every kvdir role: `docker run IMAGE directory|gateway|worker|events ...`.
FROM python:3.11-slim

# libibverbs1: the Mooncake transfer engine's import needs it, even for TCP transfers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 kvdir
WORKDIR /app
COPY pyproject.toml README.md ./
COPY directory ./directory
COPY gateway ./gateway
COPY worker_stub ./worker_stub
COPY kvdir ./kvdir
# The index's numba kernels are compiled here, into a cache the image carries, so that a replica's
# first start does not spend seconds compiling them (kvdir bench elections, BENCHMARKS.md).
ENV NUMBA_CACHE_DIR=/var/cache/kvdir-numba
RUN pip install --no-cache-dir . && mkdir -p /data && chown kvdir /data \
 && python -c "from directory.index import warm_up; warm_up()" && chown -R kvdir "$NUMBA_CACHE_DIR"

USER kvdir
# Each role probes its own endpoint: set KVDIR_HEALTH_URL per service (docker-compose.yml does).
HEALTHCHECK --interval=5s --timeout=3s --start-period=20s --retries=5 CMD ["kvdir", "health"]
ENTRYPOINT ["kvdir"]
CMD ["--help"]
