// Package release checks the release artifacts that .goreleaser.yaml
// builds. It has no code of its own: its test, built with the release tag,
// inspects a snapshot in dist/ (scripts/release-check makes one and runs
// it).
package release
