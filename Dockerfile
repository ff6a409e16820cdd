# Build a static binary, then ship it alone in a minimal non-root image.
#
#   docker build --build-arg VERSION=1.4.0 --build-arg REVISION="$(git rev-parse HEAD)" -t worker:1.4.0 .
#
# Build arguments:
#   VERSION   the release, reported by `worker version`, the startup log line
#             and worker_build_info{version}, and set as the image's
#             org.opencontainers.image.version. Default: dev.
#   REVISION  the source revision, reported likewise (worker_build_info
#             {revision}) and set as org.opencontainers.image.revision.
#             Default: empty, and then the binary reports the Go toolchain's
#             vcs.revision stamp, which a build context without .git lacks
#             ("unknown").
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG REVISION=
RUN CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X github.com/worker-dev/worker/internal/startup.Version=${VERSION} -X github.com/worker-dev/worker/internal/startup.Revision=${REVISION}" \
    -o /out/worker ./cmd/worker

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
ARG REVISION=
LABEL org.opencontainers.image.title="worker" \
      org.opencontainers.image.description="Fixed-delay scheduled jobs with distributed leases and a transactional-outbox relay, beside PostgreSQL" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="gcr.io/distroless/static-debian12:nonroot"
WORKDIR /app
COPY --from=build /out/worker /app/worker
COPY configs/ /app/configs/
USER nonroot:nonroot
EXPOSE 9090
# The image has no shell and no curl: the binary asks its own /readyz, at
# the address the container's configuration gives (APP_HTTP_ADDR).
# Kubernetes ignores this and uses the probes in deploy/kubernetes.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["/app/worker", "healthcheck"]
ENTRYPOINT ["/app/worker"]
CMD ["run"]
