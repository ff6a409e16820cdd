# Build a static binary, then ship it alone in a minimal non-root image.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X worker/internal/startup.Version=${VERSION}" -o /out/worker ./cmd/worker

FROM gcr.io/distroless/static-debian12:nonroot
WORKDIR /app
COPY --from=build /out/worker /app/worker
COPY configs/ /app/configs/
USER nonroot:nonroot
EXPOSE 9090
ENTRYPOINT ["/app/worker"]
CMD ["run"]
