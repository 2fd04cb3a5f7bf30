# One image for every kvdir role: `docker run IMAGE directory|gateway|worker|events ...`.
FROM python:3.11-slim

# The shared libraries the Mooncake transfer engine loads (its import needs them even for TCP
# transfers); the check after `pip install` below fails the build if any dependency lacks one.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 kvdir
COPY pyproject.toml README.md /src/
COPY kvproto /src/kvproto
COPY directory /src/directory
COPY gateway /src/gateway
COPY worker_stub /src/worker_stub
COPY adapters /src/adapters
COPY kvtransfer /src/kvtransfer
COPY kvdir /src/kvdir
COPY kvtools /src/kvtools
# Installed, then the sources removed: a copy of a package beside the installed one would be imported
# instead of it from that directory (numba's cache is keyed by the source's path: the warm-up below once
# compiled /src's kernels while every replica ran site-packages' and compiled its own at each start).
ENV NUMBA_CACHE_DIR=/var/cache/kvdir-numba
RUN pip install --no-cache-dir /src && rm -rf /src && mkdir -p /data && chown kvdir /data
WORKDIR /home/kvdir
# Every extension module of every dependency finds its shared libraries, or the build fails. Left out:
# numba's optional TBB and OpenMP threading layers, never loaded (kvdir's kernels are not parallel).
RUN missing=$(find "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" -name '*.so*' -type f \
        ! -path '*/numba/np/ufunc/tbbpool*' ! -path '*/numba/np/ufunc/omppool*' \
        -exec sh -c 'ldd "$1" | grep "not found" | sed "s|^|$1:|"' _ {} \;) \
 && if [ -n "$missing" ]; then echo "shared libraries missing from the image:"; echo "$missing"; exit 1; fi \
 && python -c "import mooncake.engine"
# The index's numba kernels are compiled here, into a cache the image carries, so that a replica's
# first start loads them (a replica logs "N loaded from numba's cache, 0 compiled") instead of
# spending seconds compiling them (kvdir bench elections, BENCHMARKS.md).
RUN python -c "from kvproto.index import warm_up; assert warm_up()[1] > 0" && chown -R kvdir "$NUMBA_CACHE_DIR"

USER kvdir
# Each role probes its own endpoint: set KVDIR_HEALTH_URL per service (docker-compose.yml does).
HEALTHCHECK --interval=5s --timeout=3s --start-period=20s --retries=5 CMD ["kvdir", "health"]
ENTRYPOINT ["kvdir"]
CMD ["--help"]
