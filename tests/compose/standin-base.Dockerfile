# A local stand-in for python:3.11-slim, for machines that cannot pull from the public image
# registry: Debian bookworm (debootstrap, imported as ROOTFS) with Debian's Python 3.11 in a venv at
# /usr/local, so that `python` and `pip` are on PATH as in the official image. tests/compose/run.sh
# builds it only when `docker pull python:3.11-slim` fails; the project's Dockerfile builds on it unchanged.
ARG ROOTFS=kvdir-standin/debian:bookworm
FROM ${ROOTFS}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /usr/local
# The host's CA bundle, copied after ca-certificates (whose install regenerates the bundle): HTTPS from
# a container goes through the same TLS interception as the host's, and pip must trust it.
COPY host-ca-bundle.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
