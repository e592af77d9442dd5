# syntax=docker/dockerfile:1
# prefix-epp image: `prefix-epp serve` (the picker) by default; the same image runs the vLLM
# simulator with `prefix-epp sim ...`.
#
#   docker build -t prefix-epp:dev .
#   make image     # without Docker: podman, chroot isolation, a debootstrapped Python base
#                  # (scripts/build-image.sh; `make test` builds and smoke-tests it)
#   docker run --rm prefix-epp:dev serve --help
#   docker run --rm -p 8000:8000 prefix-epp:dev sim --host 0.0.0.0 --port 8000 --model demo
#
# Two stages: the first installs the package and every dependency (binary wheels, no compiler)
# into the virtual environment /opt/prefix-epp without pip's cache; the second copies that
# environment whole into a clean interpreter image. (COPY --from is keyed on the copied content,
# so a layer cache never keeps an image built from older sources; a bind mount from the build
# stage is not, with podman/buildah.) The result runs as UID/GID 65532 and writes nothing outside
# /tmp, so it works with readOnlyRootFilesystem.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# .dockerignore lets only the package sources and build metadata into the context.
COPY . .
RUN python3 -m venv /opt/prefix-epp \
    && /opt/prefix-epp/bin/pip install --no-cache-dir . \
    && rm -rf /src/build

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    PATH=/opt/prefix-epp/bin:$PATH
COPY --from=build /opt/prefix-epp /opt/prefix-epp
RUN prefix-epp serve --help >/dev/null
USER 65532:65532
# ext_proc gRPC, gRPC health, Prometheus metrics (serve); OpenAI API and KV events (sim).
EXPOSE 9002 9003 9090 8000 5557
ENTRYPOINT ["prefix-epp"]
# Serves the quickstart's pool "vllm" in the namespace from $NAMESPACE; the Helm chart and the
# manifests pass their own arguments.
CMD ["serve", "--pool-name=vllm", "--grpc-port=9002", "--grpc-health-port=9003", "--metrics-port=9090"]
