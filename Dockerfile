# The idem binary, for docker-compose.yml's consumer and migrate services.
# Base images are named by tag here; pin them by digest for an image you ship (docs/security.md).
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -o /idem ./cmd/idem && mkdir -p /work

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /idem /idem
# /work holds publish's manifest; owned by the image's non-root user, so a
# named volume mounted there starts writable.
COPY --from=build --chown=65532:65532 /work /work
ENTRYPOINT ["/idem"]
