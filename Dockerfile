# A static binary alone in a minimal non-root image.
#
#   docker build --build-arg VERSION=v0.1.0 --build-arg REVISION="$(git rev-parse HEAD)" \
#     --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" -t worker:v0.1.0 .
#
# builds the binary from this source tree. A release (.goreleaser.yaml)
# builds the same image from the binaries it already built, for linux/amd64
# and linux/arm64, with BINARY=prebuilt.
#
# Build arguments:
#   VERSION   the release, reported by `worker version`, the startup log line
#             and worker_build_info{version}, and set as the image's
#             org.opencontainers.image.version. Default: dev, a development
#             build.
#   REVISION  the source revision, reported likewise (worker_build_info
#             {revision}) and set as org.opencontainers.image.revision.
#             Default: empty, and then the binary reports the Go toolchain's
#             vcs.revision stamp, which a build context without .git lacks
#             ("unknown").
#   CREATED   the build time (RFC 3339), reported as the build date and set
#             as org.opencontainers.image.created. Default: empty, "unknown".
#   BINARY    where the binary comes from: source (the default: built in the
#             first stage) or prebuilt (copied from $TARGETPLATFORM/worker in
#             the build context, as GoReleaser lays it out).
ARG BINARY=source

FROM golang:1.26 AS source
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG REVISION=
ARG CREATED=
RUN CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X github.com/worker-dev/worker/internal/startup.Version=${VERSION} -X github.com/worker-dev/worker/internal/startup.Revision=${REVISION} -X github.com/worker-dev/worker/internal/startup.BuildDate=${CREATED}" \
    -o /out/worker ./cmd/worker

FROM scratch AS prebuilt
ARG TARGETPLATFORM
COPY ${TARGETPLATFORM}/worker /out/worker

# BuildKit builds only the stage named here, so a prebuilt image needs no Go
# source in its context.
FROM ${BINARY} AS binary

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
ARG REVISION=
ARG CREATED=
LABEL org.opencontainers.image.title="worker" \
      org.opencontainers.image.description="Fixed-delay jobs under fenced leases, a transactional outbox, an inbox and River tasks, beside PostgreSQL" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="https://github.com/worker-dev/worker" \
      org.opencontainers.image.url="https://github.com/worker-dev/worker" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/static-debian12:nonroot"
WORKDIR /app
COPY --from=binary /out/worker /app/worker
COPY LICENSE NOTICE /app/
COPY configs/ /app/configs/
USER nonroot:nonroot
EXPOSE 9090
# The image has no shell and no curl: the binary asks its own /readyz, at
# the address the container's configuration gives (APP_HTTP_ADDR).
# Kubernetes ignores this and uses the probes in deploy/kubernetes.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["/app/worker", "healthcheck"]
ENTRYPOINT ["/app/worker"]
CMD ["run"]
